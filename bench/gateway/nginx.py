"""nginx (Debian's package) as a plain reverse proxy in front of one vLLM server: the peer an
operator compares the interactive gateway with. Streaming as a proxy for server-sent events
is set up (no buffering, HTTP/1.1 and pooled connections to the engine); nothing else is
done to a request.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from bench.common import served

_CONFIG = """\
worker_processes 1;
daemon off;
pid {root}/nginx.pid;
error_log {root}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {root}/body;
    proxy_temp_path {root}/proxy;
    fastcgi_temp_path {root}/fastcgi;
    uwsgi_temp_path {root}/uwsgi;
    scgi_temp_path {root}/scgi;
    upstream engine {{
        server {upstream};
        keepalive 64;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


class NginxMissing(RuntimeError):
    pass


@contextmanager
def nginx_proxy(
    engine_url: str, port: int, prefix: Sequence[str] = ()
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """nginx on 127.0.0.1:``port`` proxying to ``engine_url`` (``http://host:port``), started
    under ``prefix`` (e.g. ``taskset -c 0``); yields its URL and process."""
    binary = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if Path(p).exists()), None
    )
    if binary is None:
        raise NginxMissing(
            "nginx is not installed: the gateway benchmark measures it beside the gateway "
            "(apt-get install nginx-light), or pass --no-nginx"
        )
    upstream = engine_url.removeprefix("http://").rstrip("/")
    with tempfile.TemporaryDirectory(prefix="bench-nginx-") as root:
        conf = Path(root) / "nginx.conf"
        conf.write_text(_CONFIG.format(root=root, upstream=upstream, port=port))
        url = f"http://127.0.0.1:{port}"
        argv = [*prefix, binary, "-p", root, "-c", str(conf)]
        with served("nginx", argv, f"{url}/health", Path(root) / "out.log", timeout_s=20) as p:
            yield url, p
