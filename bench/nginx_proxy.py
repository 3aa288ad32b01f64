"""nginx (Debian's package) as a plain reverse proxy in front of one vLLM server: the peer an
operator compares the interactive gateway with. Streaming as a proxy for server-sent events
is set up (no buffering, HTTP/1.1 and pooled connections to the engine); nothing else is
done to a request.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

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
        proc = subprocess.Popen(
            [*prefix, binary, "-p", root, "-c", str(conf)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 20
            while True:
                if proc.poll() is not None:
                    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                    raise RuntimeError(f"nginx exited: {err[-2000:]}")
                try:
                    if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("nginx did not answer in 20 s")
                time.sleep(0.1)
            yield url, proc
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
