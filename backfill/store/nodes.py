"""Nodes: the engines workers run beside, as each worker last registered its pool."""

from __future__ import annotations

from sqlalchemy import text

from backfill.store.database import Store
from backfill.store.records import NodeRecord

# Register a node or refresh its engine, pool size and reserve (a worker's start).
UPSERT_NODE = (
    "INSERT INTO nodes (name, engine_url, model, num_blocks, block_size, "
    "interactive_reserve_tokens) VALUES (:n, :u, :m, :b, :s, :r) "
    "ON CONFLICT (name) DO UPDATE SET engine_url = EXCLUDED.engine_url, "
    "model = EXCLUDED.model, num_blocks = EXCLUDED.num_blocks, "
    "block_size = EXCLUDED.block_size, "
    "interactive_reserve_tokens = EXCLUDED.interactive_reserve_tokens, "
    "last_seen_at = now()"
)

# The models of the nodes seen within :s seconds (NULL for a live node whose engine named
# none), one row per model: no row at all means no node is live.
SERVED_MODELS = (
    "SELECT DISTINCT model FROM nodes WHERE last_seen_at > now() - make_interval(secs => :s)"
)

# The node is alive (its last_seen_at is what the dashboard and the gateway trust).
TOUCH_NODE = "UPDATE nodes SET last_seen_at = now() WHERE name = :n"

# Every node ever registered, by name.
ALL_NODES = (
    "SELECT name, engine_url, model, num_blocks, block_size, "
    "interactive_reserve_tokens, last_seen_at FROM nodes ORDER BY name"
)


class Nodes(Store):
    """Node registrations."""

    def upsert_node(
        self,
        name: str,
        engine_url: str,
        model: str | None,
        num_blocks: int,
        block_size: int,
        interactive_reserve_tokens: int,
    ) -> None:
        with self._tx() as conn:
            conn.execute(
                text(UPSERT_NODE),
                {
                    "n": name,
                    "u": engine_url,
                    "m": model,
                    "b": num_blocks,
                    "s": block_size,
                    "r": interactive_reserve_tokens,
                },
            )

    def served_models(self, live_within_s: float) -> tuple[set[str], bool]:
        """The models nodes seen in the last ``live_within_s`` seconds serve, and whether any
        node was seen then at all."""
        with self._tx() as conn:
            rows = list(conn.execute(text(SERVED_MODELS), {"s": live_within_s}).scalars())
        return {m for m in rows if m is not None}, bool(rows)

    def touch_node(self, name: str) -> None:
        with self._tx() as conn:
            conn.execute(text(TOUCH_NODE), {"n": name})

    def nodes(self) -> list[NodeRecord]:
        with self._tx() as conn:
            rows = conn.execute(text(ALL_NODES)).all()
        return [NodeRecord(*r) for r in rows]
