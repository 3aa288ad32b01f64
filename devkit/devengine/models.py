"""The models the development engine builds and serves, and the dtype each is served in on
this CPU (bfloat16 only where the CPU computes it natively): pure, no process started.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelSpec:
    """How one buildable model is built and served."""

    name: str
    build_id: str
    """Recorded in the built folder; a different id makes the next run rebuild."""
    dtype: str
    """The dtype the checkpoint is saved in; it is served in :func:`choose_dtype`'s pick."""
    max_model_len: int
    serve_args: tuple[str, ...] = ()
    """Flags it is served with beyond the usual ones."""
    checkpoint: str | None = None
    """The buildable model whose checkpoint it serves, when not its own."""

    @property
    def embeds(self) -> bool:
        """Served as an embedding model: it answers ``/v1/embeddings``, not generation."""
        return "pooling" in self.serve_args


# vLLM's pooling runner over a decoder checkpoint: the last token's hidden state, normalised,
# is the embedding. vLLM still allocates the KV cache and reports its blocks on /metrics.
POOLING_ARGS = ("--runner", "pooling", "--convert", "embed")

MODELS: dict[str, ModelSpec] = {
    "tiny": ModelSpec(name="tiny", build_id="tiny-1", dtype="float32", max_model_len=2048),
    "smollm2": ModelSpec(
        name="smollm2", build_id="smollm2-1", dtype="bfloat16", max_model_len=2048
    ),
    "tiny-embed": ModelSpec(
        name="tiny-embed",
        build_id="tiny-1",
        dtype="float32",
        max_model_len=2048,
        serve_args=POOLING_ARGS,
        checkpoint="tiny",
    ),
}


# x86 flags (/proc/cpuinfo) of CPUs that compute bfloat16 natively. Elsewhere torch emulates
# it: SmolLM2-135M prefilled ~5x slower in bfloat16 than in float32 on an AVX2 EPYC
# (machines of one kind differ in it from one day to the next).
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a server runs a model in, and why (said in the server's ready line)."""

    dtype: str
    reason: str


def choose_dtype(model_dtype: str, cpu_flags: Collection[str]) -> DtypeChoice:
    """The dtype to serve a checkpoint saved in ``model_dtype`` with on a CPU with
    ``cpu_flags``: bfloat16 only where the CPU computes it natively, else float32 (twice the
    KV bytes per token, so half the pool for the same KV space, but several times the speed)."""
    if model_dtype != "bfloat16":
        return DtypeChoice(model_dtype, "the model's own dtype")
    native = sorted(NATIVE_BF16_FLAGS & set(cpu_flags))
    if native:
        return DtypeChoice("bfloat16", f"the model's own dtype; the CPU has {', '.join(native)}")
    return DtypeChoice(
        "float32",
        "the model is bfloat16 but the CPU has no native bfloat16 "
        f"({' or '.join(sorted(NATIVE_BF16_FLAGS))}), which torch would emulate slowly",
    )


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The first ``flags`` line of ``/proc/cpuinfo`` text (every core lists the same)."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """This machine's CPU flags; empty where there is no ``/proc/cpuinfo``."""
    try:
        return parse_cpu_flags(cpuinfo.read_text(errors="replace"))
    except OSError:
        return frozenset()


def checkpoint_dtype(model_dir: Path) -> str:
    """The dtype a Hugging Face checkpoint is saved in (``auto`` when its config says none)."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return "auto"
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for source in (config, text):
        for key in ("torch_dtype", "dtype"):
            value = source.get(key)
            if isinstance(value, str):
                return value.removeprefix("torch.")
    return "auto"
