"""What the step scheduler did, as Prometheus text on a small HTTP server in the engine core.

vLLM's own ``/metrics`` lives in the API server process; the scheduler runs in the engine-core
process, so it serves its counters itself (``BACKFILL_SCHED_METRICS_PORT``, bound to
127.0.0.1 unless ``BACKFILL_SCHED_METRICS_HOST`` says otherwise). Backfill's worker reads them
(``backfill.engine_scheduler.parse_scheduler_metrics``): the names here are that contract.
Counters are written by the engine's step loop and read by the server thread under one lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from backfill_vllm.stepmodel import StepFit

logger = logging.getLogger("vllm.backfill_vllm")  # vLLM's logging configuration applies

TTFT_PARTS = ("step_in_flight", "queueing", "prefill")
"""The parts of an interactive request's first-token time (:mod:`backfill_vllm.ttftsplit`):
``backfill_sched_interactive_PART_seconds``, one histogram each."""
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class TtftSplitHistograms:
    """Histograms of the three parts, seconds (bucket counts not cumulative here)."""

    buckets: list[list[int]] = field(
        default_factory=lambda: [[0] * len(TTFT_BUCKETS) for _ in TTFT_PARTS]
    )
    sums: list[float] = field(default_factory=lambda: [0.0] * len(TTFT_PARTS))
    count: int = 0

    def observe(self, *parts: float) -> None:
        """One request's parts, in ``TTFT_PARTS`` order."""
        self.count += 1
        for i, value in enumerate(parts):
            self.sums[i] += value
            for b, bound in enumerate(TTFT_BUCKETS):
                if value <= bound:
                    self.buckets[i][b] += 1
                    break

    def render(self, out: list[str]) -> None:
        for i, part in enumerate(TTFT_PARTS):
            name = f"backfill_sched_interactive_{part}_seconds"
            out.append(
                f"# HELP {name} Interactive requests' first-token time in the engine: "
                f"{part.replace('_', ' ')}, seconds."
            )
            out.append(f"# TYPE {name} histogram")
            running = 0
            for bound, n in zip(TTFT_BUCKETS, self.buckets[i], strict=True):
                running += n
                out.append(f'{name}_bucket{{le="{bound}"}} {float(running)!r}')
            out.append(f'{name}_bucket{{le="+Inf"}} {float(self.count)!r}')
            out.append(f"{name}_sum {self.sums[i]!r}")
            out.append(f"{name}_count {float(self.count)!r}")


@dataclass
class SchedulerMetrics:
    """Counters since the engine started; gauges as of the last step."""

    version: str
    vllm_version: str
    batch_priority: int
    steps: int = 0
    paused_steps: int = 0
    """Steps in which at least one resident batch sequence was paused."""
    tokens_held: int = 0
    """Tokens the paused batch sequences would have carried in those steps."""
    pauses: int = 0
    """Pauses begun (a batch sequence going from carrying tokens to paused)."""
    relief: int = 0
    """Paused batch sequences given tokens at the starvation bound."""
    ride_along: int = 0
    """Batch decode tokens that rode along in holding steps (the ride-along share)."""
    preemptions_kv: int = 0
    """Batch sequences preempted for interactive work's KV blocks (ours and vLLM's own)."""
    preemptions_seqs: int = 0
    """Batch sequences preempted so a waiting interactive request gets a sequence slot."""
    batch_requests: int = 0
    lifted_steps: int = 0
    """Steps with the chunk cap lifted (no interactive request in the engine for a while)."""
    tokens_capped: int = 0
    """Batch prefill tokens the chunk cap kept out of a step vLLM would have given them."""
    bounded_steps: int = 0
    """Steps the whole-step bound trimmed batch in (interactive work present or likely)."""
    held_back_steps: int = 0
    """Empty steps handed to vLLM in place of a batch-only step scheduled ahead (async
    scheduling, interactive work likely): its loop waits for the step in flight first."""
    step_outliers: int = 0
    """Steps the step-time model kept out of its fit as outliers."""
    paused_now: int = 0
    running_now: int = 0
    """Batch requests in vLLM's running set after the last step (resident: they hold KV)."""
    decoding_now: int = 0
    """Of those, the ones past their prompt (decoding)."""
    longest_pause_s: float = 0.0
    longest_pause_steps: int = 0
    most_pauses_per_request: int = 0
    chunk_cap: int = 0
    fit: StepFit | None = None
    ttft_split: TtftSplitHistograms = field(default_factory=TtftSplitHistograms)
    """Interactive requests' first-token time in the engine, in its parts."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def lock(self) -> threading.Lock:
        return self._lock

    def render(self) -> str:
        with self._lock:
            return self._render()

    def _counters(self) -> tuple[tuple[str, str, float], ...]:
        """The counters' names (``backfill_sched_NAME_total``), help and values."""
        return (
            ("steps", "Steps scheduled.", self.steps),
            (
                "batch_paused_steps",
                "Steps in which resident batch sequences were paused.",
                self.paused_steps,
            ),
            (
                "batch_tokens_held",
                "Tokens paused batch sequences would have carried.",
                self.tokens_held,
            ),
            ("batch_pauses", "Pauses begun by batch sequences.", self.pauses),
            (
                "batch_relief",
                "Paused batch sequences given tokens at the starvation bound.",
                self.relief,
            ),
            ("batch_ride_along", "Batch decode tokens carried in holding steps.", self.ride_along),
            ("batch_requests", "Batch requests seen.", self.batch_requests),
            ("lifted_steps", "Steps with the batch prefill cap lifted.", self.lifted_steps),
            (
                "batch_tokens_capped",
                "Batch prefill tokens the chunk cap kept out of a step.",
                self.tokens_capped,
            ),
            (
                "bounded_steps",
                "Steps the whole-step bound trimmed batch in.",
                self.bounded_steps,
            ),
            (
                "held_back_steps",
                "Batch-only steps not scheduled ahead of the one in flight.",
                self.held_back_steps,
            ),
            (
                "step_outliers",
                "Steps the step-time model kept out of its fit as outliers.",
                self.step_outliers,
            ),
        )

    def _gauges(self) -> tuple[tuple[str, str, float], ...]:
        """The gauges' names (``backfill_sched_NAME``), help and values."""
        fit = self.fit
        return (
            ("batch_paused", "Batch sequences paused now.", self.paused_now),
            ("batch_running", "Batch requests resident in the engine now.", self.running_now),
            (
                "batch_decoding",
                "Batch requests resident and past their prompt now.",
                self.decoding_now,
            ),
            (
                "batch_longest_pause_seconds",
                "Longest pause of a batch sequence, seconds.",
                self.longest_pause_s,
            ),
            (
                "batch_longest_pause_steps",
                "Longest pause of a batch sequence, steps.",
                self.longest_pause_steps,
            ),
            (
                "batch_most_pauses_per_request",
                "Most pauses one batch request has had.",
                self.most_pauses_per_request,
            ),
            ("chunk_cap_tokens", "Batch prefill tokens a step may carry now.", self.chunk_cap),
            (
                "step_model_base_seconds",
                "Fitted step time with no tokens.",
                fit.base_s if fit else 0.0,
            ),
            (
                "step_model_per_token_seconds",
                "Fitted step time each prompt token adds.",
                fit.per_token_s if fit else 0.0,
            ),
            (
                "step_model_per_decode_seconds",
                "Fitted step time each decoding sequence adds.",
                fit.decode_s if fit else 0.0,
            ),
            ("step_model_samples", "Steps the fit is made from.", fit.samples if fit else 0),
        )

    def _render(self) -> str:
        out: list[str] = []

        def family(name: str, kind: str, text: str, *samples: tuple[str, float]) -> None:
            out.append(f"# HELP {name} {text}")
            out.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                out.append(f"{name}{labels} {float(value)!r}")

        family(
            "backfill_sched_info",
            "gauge",
            "The step scheduler's version and settings (1).",
            (
                f'{{batch_priority="{self.batch_priority}",version="{self.version}",'
                f'vllm_version="{self.vllm_version}"}}',
                1,
            ),
        )
        for name, text, value in self._counters():
            family(f"backfill_sched_{name}_total", "counter", text, ("", value))
        family(
            "backfill_sched_batch_preemptions_total",
            "counter",
            "Batch sequences preempted for interactive work, by what ran short.",
            ('{reason="kv"}', self.preemptions_kv),
            ('{reason="seqs"}', self.preemptions_seqs),
        )
        for name, text, gauge in self._gauges():
            family(f"backfill_sched_{name}", "gauge", text, ("", gauge))
        self.ttft_split.render(out)
        return "\n".join(out) + "\n"


def serve_metrics(render: Callable[[], str], host: str, port: int) -> ThreadingHTTPServer | None:
    """Serve what ``render`` says at ``http://host:port/metrics`` from a daemon thread; None
    (logged, the engine runs on) when the port cannot be bound."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] not in ("/metrics", "/"):
                self.send_error(404)
                return
            body = render().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            return  # a scrape every few seconds is not news

    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except OSError as exc:
        logger.warning("backfill_vllm: cannot serve metrics on %s:%d: %s", host, port, exc)
        return None
    server.daemon_threads = True
    thread = threading.Thread(
        target=server.serve_forever, name="backfill-sched-metrics", daemon=True
    )
    thread.start()
    return server


_served: dict[tuple[str, int], list[SchedulerMetrics]] = {}
"""One metrics server per (host, port) in a process, serving the metrics it holds."""


def serve_shared(metrics: SchedulerMetrics, host: str, port: int) -> str:
    """Serve ``metrics`` at ``http://host:port/metrics``; where the server is, or ``not
    served`` (logged) when the port cannot be bound. One server per (host, port) in a
    process: a scheduler built later (tests, an engine restarted in-process) takes it over."""
    key = (host, port)
    holder = _served.get(key)
    if holder is not None:
        holder[0] = metrics
    else:
        holder = [metrics]
        if serve_metrics(lambda: holder[0].render(), host, port) is None:  # noqa: PLW0108
            return "not served"
        _served[key] = holder
    return f"http://{host}:{port}/metrics"
