"""Nodes: the engines workers run beside, as each worker last registered its pool."""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import text

from backfill.store.database import Database
from backfill.store.records import NodeRecord

# Register a node or refresh its engine, pool size and reserve (a worker's start).
UPSERT_NODE = (
    "INSERT INTO nodes (name, engine_url, model, num_blocks, block_size, "
    "interactive_reserve_tokens, endpoints) VALUES (:n, :u, :m, :b, :s, :r, :e) "
    "ON CONFLICT (name) DO UPDATE SET engine_url = EXCLUDED.engine_url, "
    "model = EXCLUDED.model, num_blocks = EXCLUDED.num_blocks, "
    "endpoints = EXCLUDED.endpoints, "
    "block_size = EXCLUDED.block_size, "
    "interactive_reserve_tokens = EXCLUDED.interactive_reserve_tokens, "
    "last_seen_at = now()"
)

# The models of the nodes seen within :s seconds (NULL for a live node whose engine named
# none), one row per model: no row at all means no node is live.
SERVED_MODELS = (
    "SELECT DISTINCT model FROM nodes WHERE last_seen_at > now() - make_interval(secs => :s)"
)

# The endpoints the live nodes serving :m serve, one row per node (NULL: a node that did not
# say, taken as serving every endpoint).
SERVED_ENDPOINTS = (
    "SELECT endpoints FROM nodes "
    "WHERE model = :m AND last_seen_at > now() - make_interval(secs => :s)"
)

# The node is alive (its last_seen_at is what the dashboard and the gateway trust).
TOUCH_NODE = "UPDATE nodes SET last_seen_at = now() WHERE name = :n"

# Every node ever registered, by name.
ALL_NODES = (
    "SELECT name, engine_url, model, num_blocks, block_size, "
    "interactive_reserve_tokens, last_seen_at, endpoints FROM nodes ORDER BY name"
)


class Nodes:
    """Node registrations."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def upsert_node(
        self,
        name: str,
        engine_url: str,
        model: str | None,
        num_blocks: int,
        block_size: int,
        interactive_reserve_tokens: int,
        endpoints: Iterable[str] | None = None,
    ) -> None:
        """Register ``name`` (or refresh it); ``endpoints``: the batch endpoints its engine
        serves (None: not known, taken as every endpoint)."""
        with self._db.transaction() as conn:
            conn.execute(
                text(UPSERT_NODE),
                {
                    "n": name,
                    "u": engine_url,
                    "m": model,
                    "b": num_blocks,
                    "s": block_size,
                    "r": interactive_reserve_tokens,
                    "e": None if endpoints is None else sorted(endpoints),
                },
            )

    def served_models(self, live_within_s: float) -> tuple[set[str], bool]:
        """The models nodes seen in the last ``live_within_s`` seconds serve, and whether any
        node was seen then at all."""
        with self._db.transaction() as conn:
            rows = list(conn.execute(text(SERVED_MODELS), {"s": live_within_s}).scalars())
        return {m for m in rows if m is not None}, bool(rows)

    def served_endpoints(self, model: str, live_within_s: float) -> set[str] | None:
        """The endpoints live nodes serving ``model`` serve together; None if one of them
        did not say (or none is live)."""
        with self._db.transaction() as conn:
            rows = list(
                conn.execute(text(SERVED_ENDPOINTS), {"m": model, "s": live_within_s}).scalars()
            )
        if not rows or any(r is None for r in rows):
            return None
        return {e for r in rows for e in r}

    def touch_node(self, name: str) -> None:
        with self._db.transaction() as conn:
            conn.execute(text(TOUCH_NODE), {"n": name})

    def nodes(self) -> list[NodeRecord]:
        with self._db.transaction() as conn:
            rows = conn.execute(text(ALL_NODES)).all()
        return [
            NodeRecord(
                name=r.name,
                engine_url=r.engine_url,
                model=r.model,
                num_blocks=r.num_blocks,
                block_size=r.block_size,
                interactive_reserve_tokens=r.interactive_reserve_tokens,
                last_seen_at=r.last_seen_at,
                endpoints=None if r.endpoints is None else tuple(r.endpoints),
            )
            for r in rows
        ]
