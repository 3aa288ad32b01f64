"""Prometheus metrics of the interactive gateway, exported on the API's ``/metrics``.

They live in prometheus_client's default registry: one set per process, whatever number of
apps a process creates (tests create many).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
    1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
    0.75, 1.0, 2.5, 5.0,
)  # fmt: skip
_HOP_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075,
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
)  # fmt: skip
_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)

TIME_TO_FIRST_TOKEN = Histogram(
    "backfill_gateway_time_to_first_token_seconds",
    "Interactive streams: from the gateway receiving the request to its first generated token.",
    ["endpoint"],
    buckets=_LATENCY_BUCKETS,
)
INTER_TOKEN_LATENCY = Histogram(
    "backfill_gateway_inter_token_latency_seconds",
    "Interactive streams: time between consecutive chunks that carry generated tokens.",
    ["endpoint"],
    buckets=_ITL_BUCKETS,
)
ADMISSION_WAIT = Histogram(
    "backfill_gateway_admission_wait_seconds",
    "Time an admitted interactive request waited for room in the ledger (queue wait).",
    buckets=_LATENCY_BUCKETS,
)
GATEWAY_OVERHEAD = Histogram(
    "backfill_gateway_overhead_seconds",
    "From receiving a request to sending it to the engine, excluding the wait for room "
    "(parsing, authentication, tokenizing, reserving).",
    ["endpoint"],
    buckets=_LATENCY_BUCKETS,
)
HOPS = Histogram(
    "backfill_gateway_hop_seconds",
    "Where an interactive request's time goes inside the API process, hop by hop (stamps "
    "inside the process): edge (accepted -> handler: key, rate limit, routing), parse "
    "(-> the prompt's size known: parse, and the engine's count when not admitted on a "
    "bound), reserve (-> lease held, less any wait for room), engine_headers (-> the engine's "
    "response headers: connection, request, the engine's accept), engine_first_chunk (-> the "
    "first event from the engine), first_chunk_out (that event -> handed to the client), "
    "chunk_out (each streamed event: received -> handed to the client), engine_answer (a "
    "whole answer: request sent -> answer read).",
    ["hop"],
    buckets=_HOP_BUCKETS,
)
# Bound once: the relay observes a hop for every streamed chunk, and a labels() lookup each
# time would cost the stream more than the observation.
HOP_EDGE, HOP_PARSE, HOP_RESERVE = (HOPS.labels(h) for h in ("edge", "parse", "reserve"))
HOP_ENGINE_HEADERS = HOPS.labels("engine_headers")
HOP_ENGINE_FIRST_CHUNK = HOPS.labels("engine_first_chunk")
HOP_FIRST_CHUNK_OUT = HOPS.labels("first_chunk_out")
HOP_CHUNK_OUT = HOPS.labels("chunk_out")
HOP_ENGINE_ANSWER = HOPS.labels("engine_answer")
REQUEST_DURATION = Histogram(
    "backfill_gateway_request_duration_seconds",
    "Admitted interactive requests: from receipt to the end of the response.",
    ["endpoint", "stream"],
    buckets=_LATENCY_BUCKETS,
)
REJECTIONS = Counter(
    "backfill_gateway_rejections_total",
    "Interactive requests refused, by reason (context_length_bound is before tokenizing, "
    "context_length_exact after).",
    ["reason"],
)
REQUESTS = Counter(
    "backfill_gateway_requests_total",
    "Admitted interactive requests by how they ended.",
    ["endpoint", "outcome"],
)
RESERVED_TOKENS = Histogram(
    "backfill_gateway_reserved_tokens",
    "KV tokens reserved per admitted interactive request (prompt + max output of each "
    "sequence, block-rounded).",
    buckets=_TOKEN_BUCKETS,
)
USED_TOKENS = Histogram(
    "backfill_gateway_used_tokens",
    "KV tokens an admitted interactive request actually used (prompt + generated of each "
    "sequence); compare with backfill_gateway_reserved_tokens.",
    buckets=_TOKEN_BUCKETS,
)
BATCH_PREEMPTIONS = Counter(
    "backfill_gateway_batch_preemptions_total",
    "Batch leases the ledger preempted to admit interactive requests.",
)
IN_FLIGHT = Gauge(
    "backfill_gateway_in_flight",
    "Interactive requests holding a reservation now.",
)
ADMISSIONS = Counter(
    "backfill_gateway_admissions_total",
    "Admitted interactive requests by what their reservation was sized on: 'bound' (an upper "
    "bound of the prompt's tokens, no tokenizing; room without preempting) or 'exact' (the "
    "engine's count).",
    ["basis"],
)
BOUND_VIOLATIONS = Counter(
    "backfill_gateway_bound_violations_total",
    "Requests admitted on a prompt bound whose prompt the engine counted above it (should stay "
    "0: the bound's assumptions failed for this tokenizer; set BACKFILL_GATEWAY_BOUND_ADMISSION"
    "=false).",
)
