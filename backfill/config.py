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
    model_config = SettingsConfigDict(
        env_prefix="BACKFILL_", extra="ignore", hide_input_in_errors=True
    )

    database_url: str = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
    # One Redis server (redis://, rediss://, unix://) or a Redis Cluster (redis+cluster://h:p,
    # rediss+cluster://h:p[,h:p...]; backfill.redis_client) for the ledger and the API's keys.
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Celery's broker (maintenance ticks): the Redis server of BACKFILL_REDIS_URL by default.
    # Celery cannot use a Redis Cluster, so with a cluster it must name one server.
    broker_url: str | None = None
    # Key prefix of every ledger key in Redis: lets several deployments (or tests) share one
    # Redis without seeing each other's pools.
    redis_namespace: str = "bf"

    # Logs of every Backfill process (``backfill.logs``): the level of Backfill's loggers and
    # the form, one human line (``text``) or one JSON object a line (``json``).
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["text", "json"] = "text"

    # Leases: a holder must heartbeat well inside the TTL or its reservation is reaped.
    lease_ttl_s: PositiveFloat = 30.0
    heartbeat_interval_s: PositiveFloat = 5.0
    reaper_interval_s: PositiveFloat = 5.0

    # A batch still ``validating`` this long after its create began, with no create at work on
    # it, is recovered by the maintenance tick (its API process died mid-create).
    stale_validating_s: PositiveFloat = 600.0

    # Claims from Postgres.
    claim_batch_size: PositiveInt = 64
    # Tenants share each node's batch sequences by weight, and a batch's deadline is judged
    # against its tenant's share (``backfill.fairshare``). False: earliest deadline first
    # across all tenants, and every tenant's backlog ahead of a new batch (the behaviour
    # before tenants were shared; for comparison).
    fair_share: bool = True

    # Limits at the API edge.
    max_file_bytes: PositiveInt = 200 * 1024 * 1024
    max_line_bytes: PositiveInt = 1024 * 1024
    max_lines_per_batch: PositiveInt = 100_000
    # A summary job started and not ended counts as one active batch; its own batches not.
    max_active_batches_per_tenant: PositiveInt = 100
    # What one tenant may keep stored: batch items (every state, until their batch is purged,
    # see retention_s) and input file bytes (until the file is deleted or expires). Beyond,
    # uploads and creates are refused (429, storage_cap_reached) and a batch whose items
    # would pass the cap fails naming it.
    max_stored_items_per_tenant: PositiveInt = 10_000_000
    max_stored_bytes_per_tenant: PositiveInt = 100 * 1024**3
    # File uploads and batch creates one API process works on at once (each holds a Postgres
    # connection while it checks and stores a file): per tenant, and in all, well under the
    # API's pool (10 + 10 overflow) so reads always find a connection; beyond, a 429.
    max_ingests_per_tenant: PositiveInt = 2
    max_ingests: PositiveInt = 6
    # A batch whose input file is larger than this is checked and stored by an ingest process,
    # not in the create's request: the create answers ``validating`` at once (as OpenAI's
    # does) and the API does no per-line work on it; 0 defers every create. The API process
    # starts ``ingesters`` ingest processes of its own (0: none; run ``backfill ingest``).
    ingest_inline_bytes: Annotated[int, Field(ge=0)] = 1024 * 1024
    ingesters: Annotated[int, Field(ge=0)] = 1
    # A tenant's deferred creates (validating, waiting for an ingest or in one) at once; one
    # more is a 429 with Retry-After, answered before the create's other work: a tenant's
    # flood of large creates neither queues unbounded ingest work nor costs a full create each.
    max_deferred_creates_per_tenant: PositiveInt = 4
    # Retention: a batch that ended this long ago is purged with its items, attempts, webhook
    # events and result files, a summary job with its documents and steps (OpenAI keeps
    # batch data 30 days); 0 keeps everything. Each
    # maintenance tick deletes at most retention_rows_per_tick rows, retention_chunk_rows per
    # transaction.
    retention_s: Annotated[float, Field(ge=0)] = 30 * 86_400.0
    retention_chunk_rows: PositiveInt = 5_000
    retention_rows_per_tick: PositiveInt = 50_000
    # An input file uploaded without expires_after expires this long after its upload, as at
    # OpenAI (files of purpose batch: 30 days); 0 keeps it until it is deleted.
    batch_file_expiry_s: Annotated[int, Field(ge=0)] = 30 * 86_400
    # Request bodies, counted on the bytes actually read (a chunked body declares no length):
    # an upload may carry max_file_bytes (plus its multipart envelope), an interactive
    # request this much, and every other route's JSON this much.
    max_interactive_body_bytes: PositiveInt = 4 * 1024 * 1024
    max_json_body_bytes: PositiveInt = 64 * 1024
    # Files stream through the API in pieces of this many bytes (upload checks, storage,
    # downloads, batch creation): what one file costs the API in memory, whatever its size.
    file_chunk_bytes: Annotated[int, Field(ge=4096)] = 1024 * 1024
    # The batch class's per-sequence limit (prompt + max output), as the admission policy's.
    batch_max_sequence_tokens: PositiveInt = 32_768
    # The longest token of the served vocabularies, in bytes. Prompt characters divided by it
    # are a lower bound on prompt tokens, so the API rejects only what is certainly too long.
    max_bytes_per_token: PositiveInt = 128

    # Completion windows (``completion_window``) a batch may ask for.
    min_completion_window_s: PositiveInt = 5 * 60
    max_completion_window_s: PositiveInt = 7 * 24 * 3600
    # Batch decode throughput of the whole deployment, used for deadline feasibility until
    # workers report a measured rate.
    batch_throughput_tokens_per_s: PositiveFloat = 5_000.0

    # Pools (per node): the interactive reserve as a fraction of the measured pool, headroom
    # above interactive use, and a margin never handed to batch (estimate error).
    interactive_reserve_fraction: Annotated[float, Field(ge=0, le=1)] = 0.25
    headroom_tokens: Annotated[int, Field(ge=0)] = 0
    safety_margin_tokens: Annotated[int, Field(ge=0)] = 0
    interactive_max_sequence_tokens: PositiveInt = 32_768

    # Workers: engine priority of batch requests (lower runs first; interactive uses 0),
    # sequences in flight per node, preemptions an item may suffer before it runs to the end,
    # attempts before an item that keeps failing is failed, and the grace period on stop.
    batch_priority: int = 10
    # Batch output is streamed from the engine in chunks of this many tokens (vLLM's per-request
    # ``stream_interval``; the first token always comes at once): one SSE event per token cost
    # the worker and vLLM's API server more CPU than the tokens themselves on small models.
    # A preempted item keeps the output of its last chunk, so at most this many tokens less.
    batch_stream_interval: PositiveInt = 16
    max_in_flight_per_node: PositiveInt = 128
    max_preemptions_per_item: Annotated[int, Field(ge=0)] = 3
    max_attempts_per_item: PositiveInt = 5
    shutdown_grace_s: Annotated[float, Field(ge=0)] = 30.0
    # A batch stream that sends nothing this long while its engine makes no progress at all
    # (no token prefilled or generated for anyone) is a hung engine: the attempt is stopped
    # as an engine error (requeued, the engine suspect until it answers). 0: never.
    batch_stream_stall_s: Annotated[float, Field(ge=0)] = 120.0
    # Shared prompt prefixes (issue 36). A node that looks for them leaves a new batch's items
    # in the queue until its prefix pass has ended, this long at most (0: never): claimed
    # before, they reserve whole prompts. Seconds, against deadlines of hours: capped at 60.
    prefix_pass_hold_s: Annotated[float, Field(ge=0, le=60)] = 10.0
    # A prefix's group waits this long for its first holder's prefill (its first token), then
    # reserves whole prompts instead.
    prefix_first_prefill_wait_s: Annotated[float, Field(ge=0)] = 30.0
    # Where the node's engine scheduler (backfill_vllm) serves its metrics: while they answer,
    # the engine pauses batch in the steps interactive work needs, and the work budget stops
    # preempting batch for interactive TTFT. None: the engine runs vLLM's own scheduler.
    engine_scheduler_metrics_url: str | None = None
    # The key every engine is started with (vLLM's --api-key): the worker and the gateway send
    # it, and nobody else reaches the engine's /v1 routes, where a request's priority decides
    # what the engine's scheduler pauses. None: the engines take requests from anyone.
    engine_api_key: SecretStr | None = None
    # Prompts one completions line (inputs one embeddings line) may carry: vLLM runs one
    # sequence per prompt or input; each is counted and reserved.
    batch_max_prompts_per_line: PositiveInt = 64
    # The most output tokens a batch line without max_tokens (or max_completion_tokens;
    # max_output_tokens on /v1/responses) may generate: OpenAI does not require the field and
    # then generates what the context leaves, Backfill must reserve a worst case, so such a line
    # gets what the batch limit leaves its prompt, at most this; the engine is sent exactly what
    # is reserved (backfill.output_budget).
    batch_default_max_tokens: PositiveInt = 2048
    # Media content parts (image_url, video_url, audio_url, input_audio) in chat requests,
    # batch and interactive: refused (400 naming the part) unless this is on, for every
    # tenant or only the tenants (ids or names, comma-separated) in media_tenants. Run the
    # engines with --allowed-media-domains and name the same hosts in media_allowed_domains
    # (comma-separated; a media URL must name one of them; none: inline data: URLs only).
    # A request may carry so many media parts, and so many bytes of inline media, at most.
    # Their tokens are counted by the engine's /tokenize of the whole request
    # (backfill.content_parts).
    media_parts: bool = False
    media_tenants: str = ""
    media_allowed_domains: str = ""
    media_max_parts_per_request: PositiveInt = 8
    media_max_inline_bytes_per_request: PositiveInt = 10 << 20
    # A batch naming a model that no live node serves is refused (model_not_found, naming
    # those served) while any node is live; true lets it wait for a node that serves it.
    batch_wait_for_model: bool = False
    # A node counts as live for that check if seen within this many seconds.
    node_live_s: PositiveFloat = 600.0

    # API key -> tenant lookups (found or not) are remembered this long; 0 checks Postgres on
    # every request. A revocation evicts the key from every API process at once through
    # Redis; only an API process cut off from Redis then may accept it this much longer.
    api_key_cache_s: Annotated[float, Field(ge=0)] = 5.0

    # Per-tenant request rate limit (token bucket in Redis): sustained rate and burst.
    rate_limit_per_s: PositiveFloat = 50.0
    rate_limit_burst: PositiveInt = 200
    # An API process takes a busy tenant's tokens from its bucket a few at a time and spends
    # them on its next requests for at most this long (0: one Redis round trip per request).
    rate_limit_credit_hold_s: Annotated[float, Field(ge=0, le=5)] = 0.25
    # Per client address, for what answers without a key (the capacity lab, /metrics,
    # /healthz) and for keys not known to be good (each costs a Postgres lookup).
    anonymous_rate_limit_per_s: PositiveFloat = 5.0
    anonymous_rate_limit_burst: PositiveInt = 30

    # /metrics: the scrape-time reads of Postgres and the ledger are reused this long, so
    # scrapes (or anyone calling /metrics) cost at most one scan per interval.
    metrics_cache_s: Annotated[float, Field(ge=0)] = 5.0

    # Interactive gateway: engine priority of interactive requests, how long a request may wait
    # for room when the caller does not say (header X-Backfill-Max-Wait), and how often the
    # gateway rereads the registered nodes.
    interactive_priority: int = 0
    # Each tenant's requests (interactive, and batch but embeddings) carry a cache_salt of its
    # own: tenants never share the engine's prefix cache, so none can time another's prompts
    # (backfill.cache_salt).
    tenant_cache_salt: bool = True
    gateway_max_wait_s: Annotated[float, Field(ge=0)] = 10.0
    # What one interactive request may ask for: the longest wait for room (a longer
    # X-Backfill-Max-Wait is clamped to it, and the answer says so in
    # X-Backfill-Max-Wait-Applied), its sequences (n x prompts), and the KV tokens it reserves
    # over all of them (sequences x (prompt + max_tokens)). A request over either of the last
    # two is refused (400); one without max_tokens gets what the cap leaves each sequence.
    gateway_max_wait_cap_s: Annotated[float, Field(ge=0)] = 60.0
    gateway_max_sequences: PositiveInt = 16
    gateway_max_request_tokens: PositiveInt = 65_536
    gateway_node_refresh_s: PositiveFloat = 5.0
    # Admit a request on an upper bound of its prompt's tokens (UTF-8 bytes + what the
    # tokenizer or template adds, measured once per shape), skipping the engine's /tokenize,
    # when that fits without preempting; else count exactly. The reservation is settled to
    # the engine's count when it reports one.
    gateway_bound_admission: bool = True
    # What one tenant's interactive requests may hold of a node at once, as a fraction of its
    # measured pool: one tenant's flood leaves the rest to the others (what the flood may not
    # hold stays with batch, which an arriving tenant preempts), and the flooding tenant waits
    # for its own requests to end (429 tenant_interactive_share once its wait is over). A
    # tenant holding nothing on a node is never refused by it. 1: no bound.
    gateway_tenant_share: Annotated[float, Field(gt=0, le=1)] = 0.5

    # Batch work budget per node (``backfill.work_budget``): the interactive TTFT target it
    # protects, its floor and ceiling (batch sequences in flight, batch prompt tokens in
    # prefill), its AIMD steps, and how often the worker steps it and the gateway publishes
    # what it sees. The ceiling of sequences is also capped by max_in_flight_per_node.
    interactive_ttft_target_s: PositiveFloat = 1.0
    work_budget_enabled: bool = True
    work_budget_floor_seqs: PositiveInt = 1
    work_budget_ceiling_seqs: PositiveInt = 128
    work_budget_floor_prefill_tokens: PositiveInt = 512
    work_budget_ceiling_prefill_tokens: PositiveInt = 16_384
    work_budget_decrease_factor: Annotated[float, Field(gt=0, lt=1)] = 0.5
    work_budget_increase_seqs: PositiveInt = 8
    work_budget_increase_prefill_tokens: PositiveInt = 2048
    work_budget_quiet_s: Annotated[float, Field(ge=0)] = 2.0
    work_budget_preempt_at_fraction: Annotated[float, Field(gt=0, le=1)] = 0.5
    work_budget_interval_s: PositiveFloat = 0.25
    # While the engine runs Backfill's step scheduler it pauses batch for interactive work
    # itself, and the budget only bounds what batch has in flight: stepping it (an engine
    # /metrics read and four Redis round trips) every second instead of four times a second
    # leaves that CPU to the engine.
    work_budget_interval_with_scheduler_s: PositiveFloat = 1.0
    work_signal_ttl_s: PositiveFloat = 3.0

    # Webhooks (``backfill.webhooks``): targets on loopback, private, link-local or metadata
    # addresses are refused unless allowed here (a deployment posting to its own network, or
    # tests); how long one delivery may take; the retry schedule (exponential from the base,
    # each delay capped, with jitter, for this long after the event, then failed); how often
    # the sender looks for due deliveries, how many it takes at once, how long a taken one
    # stays its (another sender takes it after that: a sender that died mid-send is
    # redelivered, with the same webhook-id); and the endpoints a tenant may have.
    webhooks_allow_private: bool = False
    webhooks_timeout_s: PositiveFloat = 10.0
    webhooks_retry_base_s: PositiveFloat = 5.0
    webhooks_retry_max_delay_s: PositiveFloat = 3600.0
    webhooks_retry_for_s: PositiveFloat = 24 * 3600.0
    webhooks_poll_s: PositiveFloat = 1.0
    webhooks_claim_batch: PositiveInt = 64
    # Attempts one sender has in flight to one endpoint at most: a slow endpoint holds this
    # many of the webhooks_claim_batch send slots, never all of them.
    webhooks_per_endpoint: PositiveInt = 2
    # An endpoint whose every attempt has failed for this long is disabled (nothing is sent
    # to it until its URL changes or it is enabled again), as Standard Webhooks senders do.
    webhooks_disable_after_s: PositiveFloat = 5 * 86_400.0
    webhooks_lease_s: PositiveFloat = 60.0
    webhooks_max_endpoints: PositiveInt = 16
    # Keys that seal webhook signing secrets at rest (``backfill.webhooks.sealing``): Fernet
    # keys, comma-separated, the first sealing, every one opening (rotate by putting a new one
    # first). Unset: secrets are stored in clear, and the API and the sender say so at start.
    webhooks_secret_keys: SecretStr | None = None

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
