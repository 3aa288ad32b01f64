"""The engine gate refuses to start, in one line, without what it cannot work without: its
node's name and the engine's own key (how the worker's requests are told from tenants')."""

from __future__ import annotations

import pytest
from pydantic import SecretStr

from backfill.config import Settings
from queue_api.engine_gate import EngineGate, GateMisconfigured, check_settings


async def _app(scope: object, receive: object, send: object) -> None:
    raise AssertionError("not called")


def test_without_its_node_the_gate_refuses_to_start() -> None:
    settings = Settings(engine_api_key=SecretStr("k"))
    with pytest.raises(GateMisconfigured, match="BACKFILL_GATE_NODE") as refused:
        EngineGate(_app, settings)
    assert "\n" not in str(refused.value)


def test_without_the_engines_key_the_gate_refuses_to_start() -> None:
    with pytest.raises(GateMisconfigured, match="BACKFILL_ENGINE_API_KEY") as refused:
        check_settings(Settings(gate_node="n0"))
    assert "\n" not in str(refused.value)
    with pytest.raises(GateMisconfigured, match="BACKFILL_ENGINE_API_KEY"):
        check_settings(Settings(gate_node="n0", engine_api_key=SecretStr("")))


def test_with_both_the_gate_starts_without_touching_a_store() -> None:
    settings = Settings(
        gate_node="n0",
        engine_api_key=SecretStr("k"),
        database_url="postgresql+psycopg://nowhere:1/x",
    )
    assert check_settings(settings) == ("n0", "k")
    gate = EngineGate(_app, settings)
    assert gate.node == "n0"
