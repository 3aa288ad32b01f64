"""Engine step times on a real GPU, for the simulator's cost model (run on the GPU machine).

    python -m bench.gpu_step_times --out steps.json [--device cuda] [--model llama-3.1-8b]

No vLLM can be installed where a GPU is lent here (no network; its wheels are larger than
what may be carried), so this times the step itself: a decoder of the model's exact shape
(Llama-3.1-8B: 32 layers, 4,096 wide, 32 query and 8 KV heads, a 14,336 MLP, 128,256 tokens)
with random bfloat16 weights, written in plain PyTorch the way vLLM's V1 engine runs a step:
one pass over every scheduled token, the prompt chunk's attention causal over its own keys,
each decoding sequence's one query over its KV cache (grouped-query attention), logits for
the last token of each sequence only. Each step shape is timed eager and as a CUDA graph
(vLLM captures its steps in graphs; kernel launches are most of an eager small step), the
median of ``--repeats`` after warm-ups.

Stock kernels (PyTorch's scaled-dot-product attention, cuBLAS matmuls, unfused norms and
activations) against vLLM's fused ones: the times are an upper bound on vLLM's on the same
chip, most of all for small steps. ``bench.gpu_steps`` fits the cost model to them and runs
the simulator's policies on it.

Ends with ``gpu_step_times: fit_rms_relative_error=<the simulator's cost model fitted to these
steps> (goal <= 0.1)``. Imports PyTorch, the standard library and ``bench.simulator.gpu_fit``
alone (the GPU machine has nothing else of ours installed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.nn import functional as fn

from bench.simulator.gpu_fit import EAGER, GRAPH, fit

NAME = "gpu_step_times"
FIT_GOAL = 0.1
"""RMS relative error of the simulator's cost model fitted to the steps: within it, the
simulator's linear step model is a fair stand-in for the chip."""


@dataclass(frozen=True)
class Shape:
    """A dense decoder's shape."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int


MODELS = {
    "llama-3.1-8b": Shape(32, 4096, 32, 8, 128, 14336, 128256),
    # For checking this script on a CPU in seconds.
    "tiny": Shape(2, 256, 8, 2, 32, 512, 1000),
}


@dataclass(frozen=True)
class Step:
    """One step's work: a prompt chunk of ``prefill`` tokens (0: none) after ``start`` cached
    ones, and ``decodes`` sequences each generating one token over ``context`` cached."""

    prefill: int = 0
    start: int = 0
    decodes: int = 0
    context: int = 0


# Prompt chunks alone (the attention term needs several lengths), decodes alone (sequences
# and context apart), and both in one step, as a busy engine's steps are.
FULL_GRID = (
    [Step(prefill=p) for p in (64, 128, 256, 512, 1024, 2048, 4096, 8192)]
    + [Step(prefill=2048, start=s) for s in (2048, 6144)]
    + [Step(decodes=b, context=c) for b in (1, 8, 32, 64, 128, 256) for c in (512, 2048)]
    + [
        Step(prefill=256, decodes=64, context=1024),
        Step(prefill=512, decodes=128, context=1024),
        Step(prefill=1024, decodes=32, context=2048),
        Step(prefill=2048, decodes=256, context=1024),
        Step(prefill=4096, decodes=128, context=512),
    ]
)
TINY_GRID = (
    [Step(prefill=p) for p in (16, 64, 128)]
    + [Step(prefill=64, start=64)]
    + [Step(decodes=b, context=c) for b in (1, 4) for c in (32, 128)]
    + [Step(prefill=32, decodes=4, context=64)]
)


class Decoder:
    """Random weights of ``shape``, a KV cache for ``max_seqs`` decoding sequences of up to
    ``max_ctx`` tokens and one for a prompt of up to ``max_prompt``."""

    def __init__(
        self,
        shape: Shape,
        device: torch.device,
        dtype: torch.dtype,
        max_seqs: int,
        max_ctx: int,
        max_prompt: int,
    ) -> None:
        self.s, self.device, self.dtype = shape, device, dtype
        g = torch.Generator(device=device).manual_seed(0)

        def w(*size: int) -> torch.Tensor:
            return (torch.randn(*size, generator=g, device=device, dtype=dtype) * 0.02).contiguous()

        h, kv = shape.hidden, shape.kv_heads * shape.head_dim
        self.embed = w(shape.vocab, h)
        self.lm_head = w(h, shape.vocab)
        self.norm = torch.ones(h, device=device, dtype=dtype)
        self.layers = [
            {
                "attn_norm": torch.ones(h, device=device, dtype=dtype),
                "qkv": w(h, h + 2 * kv),
                "o": w(h, h),
                "mlp_norm": torch.ones(h, device=device, dtype=dtype),
                "gate_up": w(h, 2 * shape.intermediate),
                "down": w(shape.intermediate, h),
            }
            for _ in range(shape.layers)
        ]
        cache = (max_seqs, shape.kv_heads, max_ctx + 1, shape.head_dim)
        self.k_cache = [torch.zeros(cache, device=device, dtype=dtype) for _ in self.layers]
        self.v_cache = [torch.zeros(cache, device=device, dtype=dtype) for _ in self.layers]
        prompt = (1, shape.kv_heads, max_prompt, shape.head_dim)
        self.k_prompt = [torch.zeros(prompt, device=device, dtype=dtype) for _ in self.layers]
        self.v_prompt = [torch.zeros(prompt, device=device, dtype=dtype) for _ in self.layers]
        inv = 1.0 / (10000 ** (torch.arange(0, shape.head_dim, 2, device=device) / shape.head_dim))
        pos = torch.arange(max(max_ctx + 1, max_prompt), device=device)
        angles = torch.outer(pos, inv)
        self.cos = angles.cos().to(dtype)
        self.sin = angles.sin().to(dtype)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: (tokens, heads, head_dim)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        a, b = x[..., ::2], x[..., 1::2]
        return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)

    @staticmethod
    def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + 1e-5)).to(x.dtype) * weight

    def inputs(self, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, self.s.vocab, (step.prefill + step.decodes,), device=self.device)
        positions = torch.cat(
            (
                torch.arange(step.start, step.start + step.prefill, device=self.device),
                torch.full((step.decodes,), step.context, device=self.device),
            )
        )
        return tokens, positions

    def forward(self, step: Step, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        s = self.s
        p, b, c, start = step.prefill, step.decodes, step.context, step.start
        group = s.heads // s.kv_heads
        x = self.embed[tokens]
        for i, layer in enumerate(self.layers):
            h = self._rms(x, layer["attn_norm"])
            qkv = h @ layer["qkv"]
            q = qkv[:, : s.hidden].view(-1, s.heads, s.head_dim)
            k = qkv[:, s.hidden : s.hidden + s.kv_heads * s.head_dim].view(
                -1, s.kv_heads, s.head_dim
            )
            v = qkv[:, s.hidden + s.kv_heads * s.head_dim :].view(-1, s.kv_heads, s.head_dim)
            q, k = self._rope(q, positions), self._rope(k, positions)
            outs = []
            if p:
                # The chunk's keys go after the prompt's cached ones; causal over the chunk
                # (bottom-right: each new token sees every cached one).
                kp, vp = self.k_prompt[i], self.v_prompt[i]
                kp[0, :, start : start + p] = k[:p].transpose(0, 1)
                vp[0, :, start : start + p] = v[:p].transpose(0, 1)
                keys = kp[:, :, : start + p].repeat_interleave(group, dim=1)
                values = vp[:, :, : start + p].repeat_interleave(group, dim=1)
                qp = q[:p].transpose(0, 1).unsqueeze(0)
                if start:
                    mask = torch.ones(p, start + p, dtype=torch.bool, device=self.device).tril(
                        diagonal=start
                    )
                    o = fn.scaled_dot_product_attention(qp, keys, values, attn_mask=mask)
                else:
                    o = fn.scaled_dot_product_attention(qp, keys, values, is_causal=True)
                outs.append(o[0].transpose(0, 1).reshape(p, s.hidden))
            if b:
                kc, vc = self.k_cache[i], self.v_cache[i]
                kc[:b, :, c] = k[p:]
                vc[:b, :, c] = v[p:]
                # Grouped-query decode: each KV head's ``group`` queries as one short query
                # block over that head's cache (no copy of the cache per query head).
                qd = q[p:].view(b, s.kv_heads, group, s.head_dim)
                o = fn.scaled_dot_product_attention(qd, kc[:b, :, : c + 1], vc[:b, :, : c + 1])
                outs.append(o.reshape(b, s.hidden))
            x = x + (torch.cat(outs) if len(outs) > 1 else outs[0]) @ layer["o"]
            h = self._rms(x, layer["mlp_norm"])
            gate, up = (h @ layer["gate_up"]).chunk(2, dim=-1)
            x = x + (fn.silu(gate) * up) @ layer["down"]
        last = torch.cat((x[p - 1 : p], x[p:])) if p else x
        return self._rms(last, self.norm) @ self.lm_head


def _median_s(run: Callable[[], Any], sync: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def time_step(model: Decoder, step: Step, repeats: int, graphs: bool) -> tuple[float, float | None]:
    """(eager seconds, CUDA graph seconds or None) of one step of ``step``'s shape."""
    tokens, positions = model.inputs(step)
    cuda = model.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with torch.no_grad():
        for _ in range(2):
            model.forward(step, tokens, positions)
        eager = _median_s(lambda: model.forward(step, tokens, positions), sync, repeats)
        if not (graphs and cuda):
            return eager, None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                model.forward(step, tokens, positions)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model.forward(step, tokens, positions)
        graph.replay()
        replayed = _median_s(graph.replay, sync, repeats)
        del graph
        torch.cuda.empty_cache()
    return eager, replayed


def check(device: torch.device) -> float:
    """The decoder is one model whatever a step holds: on the tiny shape in float32, a mixed
    step's logits equal those of its prompt chunk and its decodes run apart, and a prompt
    prefilled in two chunks ends with the logits of one whole pass. Returns the largest
    difference; AssertionError when one is off."""
    torch.manual_seed(0)
    model = Decoder(MODELS["tiny"], device, torch.float32, 4, 64, 64)
    worst = 0.0
    with torch.no_grad():
        mixed = Step(prefill=32, decodes=4, context=48)
        tokens, positions = model.inputs(mixed)
        together = model.forward(mixed, tokens, positions)
        alone_p = model.forward(Step(prefill=32), tokens[:32], positions[:32])
        alone_d = model.forward(Step(decodes=4, context=48), tokens[32:], positions[32:])
        apart = torch.cat((alone_p, alone_d))
        whole_step = Step(prefill=64)
        tokens, positions = model.inputs(whole_step)
        whole = model.forward(whole_step, tokens, positions)
        model.forward(Step(prefill=32), tokens[:32], positions[:32])
        second = model.forward(Step(prefill=32, start=32), tokens[32:], positions[32:])
        for a, b in ((together, apart), (whole, second)):
            diff = float((a - b).abs().max())
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), diff
            worst = max(worst, diff)
    return worst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_step_times", description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="llama-3.1-8b", choices=sorted(MODELS))
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--check", action="store_true", help="check the decoder first (float32)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.check:
        print(f"check: steps agree with their parts (largest difference {check(device):.2e})")
    shape = MODELS[args.model]
    grid = TINY_GRID if args.model == "tiny" else FULL_GRID
    dtype = torch.bfloat16
    max_seqs = max(s.decodes for s in grid)
    max_ctx = max(s.context for s in grid)
    max_prompt = max(s.start + s.prefill for s in grid)
    began = time.perf_counter()
    model = Decoder(shape, device, dtype, max_seqs, max_ctx, max_prompt)
    built_s = time.perf_counter() - began
    env = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": args.model,
        "shape": asdict(shape),
        "dtype": "bfloat16",
        "repeats": args.repeats,
        "built_s": round(built_s, 2),
    }
    print(json.dumps(env), flush=True)
    rows: list[dict[str, Any]] = []
    for step in grid:
        try:
            eager, graph = time_step(model, step, args.repeats, not args.no_graphs)
        except RuntimeError as exc:  # out of memory, a kernel refused: say so, go on
            print(f"{step}: {type(exc).__name__}: {exc}"[:300], flush=True)
            rows.append({**asdict(step), "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        rows.append({**asdict(step), "eager_s": eager, "graph_s": graph})
        shown = f"{graph * 1000:9.2f}" if graph is not None else "        -"
        print(
            f"prefill {step.prefill:5d} @ {step.start:5d}  decodes {step.decodes:4d} x "
            f"{step.context:5d}  eager {eager * 1000:9.2f} ms  graph {shown} ms",
            flush=True,
        )
        with open(args.out, "w") as f:  # after every step: a run cut short keeps what it has
            json.dump({"environment": env, "steps": rows}, f, indent=1)
    print(f"{len(rows)} step shapes in {time.perf_counter() - began:.1f} s")
    return _judge_fit({"environment": env, "steps": rows})


def _judge_fit(measured: dict[str, Any]) -> int:
    """Fit the simulator's cost model to the steps here and judge how well its linear form
    explains them (its closing line); ``bench.gpu_steps`` runs the policies on the fit."""
    timed = GRAPH if any(s.get(GRAPH) is not None for s in measured["steps"]) else EAGER
    try:
        model, error = fit(measured, timed)
    except ValueError as exc:
        print(f"{NAME}: fit_rms_relative_error=nan (goal <= {FIT_GOAL}) short ({exc})")
        return 0
    print(
        f"fit to the {timed.removesuffix('_s')} times: a={model.step_overhead_s * 1e3:.2f} ms, "
        f"b={model.per_prefill_token_s * 1e6:.2f} us/prompt token, "
        f"c={model.per_decode_token_s * 1e6:.2f} us/decoding sequence"
    )
    said = "ok" if error <= FIT_GOAL else "short"
    print(f"{NAME}: fit_rms_relative_error={error:.3f} (goal <= {FIT_GOAL}) {said}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
