"""Settings, read once from the environment (prefix ``BACKFILL_``).

Defaults point at the local services every developer and CI machine runs. A malformed or
unsafe value refuses to start with a message that names the variable and what is wrong,
rather than failing later in a worker with a stack trace.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from backfill.redis_client import SERVER_SCHEMES, check_url, is_cluster_url
from backfill.webhooks.sealing import parse_keys

_PG_SCHEMES = {
    "postgres": "postgresql+psycopg",
    "postgresql": "postgresql+psycopg",
    "postgresql+psycopg": "postgresql+psycopg",
}


def normalise_database_url(url: str) -> str:
    """Return a SQLAlchemy URL for psycopg 3 from any usual spelling of a Postgres DSN."""
    scheme, sep, rest = url.partition("://")
    if not sep or not rest:
        raise ValueError(f"not a URL (expected postgresql://user@host:port/db): {url!r}")
    target = _PG_SCHEMES.get(scheme.lower())
    if target is None:
        raise ValueError(
            f"unsupported database scheme {scheme!r}: Backfill needs PostgreSQL (postgresql://...)"
        )
    return f"{target}://{rest}"


def libpq_url(url: str) -> str:
    """The same DSN as plain libpq understands it (for psycopg without SQLAlchemy)."""
    _, _, rest = url.partition("://")
    return f"postgresql://{rest}"


PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]


class Settings(BaseSettings):
    """Everything a Backfill process can be told from outside."""

    # A bad value is named in the error, never echoed: some hold passwords and keys.
    # Each field's docstring is its meaning on docs/configuration.md (`python -m
    # devkit.config_doc` writes the page from them).
    model_config = SettingsConfigDict(
        env_prefix="BACKFILL_",
        extra="ignore",
        hide_input_in_errors=True,
        use_attribute_docstrings=True,
    )

    database_url: str = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
    """Postgres (source of truth); `postgres://` and `postgresql://` are read as psycopg 3's"""
    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis (ledger and Celery broker): one server (`redis://`, `rediss://`, `unix://`), or
    `redis+cluster://host:port[,host:port]` (`rediss+cluster://`) for a Redis Cluster
    ([docs/scaling.md](scaling.md))"""
    broker_url: str | None = None
    """Celery's broker, one Redis server: required when `BACKFILL_REDIS_URL` is a cluster
    (Celery cannot use one)"""
    redis_namespace: str = "bf"
    """key prefix: deployments sharing a Redis stay apart"""

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """level of Backfill's loggers (DEBUG, INFO, WARNING, ERROR) in every process"""
    log_format: Literal["text", "json"] = "text"
    """`text`: one human line; `json`: one JSON object a line (`ts`, `level`, `logger`,
    `message`, and the event's `action`, `node`, `job`, `item`, `attempt`, `lease`, `tenant`),
    uvicorn's and Celery's lines included"""

    lease_ttl_s: PositiveFloat = 30.0
    """a silent worker's items are requeued after this TTL + one reaper interval at most"""
    heartbeat_interval_s: PositiveFloat = 5.0
    """each beat renews every lease in the ledger and rewrites a claim in Postgres only once it
    was extended more than half the TTL less 1.5 beats ago (every other beat at the defaults);
    the two beat on clocks of their own, so a slow ledger does not hold up the claims, nor a
    slow Postgres the leases. Under half of `BACKFILL_LEASE_TTL_S`: two missed beats must not
    lose a live lease"""
    reaper_interval_s: PositiveFloat = 5.0
    """how often the maintenance tick runs (reaps silent attempts, expires, finalizes, purges)"""
    stale_validating_s: PositiveFloat = 600.0
    """a batch checked in its create's request and still `validating` this long with no create
    at work on it (its API process died) is moved on by the maintenance tick (a deferred create
    is left to the ingest processes)"""

    claim_batch_size: PositiveInt = 64
    """items a worker claims from Postgres at once"""
    fair_share: bool = True
    """tenants share each node by weight, and deadlines are judged at the tenant's share
    (`false`: earliest deadline first across all tenants, every tenant's backlog ahead of a new
    batch; `backfill.fairshare`)"""

    max_file_bytes: PositiveInt = 200 * 1024 * 1024
    """an input file's limits: its size"""
    max_line_bytes: PositiveInt = 1024 * 1024
    """an input file's limits: one line's size"""
    max_lines_per_batch: PositiveInt = 100_000
    """an input file's limits: its lines"""
    max_active_batches_per_tenant: PositiveInt = 100
    """batches a tenant may have open at once (a summary job started and not ended counts as
    one, its own batches not at all); one more is a 429 (`active_batch_limit_reached`)"""
    max_stored_items_per_tenant: PositiveInt = 10_000_000
    """what one tenant may keep stored: batch items in any state (finished ones count until
    their batch is purged, `BACKFILL_RETENTION_S` after it ends); past it, uploads and creates
    are a 429 (`storage_cap_reached`, not retried) and a batch whose items would pass the cap
    fails naming it"""
    max_stored_bytes_per_tenant: PositiveInt = 100 * 1024**3
    """what one tenant may keep stored: input file bytes (until deleted or expired); past it,
    uploads and creates are a 429 (`storage_cap_reached`, not retried)"""
    max_ingests_per_tenant: PositiveInt = 2
    """file uploads and batch creates one API process works on at once for one tenant (each
    holds a Postgres connection while it checks and stores a file); beyond, a 429 with
    `Retry-After` (`too_many_concurrent_ingests`) before any work"""
    max_ingests: PositiveInt = 6
    """... and in all, well under the API's pool (10 + 10 overflow) so reads always find a
    connection; beyond, a 429 with `Retry-After` (`too_many_concurrent_ingests`)"""
    ingest_inline_bytes: Annotated[int, Field(ge=0)] = 1024 * 1024
    """a batch whose input file is larger is checked and stored by an ingest process, not in
    the create's request: the create answers `validating` at once, as OpenAI's does, and the
    batch moves to `in_progress` (or `failed`, naming each bad line) when its ingest is done;
    `0` defers every create"""
    ingesters: Annotated[int, Field(ge=0)] = 1
    """ingest processes each API process starts (at the lowest CPU priority; `backfill api`
    starts them with it); `0`: none, run `backfill ingest` beside instead (any number: each
    takes one batch at a time, tenants in turn; an ingest that dies is begun again, up to 3
    times)"""
    max_deferred_creates_per_tenant: PositiveInt = 4
    """a tenant's creates answered `validating` and not yet checked and stored (waiting for an
    ingest process, or in one) at once; one more is a 429 `too_many_concurrent_ingests` with
    `Retry-After`, answered before the create's other work"""
    tenant_requests_in_progress: Annotated[int, Field(ge=0)] = 4
    """`/v1/` requests of one tenant an API process works on at once (uploads and interactive
    requests aside); more wait their turn, then a 429 `too_many_requests_in_progress` with
    `Retry-After`; `0`: no bound"""
    retention_s: Annotated[float, Field(ge=0)] = 30 * 86_400.0
    """a batch that ended this long ago is purged by the maintenance tick with its items,
    attempts, webhook events and deliveries, and result files, and a summary job with its
    documents and steps (`0` keeps everything; OpenAI keeps batch data 30 days)"""
    retention_chunk_rows: PositiveInt = 5_000
    """rows one purge transaction deletes at most"""
    retention_rows_per_tick: PositiveInt = 50_000
    """rows one maintenance tick purges at most"""
    batch_file_expiry_s: Annotated[int, Field(ge=0)] = 30 * 86_400
    """when an input file uploaded without `expires_after` expires, as at OpenAI (`0`: kept
    until deleted)"""
    max_interactive_body_bytes: PositiveInt = 4 * 1024 * 1024
    """request bodies of the gateway (bytes read, chunked or not)"""
    max_json_body_bytes: PositiveInt = 64 * 1024
    """request bodies of every other JSON route (bytes read, chunked or not; an upload may
    carry `BACKFILL_MAX_FILE_BYTES` and its multipart envelope)"""
    file_chunk_bytes: Annotated[int, Field(ge=4096)] = 1024 * 1024
    """files stream through the API (and are stored) in pieces of this size: what one file
    costs the API in memory, whatever its size"""
    batch_max_sequence_tokens: PositiveInt = 32_768
    """prompt + max_tokens limit of a batch item"""
    max_bytes_per_token: PositiveInt = 128
    """the longest token of the served vocabularies, in bytes: a prompt's bytes over it are a
    lower bound of its tokens, so the API refuses only what is certainly too long"""

    min_completion_window_s: PositiveInt = 5 * 60
    """the shortest completion window a batch may ask for"""
    max_completion_window_s: PositiveInt = 7 * 24 * 3600
    """the longest completion window a batch may ask for"""
    batch_throughput_tokens_per_s: PositiveFloat = 5_000.0
    """the deployment's batch decode throughput, for deadline feasibility until workers report
    a measured rate"""

    interactive_reserve_fraction: Annotated[float, Field(ge=0, le=1)] = 0.25
    """share of each node's measured pool batch never takes"""
    headroom_tokens: Annotated[int, Field(ge=0)] = 0
    """extra room kept from batch above interactive use"""
    safety_margin_tokens: Annotated[int, Field(ge=0)] = 0
    """extra room never handed to batch (estimate error)"""
    interactive_max_sequence_tokens: PositiveInt = 32_768
    """prompt + max_tokens limit of an interactive request (and the model's context)"""

    batch_priority: int = 10
    """vLLM priority of batch requests (interactive: 0); must equal the engine scheduler's
    `BACKFILL_SCHED_BATCH_PRIORITY`, or the worker keeps preempting for interactive TTFT itself
    and says so"""
    batch_stream_interval: PositiveInt = 16
    """batch output streams from the engine in chunks of this many tokens (first token at
    once): less CPU per item for the worker and vLLM's API server; a preempted item keeps its
    output up to its last chunk (one SSE event a token cost more CPU than the tokens
    themselves on small models)"""
    max_in_flight_per_node: PositiveInt = 128
    """items a worker keeps in flight on its engine at most"""
    max_preemptions_per_item: Annotated[int, Field(ge=0)] = 3
    """preemptions an item may suffer; then the item runs to the end, not preemptible"""
    max_attempts_per_item: PositiveInt = 5
    """an item fails after this many engine errors, or this many times its worker process died
    while running it ("worker lost N times")"""
    shutdown_grace_s: Annotated[float, Field(ge=0)] = 30.0
    """SIGTERM: in-flight items may finish this long, then are requeued"""
    batch_stream_stall_s: Annotated[float, Field(ge=0)] = 120.0
    """a batch stream that sends nothing this long while its engine makes no progress at all is
    a hung engine: the attempt is stopped as an engine error (requeued, its lease released) and
    the worker sends one item at a time until the engine makes progress again; waiting behind
    interactive work is not a stall (`0`: never)"""
    prefix_pass_hold_s: Annotated[float, Field(ge=0, le=60)] = 10.0
    """on a node that looks for shared prompt prefixes (its engine caches them), a new batch's
    items stay in the queue until the batch's prefix pass has ended, this many seconds at most
    after it went in progress: claimed before, they would reserve whole prompts; a batch no
    node looks at, or whose pass failed, is claimed after it (at most `60`, against deadlines
    of hours; `0`: never wait)"""
    prefix_first_prefill_wait_s: Annotated[float, Field(ge=0)] = 30.0
    """the items of a shared prefix wait in the queue (untouched) while its first holder on the
    node prefills, this long at most; then they reserve whole prompts"""
    engine_scheduler_metrics_url: str | None = None
    """where the node's engine scheduler (`backfill_vllm`) serves its metrics: while they
    answer, the engine pauses batch in the steps interactive work needs, and the work budget
    stops preempting batch for interactive TTFT (unset: the engine runs vLLM's own scheduler)"""
    engine_api_key: SecretStr | None = None
    """the engines' key (vLLM's `--api-key`): the worker and the gateway send it, nobody else
    reaches an engine's `/v1` routes (unset: the engines take requests from anyone)"""
    batch_max_prompts_per_line: PositiveInt = 64
    """prompts one completions batch line (inputs one embeddings line) may carry (each is a
    sequence, counted and reserved)"""
    batch_default_max_tokens: PositiveInt = 2048
    """the most a batch line that sets no max_tokens (`max_output_tokens` on `/v1/responses`)
    may generate: it gets what the batch limit (the model's context at most) leaves its prompt,
    at most this (reserved, and sent to the engine); never a refusal for a prompt that fits.
    OpenAI does not require the field, Backfill must reserve a worst case
    (`backfill.output_budget`)"""
    media_parts: bool = False
    """accept media content parts (`image_url`, `video_url`, `audio_url`, `input_audio`) in
    batch and interactive chat. Off, a media part is a 400 naming it (the engine would fetch its
    URL itself). Their tokens are counted by the engine's `/tokenize` of the whole request,
    before any reservation: it needs a vLLM whose `/tokenize` runs the multimodal processor"""
    media_tenants: str = ""
    """with media on, only the tenants named (ids or names, comma-separated) may send it; empty:
    every tenant"""
    media_allowed_domains: str = ""
    """a media URL must be http(s) to one of the hosts named (comma-separated, exact, as vLLM's
    `--allowed-media-domains`: start every engine with the same list), none named: inline
    `data:` media only"""
    media_max_parts_per_request: PositiveInt = 8
    """with media on, the media parts one request (one batch line) may carry"""
    media_max_inline_bytes_per_request: PositiveInt = 10 << 20
    """with media on, the bytes of inline media (`data:` URLs, `input_audio`) one request may
    carry, all of them together"""
    batch_wait_for_model: bool = False
    """let a batch for a model no live node serves wait (else 404 `model_not_found` while any
    node is live)"""
    node_live_s: PositiveFloat = 600.0
    """how recently a node must have been seen to count as live"""

    api_key_cache_s: Annotated[float, Field(ge=0)] = 5.0
    """keys (good or wrong) remembered this long; revocation evicts at once through Redis, so
    this only bounds an API process cut off from Redis"""

    rate_limit_per_s: PositiveFloat = 50.0
    """requests per tenant: the sustained rate (a token bucket in Redis)"""
    rate_limit_burst: PositiveInt = 200
    """requests per tenant: the burst"""
    rate_limit_credit_hold_s: Annotated[float, Field(ge=0, le=5)] = 0.25
    """an API process takes a busy tenant's tokens from its bucket a few at a time (at most a
    tenth of the burst) and spends them on its next requests for at most this long, handing
    back what is left; `0`: one Redis round trip per request"""
    anonymous_rate_limit_per_s: PositiveFloat = 5.0
    """per client address: the lab, `/metrics`, `/healthz`, and lookups of keys not yet known
    (each costs a Postgres lookup): the sustained rate"""
    anonymous_rate_limit_burst: PositiveInt = 30
    """per client address, as above: the burst"""

    metrics_cache_s: Annotated[float, Field(ge=0)] = 5.0
    """`/metrics` reads Postgres and the ledger at most once per interval"""

    interactive_priority: int = 0
    """the engine priority interactive requests are sent at (batch goes at
    `BACKFILL_BATCH_PRIORITY`)"""
    tenant_cache_salt: bool = True
    """every interactive request and every batch item's request (not embeddings) carries its
    tenant's `cache_salt`, whatever the caller or the line sent: a tenant's requests share their
    prompt prefixes in the engine's cache, two tenants' never do, so no tenant can time
    another's prompts (`backfill.cache_salt`)"""
    gateway_max_wait_s: Annotated[float, Field(ge=0)] = 10.0
    """how long an interactive request waits for room unless it sends `X-Backfill-Max-Wait`"""
    gateway_max_wait_cap_s: Annotated[float, Field(ge=0)] = 60.0
    """the longest wait for room a request may ask for; a longer `X-Backfill-Max-Wait` is
    clamped (`X-Backfill-Max-Wait-Applied` says so)"""
    gateway_max_sequences: PositiveInt = 16
    """sequences (`n` x prompts) one interactive request may run; more is a 400"""
    gateway_max_request_tokens: PositiveInt = 65_536
    """KV tokens one interactive request may reserve over all its sequences (`n` x (prompt +
    `max_tokens`)); more is a 400"""
    gateway_node_refresh_s: PositiveFloat = 5.0
    """how often the gateway rereads the registered nodes"""
    gateway_bound_admission: bool = True
    """admit interactive requests on an upper bound of their prompt's tokens (UTF-8 bytes +
    what the tokenizer or template adds, measured once per shape) when they fit without
    preempting, settled to the engine's count when it reports one (`false`: always count on
    the engine first)"""
    gateway_tenant_share: Annotated[float, Field(gt=0, le=1)] = 0.5
    """the fraction of a node's measured pool that one tenant's interactive requests may hold at
    once: past it the tenant waits for its own requests to end (429 `tenant_interactive_share`,
    with `Retry-After`, once its `X-Backfill-Max-Wait` is over), while other tenants are
    admitted on the node; what it may not hold goes to batch, which another tenant's request
    preempts. A tenant holding nothing on a node is never refused by it. `1`: no bound (a
    single-tenant deployment loses nothing by it)"""

    interactive_ttft_target_s: PositiveFloat = 1.0
    """interactive time to first token the batch work budget protects; set it from what
    interactive alone gets on the engine (here, on CPU, ~3 s p50: use 4-8 s)"""
    work_budget_enabled: bool = True
    """per-node batch work budget (sequences in flight, prompt tokens in prefill) beside the KV
    reservation"""
    work_budget_floor_seqs: PositiveInt = 1
    """its bounds: the fewest batch sequences in flight"""
    work_budget_ceiling_seqs: PositiveInt = 128
    """its bounds: the most batch sequences in flight (also capped by
    `BACKFILL_MAX_IN_FLIGHT_PER_NODE`)"""
    work_budget_floor_prefill_tokens: PositiveInt = 512
    """its bounds: the fewest batch prompt tokens in prefill"""
    work_budget_ceiling_prefill_tokens: PositiveInt = 16_384
    """its bounds: the most batch prompt tokens in prefill"""
    work_budget_decrease_factor: Annotated[float, Field(gt=0, lt=1)] = 0.5
    """its steps: multiplied by the factor on a sign of batch hurting interactive"""
    work_budget_increase_seqs: PositiveInt = 8
    """its steps: sequences grown by once quiet"""
    work_budget_increase_prefill_tokens: PositiveInt = 2048
    """its steps: prefill tokens grown by once quiet"""
    work_budget_quiet_s: Annotated[float, Field(ge=0)] = 2.0
    """growth resumes this long after the last sign of batch hurting interactive"""
    work_budget_preempt_at_fraction: Annotated[float, Field(gt=0, le=1)] = 0.5
    """running batch prefills are preempted once a pending interactive request has used this
    fraction of its target"""
    work_budget_interval_s: PositiveFloat = 0.25
    """how often the budget steps (an engine `/metrics` read, shared with the KV observer and
    the stall watch, and four Redis round trips)"""
    work_budget_interval_with_scheduler_s: PositiveFloat = 1.0
    """how often the budget steps while the engine runs Backfill's step scheduler, which pauses
    batch itself (the budget then only bounds what batch has in flight)"""
    work_signal_ttl_s: PositiveFloat = 3.0
    """how long the interactive signals a gateway publishes live in Redis (a gateway gone silent
    stops counting)"""

    webhooks_allow_private: bool = False
    """allow webhook targets on loopback, private and link-local addresses"""
    webhooks_timeout_s: PositiveFloat = 10.0
    """one delivery attempt's limit, in all: connect, send and the answer's headers together (a
    receiver that drips its answer is cut off there)"""
    webhooks_retry_base_s: PositiveFloat = 5.0
    """the first retry's wait (doubling, jittered)"""
    webhooks_retry_max_delay_s: PositiveFloat = 3600.0
    """the longest wait between retries"""
    webhooks_retry_for_s: PositiveFloat = 24 * 3600.0
    """how long after the event a delivery is retried before it is failed"""
    webhooks_poll_s: PositiveFloat = 1.0
    """how often an idle sender looks for due deliveries (retries that came due; a batch's end
    wakes it at once through `NOTIFY backfill_webhooks`)"""
    webhooks_claim_batch: PositiveInt = 64
    """how many deliveries a sender sends at once (it claims again as each send ends, endpoints
    taking turns at the free slots)"""
    webhooks_per_endpoint: PositiveInt = 2
    """attempts one sender has in flight to one endpoint at most: a slow or dripping endpoint
    holds this many send slots, never all of them; endpoints whose attempts are failing come
    after healthy ones and hold at most half the slots"""
    webhooks_disable_after_s: PositiveFloat = 5 * 86_400.0
    """an endpoint whose every attempt has failed for this long is disabled (`status:
    "disabled"` and `disabled_reason` on the endpoint object; nothing is sent to it) until its
    tenant enables it again (`client.webhooks.update(id, extra_body={"status": "enabled"})`, or
    a new `url`)"""
    webhooks_lease_s: PositiveFloat = 60.0
    """how long a claimed delivery is its sender's (more than twice the timeout): then another
    sender takes it, so one that died mid-send is redelivered, with the same webhook-id"""
    webhooks_max_endpoints: PositiveInt = 16
    """webhook endpoints per tenant"""
    webhooks_secret_keys: SecretStr | None = None
    """keys that seal webhook signing secrets at rest (Fernet; `backfill webhooks new-key`),
    comma-separated: the first seals, every one opens; rotate by putting a new one first (the
    sender reseals every endpoint, then the old key can go). Unset: secrets are stored in clear,
    with a warning at start; compose and the Kubernetes overlays require it"""

    @field_validator("database_url")
    @classmethod
    def _database_url(cls, value: str) -> str:
        return normalise_database_url(value)

    @field_validator("log_level", mode="before")
    @classmethod
    def _log_level(cls, value: object) -> object:
        return value.strip().upper() if isinstance(value, str) else value

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str) -> str:
        try:
            return check_url(value)
        except ValueError as exc:
            raise ValueError(f"BACKFILL_REDIS_URL {exc}") from None

    @field_validator("broker_url")
    @classmethod
    def _broker_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if is_cluster_url(value) or value.partition("://")[0].lower() not in SERVER_SCHEMES:
            raise ValueError(
                f"BACKFILL_BROKER_URL must name one Redis server (redis://, rediss://, "
                f"unix://): Celery cannot use a Redis Cluster: {value!r}"
            )
        return value

    @property
    def celery_broker_url(self) -> str:
        """Where Celery's messages go: BACKFILL_BROKER_URL, else BACKFILL_REDIS_URL."""
        return self.broker_url or self.redis_url

    @property
    def webhooks_seal_keys(self) -> tuple[str, ...]:
        """The keys that seal webhook signing secrets, the sealing one first (none: clear)."""
        keys = self.webhooks_secret_keys
        return parse_keys(keys.get_secret_value()) if keys is not None else ()

    @field_validator("webhooks_secret_keys")
    @classmethod
    def _webhooks_secret_keys(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            parse_keys(value.get_secret_value())
        return value

    @field_validator("redis_namespace")
    @classmethod
    def _namespace(cls, value: str) -> str:
        if not value or not all(c.isalnum() or c in "-_." for c in value):
            raise ValueError("BACKFILL_REDIS_NAMESPACE must be non-empty letters, digits, - _ .")
        return value

    @model_validator(mode="after")
    def _broker_beside_cluster(self) -> Settings:
        if is_cluster_url(self.redis_url) and self.broker_url is None:
            raise ValueError(
                "BACKFILL_REDIS_URL names a Redis Cluster, which Celery cannot use as its "
                "broker: set BACKFILL_BROKER_URL to one Redis server (redis://host:port/0)"
            )
        return self

    @model_validator(mode="after")
    def _lease_timing(self) -> Settings:
        # Two missed heartbeats must not lose a live lease; otherwise healthy workers would see
        # their reservations reaped under ordinary scheduling jitter.
        if self.heartbeat_interval_s * 2 >= self.lease_ttl_s:
            raise ValueError(
                "BACKFILL_HEARTBEAT_INTERVAL_S must be less than half of BACKFILL_LEASE_TTL_S "
                f"(got {self.heartbeat_interval_s} and {self.lease_ttl_s})"
            )
        return self

    @model_validator(mode="after")
    def _gateway_wait(self) -> Settings:
        if self.gateway_max_wait_s > self.gateway_max_wait_cap_s:
            raise ValueError(
                "BACKFILL_GATEWAY_MAX_WAIT_S must not exceed BACKFILL_GATEWAY_MAX_WAIT_CAP_S "
                f"(got {self.gateway_max_wait_s} and {self.gateway_max_wait_cap_s})"
            )
        return self

    @model_validator(mode="after")
    def _webhook_lease(self) -> Settings:
        # A sender must finish a send (connect, TLS, answer) well inside its lease, or a
        # second sender takes the delivery while the first is still at it.
        if self.webhooks_timeout_s * 2 >= self.webhooks_lease_s:
            raise ValueError(
                "BACKFILL_WEBHOOKS_TIMEOUT_S must be less than half of BACKFILL_WEBHOOKS_LEASE_S "
                f"(got {self.webhooks_timeout_s} and {self.webhooks_lease_s})"
            )
        return self

    @model_validator(mode="after")
    def _work_budget_bounds(self) -> Settings:
        if self.work_budget_floor_seqs > self.work_budget_ceiling_seqs:
            raise ValueError(
                "BACKFILL_WORK_BUDGET_FLOOR_SEQS must not exceed BACKFILL_WORK_BUDGET_CEILING_SEQS"
            )
        if self.work_budget_floor_prefill_tokens > self.work_budget_ceiling_prefill_tokens:
            raise ValueError(
                "BACKFILL_WORK_BUDGET_FLOOR_PREFILL_TOKENS must not exceed "
                "BACKFILL_WORK_BUDGET_CEILING_PREFILL_TOKENS"
            )
        return self


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings (read once)."""
    return Settings()
