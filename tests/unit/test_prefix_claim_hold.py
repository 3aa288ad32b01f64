"""Which nodes leave a new job's items in the queue while its prefix pass runs, and how long
(issue 36): only one that looks for prefixes, never past the bound, and the two waits are
settings an operator can set."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from backfill.config import Settings
from backfill.dispatch import FIRST_PREFILL_WAIT_S, PREFIX_PASS_HOLD_S, prefix_claim_hold_s
from backfill.dispatch.settings import DispatchConfig
from worker.node import dispatch_config


def test_a_node_that_looks_for_prefixes_holds_a_new_job_for_the_bound() -> None:
    assert prefix_claim_hold_s(True, 10.0) == 10.0


def test_a_node_that_does_not_look_for_prefixes_holds_nothing() -> None:
    """No item could lean on a prefix there: waiting would only delay it."""
    assert prefix_claim_hold_s(False, 10.0) is None


def test_a_bound_of_zero_turns_the_hold_off() -> None:
    assert prefix_claim_hold_s(True, 0.0) is None


def test_the_settings_default_to_the_dispatchers_defaults() -> None:
    settings = Settings()
    config = DispatchConfig(node="n")
    assert settings.prefix_pass_hold_s == config.prefix_pass_hold_s == PREFIX_PASS_HOLD_S
    assert (
        settings.prefix_first_prefill_wait_s == config.first_prefill_wait_s == FIRST_PREFILL_WAIT_S
    )


def test_the_hold_is_seconds_never_minutes() -> None:
    """Deadlines are hours; a hold of minutes would eat into them."""
    with pytest.raises(ValidationError):
        Settings(prefix_pass_hold_s=600)


def test_a_nodes_dispatcher_takes_both_waits_from_the_settings() -> None:
    config = dispatch_config(Settings(prefix_pass_hold_s=4, prefix_first_prefill_wait_s=7), "n")
    assert (config.prefix_pass_hold_s, config.first_prefill_wait_s) == (4, 7)
