"""docker-compose.yml and its monitoring provisioning hang together.

With a docker CLI that has the compose plugin, ``docker compose config`` validates the file
(it needs no engine). Without one, the file is parsed and its service graph checked here:
every depends_on target exists, every service has an image or a build, each worker names its
engine, no two services publish one host port, and every file mounted from ``deploy/`` exists.
And nothing is open that should not be: only the API (which checks keys) listens beyond
loopback, and no password is written in the file (each is a required variable).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
SECRETS = {
    "BACKFILL_POSTGRES_PASSWORD": "test-secret",
    "GRAFANA_ADMIN_PASSWORD": "test-secret",
    "BACKFILL_ENGINE_API_KEY": "test-secret",
    "BACKFILL_WEBHOOKS_SECRET_KEYS": "Ty7q2cU1vJ8mFQ6yQZ2r3oKk0xWm4eHnB5pL9sDaG1c=",
}


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return data


def services() -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = compose()["services"]
    return found


def test_docker_compose_config_accepts_the_file_when_the_cli_can_run_it() -> None:
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("no docker CLI")
    probe = subprocess.run(
        [docker, "compose", "version"], capture_output=True, text=True, timeout=30, check=False
    )
    if probe.returncode != 0:
        pytest.skip("the docker CLI has no compose plugin (the YAML checks below still run)")
    env = {**os.environ, **SECRETS}
    for profile in ("gpu", "cpu"):
        result = subprocess.run(
            [docker, "compose", "-f", str(COMPOSE), "--profile", profile, "config", "--quiet"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            cwd=ROOT,
            env=env,
        )
        assert result.returncode == 0, result.stderr
    # Without the secrets, compose refuses to run at all.
    bare = {k: v for k, v in os.environ.items() if k not in SECRETS}
    refused = subprocess.run(
        [docker, "compose", "-f", str(COMPOSE), "--profile", "cpu", "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
        env=bare,
    )
    assert refused.returncode != 0


def test_every_dependency_exists_and_every_service_has_an_image_or_a_build() -> None:
    all_services = services()
    for name, service in all_services.items():
        assert "image" in service or "build" in service, name
        depends = service.get("depends_on") or {}
        for target in depends if isinstance(depends, list) else depends.keys():
            assert target in all_services, f"{name} depends on unknown {target}"
            # A dependency must not sit behind a profile its dependant lacks.
            need = set(all_services[target].get("profiles") or [])
            have = set(service.get("profiles") or [])
            assert not need or need & have, f"{name} needs {target} of profiles {need}"


def test_each_worker_names_its_engine() -> None:
    workers = {n: s for n, s in services().items() if (s.get("command") or [None])[0] == "worker"}
    assert workers
    for name, service in workers.items():
        command = service["command"]
        assert "--engine-url" in command, name
        engine_url = command[command.index("--engine-url") + 1]
        engine = engine_url.split("//", 1)[1].split(":", 1)[0]
        assert engine in services(), f"{name}'s engine {engine} is not a service"
        assert engine in (service.get("depends_on") or {}), name
        assert "--node" in command, name


def published() -> dict[str, list[tuple[str, str]]]:
    """service -> [(host address, host port)] of what it publishes ("" address: every
    interface)."""
    out: dict[str, list[tuple[str, str]]] = {}
    for name, service in services().items():
        for port in service.get("ports") or []:
            parts = str(port).split(":")
            address = parts[0] if len(parts) == 3 else ""
            out.setdefault(name, []).append((address, parts[-2]))
    return out


def test_no_two_services_publish_the_same_host_port() -> None:
    seen: dict[str, str] = {}
    for name, ports in published().items():
        for _, host_port in ports:
            assert host_port not in seen, f"{name} and {seen[host_port]} both publish {host_port}"
            seen[host_port] = name
    assert {"8000", "9090", "3000"} <= set(seen)


def test_only_the_api_listens_beyond_loopback() -> None:
    # Was: Grafana (anonymous viewer, default admin) and Prometheus on every interface.
    for name, ports in published().items():
        for address, host_port in ports:
            if name != "api":
                assert address == "127.0.0.1", f"{name} publishes {host_port} on all interfaces"
    assert "postgres" not in published()
    assert "redis" not in published()


def _required_secret(value: str) -> str:
    """The variable a ``${NAME:?message}`` value requires (compose fails without it)."""
    match = re.fullmatch(r"\$\{([A-Z_]+):\?[^}]*\}", value)
    assert match, f"{value!r} is not a required ${{VAR:?...}} secret"
    return match.group(1)


def test_no_password_is_written_in_the_file() -> None:
    # Was: Postgres with the password 'backfill', Grafana with its default admin/admin.
    all_services = services()
    postgres = _required_secret(all_services["postgres"]["environment"]["POSTGRES_PASSWORD"])
    assert postgres in SECRETS
    url = compose()["x-backfill-env"]["BACKFILL_DATABASE_URL"]
    assert f"${{{postgres}:?" in url
    grafana = all_services["grafana"]["environment"]
    assert _required_secret(grafana["GF_SECURITY_ADMIN_PASSWORD"]) in SECRETS
    assert str(grafana.get("GF_AUTH_ANONYMOUS_ENABLED", "false")).lower() == "false"


def test_webhook_signing_secrets_are_sealed_under_a_key_compose_requires() -> None:
    env = compose()["x-backfill-env"]
    assert _required_secret(env["BACKFILL_WEBHOOKS_SECRET_KEYS"]) in SECRETS
    assert _required_secret(env["BACKFILL_ENGINE_API_KEY"]) in SECRETS


def test_prometheus_scrapes_the_api_and_grafana_is_provisioned() -> None:
    all_services = services()
    mounts: dict[str, str] = {}
    for name in ("prometheus", "grafana"):
        for volume in all_services[name]["volumes"]:
            source, target = volume.split(":")[:2]
            path = ROOT / source
            assert path.exists(), f"{name} mounts missing {source}"
            mounts[target] = source
    prometheus = yaml.safe_load((ROOT / mounts["/etc/prometheus/prometheus.yml"]).read_text())
    targets = [
        t
        for job in prometheus["scrape_configs"]
        for c in job["static_configs"]
        for t in c["targets"]
    ]
    assert "api:8000" in targets
    assert all(t.split(":")[0] in all_services for t in targets)

    provisioning = ROOT / mounts["/etc/grafana/provisioning"]
    datasource = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    [source] = datasource["datasources"]
    assert source["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((provisioning / "dashboards" / "backfill.yml").read_text())
    dashboards_dir = provider["providers"][0]["options"]["path"]
    assert mounts[dashboards_dir] == "./deploy/grafana/dashboards"

    dashboard = json.loads((ROOT / mounts[dashboards_dir] / "backfill.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for metric in (
        "backfill_kv_tokens",
        "backfill_gateway_time_to_first_token_seconds_bucket",
        "backfill_items",
        "backfill_preemptions_total",
        "backfill_deadline_misses_total",
        "backfill_useful_tokens_per_second",
    ):
        assert metric in exprs, metric
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == source["uid"], panel["title"]
