"""The admission policy as pure functions: no Redis, no Postgres."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backfill.policy import (
    AdmissionRequest,
    ClassLimits,
    DecisionKind,
    PoolPolicy,
    PoolState,
    Reason,
    ServiceClass,
    batch_ceiling,
    batch_slack,
    charged_tokens,
    choose_victims,
    decide,
    interactive_room,
    tenant_share_ppm,
    tenant_share_tokens,
)
from backfill.reservations import BatchOvercommit, overcommit_from_ratios, reservation_tokens
from tests.support_policy import pool_policy

BATCH = ServiceClass.BATCH
INTERACTIVE = ServiceClass.INTERACTIVE


@dataclass(frozen=True)
class FakeLease:
    lease_id: str
    tokens: int
    generated_tokens: int = 0
    started_at_ms: int = 0
    deadline_ms: int | None = None
    preemptible: bool = True
    service_class: ServiceClass = BATCH


def req(cls: ServiceClass, prompt: int, out: int, **kw: object) -> AdmissionRequest:
    return AdmissionRequest(cls, prompt, out, **kw)  # type: ignore[arg-type]


# -- reservation size


def test_reservation_rounds_prompt_plus_output_up_to_whole_blocks() -> None:
    assert reservation_tokens(100, 28, 16) == 128
    assert reservation_tokens(100, 29, 16) == 144
    assert reservation_tokens(0, 1, 16) == 16


def test_reservation_with_n_charges_each_sequence_its_own_prompt_copy() -> None:
    # 3 sequences of (5 + 7) tokens each round to one 16-token block apiece.
    assert reservation_tokens(5, 7, 16, n=3) == 48
    assert reservation_tokens(10, 7, 16, n=3) == 96
    assert reservation_tokens(100, 28, 16, n=2) == 2 * reservation_tokens(100, 28, 16)


@pytest.mark.parametrize(
    ("prompt", "out", "bs", "n"), [(-1, 1, 16, 1), (0, 0, 16, 1), (0, 1, 0, 1), (0, 1, 16, 0)]
)
def test_reservation_refuses_nonsense(prompt: int, out: int, bs: int, n: int) -> None:
    with pytest.raises(ValueError, match="need"):
        reservation_tokens(prompt, out, bs, n)


@given(st.integers(0, 10**6), st.integers(1, 10**6), st.integers(1, 256), st.integers(1, 8))
def test_reservation_is_whole_blocks_and_covers_the_worst_case(
    prompt: int, out: int, bs: int, n: int
) -> None:
    tokens = reservation_tokens(prompt, out, bs, n)
    assert tokens % bs == 0
    assert tokens >= n * (prompt + out)
    assert tokens < n * (prompt + out + bs)


# -- reserve, slack, room


def test_reserve_as_tokens_or_as_fraction_of_capacity() -> None:
    assert PoolPolicy(interactive_reserve_tokens=3000).reserve_tokens(10_000) == 3000
    assert PoolPolicy(interactive_reserve_fraction=0.25).reserve_tokens(10_001) == 2501
    assert PoolPolicy().reserve_tokens(10_000) == 0
    assert PoolPolicy(interactive_reserve_tokens=50_000).reserve_tokens(10_000) == 10_000
    with pytest.raises(ValueError, match="not both"):
        PoolPolicy(interactive_reserve_tokens=1, interactive_reserve_fraction=0.1)
    with pytest.raises(ValueError, match="fraction"):
        PoolPolicy(interactive_reserve_fraction=1.5)


def test_batch_slack_keeps_out_the_reserve_interactive_use_headroom_and_margin() -> None:
    policy = PoolPolicy(
        interactive_reserve_tokens=2000, headroom_tokens=500, safety_margin_tokens=100
    )
    # Interactive below the reserve: the reserve is what is kept out.
    state = PoolState(10_000, 16, interactive_in_use=1000, batch_in_use=3000)
    assert batch_slack(state, policy) == 10_000 - 2000 - 3000 - 100
    # Interactive above the reserve: its use plus headroom is kept out.
    state = PoolState(10_000, 16, interactive_in_use=4000, batch_in_use=1000)
    assert batch_slack(state, policy) == 10_000 - 4500 - 1000 - 100
    # Never negative.
    state = PoolState(10_000, 16, interactive_in_use=9000, batch_in_use=1000)
    assert batch_slack(state, policy) == 0


def test_interactive_bypassing_the_gateway_narrows_batch_slack() -> None:
    policy = PoolPolicy(interactive_reserve_tokens=1000)
    seen = PoolState(10_000, 16, interactive_in_use=500, observed_non_batch=6000)
    assert seen.interactive_effective == 6000
    assert batch_slack(seen, policy) == 4000
    # ...but not the room interactive itself may take.
    assert interactive_room(seen, policy) == 9500


def test_interactive_room_is_everything_batch_does_not_hold() -> None:
    policy = PoolPolicy(interactive_reserve_tokens=1000)
    assert interactive_room(PoolState(10_000, 16, 2000, 5000), policy) == 3000
    assert interactive_room(PoolState(10_000, 16, 6000, 5000), policy) == 0


def test_batch_ceiling_is_the_most_batch_could_ever_hold() -> None:
    policy = PoolPolicy(
        interactive_reserve_tokens=2000, headroom_tokens=3000, safety_margin_tokens=100
    )
    assert batch_ceiling(10_000, policy) == 10_000 - 3000 - 100


# -- overcommit


def test_overcommit_is_off_by_default() -> None:
    policy = PoolPolicy()
    assert policy.batch_overcommit is None
    assert charged_tokens(req(BATCH, 100, 1000), 16, policy) == reservation_tokens(100, 1000, 16)


def test_overcommit_charges_preemptible_batch_only() -> None:
    policy = PoolPolicy(batch_overcommit=BatchOvercommit.from_ratio(0.25))
    assert charged_tokens(req(BATCH, 100, 1000), 16, policy) == reservation_tokens(100, 250, 16)
    full = reservation_tokens(100, 1000, 16)
    assert charged_tokens(req(BATCH, 100, 1000, preemptible=False), 16, policy) == full
    assert charged_tokens(req(INTERACTIVE, 100, 1000), 16, policy) == full


def test_overcommit_comes_from_a_high_quantile_of_observed_output_ratios() -> None:
    ratios = [i / 1000 for i in range(1, 1001)]  # 0.001 .. 1.0
    oc = overcommit_from_ratios(ratios, quantile=0.9, min_samples=100)
    assert oc is not None
    assert oc.output_ratio_ppm == 900_000
    assert overcommit_from_ratios(ratios[:50], min_samples=100) is None
    assert BatchOvercommit(1).charged_output(1) == 1  # never charges zero output


def test_class_limit_uses_the_declared_output_even_with_overcommit() -> None:
    policy = PoolPolicy(batch=ClassLimits(1000), batch_overcommit=BatchOvercommit.from_ratio(0.1))
    d = decide(req(BATCH, 500, 600), PoolState(100_000, 16), policy)
    assert d.kind is DecisionKind.REJECT
    assert d.code is Reason.OVER_CLASS_LIMIT


# -- victims


def test_victims_lose_the_least_generated_work() -> None:
    leases = [
        FakeLease("a", 100, generated_tokens=90),
        FakeLease("b", 100, generated_tokens=5),
        FakeLease("c", 100, generated_tokens=40),
    ]
    assert [v.lease_id for v in choose_victims(leases, 150) or ()] == ["b", "c"]


def test_victims_prefer_the_latest_deadline_then_the_most_recently_started() -> None:
    leases = [
        FakeLease("soon", 100, deadline_ms=1_000),
        FakeLease("late", 100, deadline_ms=9_000),
        FakeLease("none", 100, deadline_ms=None, started_at_ms=1),
        FakeLease("none-new", 100, deadline_ms=None, started_at_ms=5),
    ]
    order = [v.lease_id for v in choose_victims(leases, 400) or ()]
    assert order == ["none-new", "none", "late", "soon"]
    assert [v.lease_id for v in choose_victims(leases, 100) or ()] == ["none-new"]


def test_victims_never_include_non_preemptible_or_interactive_leases() -> None:
    leases = [
        FakeLease("capped", 1000, preemptible=False),
        FakeLease("chat", 1000, service_class=INTERACTIVE),
        FakeLease("ok", 100),
    ]
    assert choose_victims(leases, 100) == (leases[2],)
    assert choose_victims(leases, 101) is None


def test_victims_that_others_already_cover_are_spared() -> None:
    # Greedy takes a (10) then b (500); b alone covers the need, so a is spared.
    leases = [FakeLease("a", 10, generated_tokens=0), FakeLease("b", 500, generated_tokens=1)]
    assert [v.lease_id for v in choose_victims(leases, 300) or ()] == ["b"]


@given(
    st.lists(st.tuples(st.integers(1, 500), st.integers(0, 100), st.booleans()), max_size=12),
    st.integers(0, 3000),
)
def test_victims_free_enough_or_none_exist(specs: list[tuple[int, int, bool]], needed: int) -> None:
    leases = [
        FakeLease(f"l{i}", t, generated_tokens=g, preemptible=p)
        for i, (t, g, p) in enumerate(specs)
    ]
    victims = choose_victims(leases, needed)
    freeable = sum(x.tokens for x in leases if x.preemptible)
    if victims is None:
        assert freeable < needed
    else:
        assert sum(v.tokens for v in victims) >= needed
        assert all(v.preemptible for v in victims)
        # Minimal: no single victim could be spared.
        total = sum(v.tokens for v in victims)
        assert all(total - v.tokens < needed for v in victims)


# -- decisions


POLICY = replace(pool_policy(4096, 8192, 2000, 200, 64), defer_retry_after_s=2.0)


def test_batch_is_admitted_within_slack_with_a_reason() -> None:
    d = decide(req(BATCH, 1000, 1000), PoolState(10_000, 16), POLICY)
    assert d.kind is DecisionKind.ADMIT
    assert d.tokens == 2000
    assert "slack" in d.reason


def test_batch_beyond_slack_is_deferred_with_a_retry_hint() -> None:
    d = decide(req(BATCH, 1000, 1000), PoolState(10_000, 16, batch_in_use=6000), POLICY)
    assert d.kind is DecisionKind.DEFER
    assert d.code is Reason.NO_SLACK
    assert d.retry_after_s == 2.0
    assert "exceeds the slack of 1936" in d.reason


def test_batch_over_its_class_limit_is_rejected() -> None:
    d = decide(req(BATCH, 8000, 193), PoolState(100_000, 16), POLICY)
    assert (d.kind, d.code) == (DecisionKind.REJECT, Reason.OVER_CLASS_LIMIT)
    assert d.retry_after_s is None


def test_batch_larger_than_the_pool_could_ever_give_is_rejected() -> None:
    d = decide(req(BATCH, 4000, 4000), PoolState(10_000, 16), POLICY)
    assert (d.kind, d.code) == (DecisionKind.REJECT, Reason.LARGER_THAN_POOL)


def test_batch_is_deferred_while_the_ledger_is_rebuilt() -> None:
    d = decide(req(BATCH, 10, 10), PoolState(10_000, 16, ready=False), POLICY)
    assert (d.kind, d.code) == (DecisionKind.DEFER, Reason.LEDGER_REBUILDING)


def test_interactive_keeps_its_reserve_while_the_ledger_is_rebuilt() -> None:
    state = PoolState(10_000, 16, interactive_in_use=1000, ready=False)
    assert decide(req(INTERACTIVE, 496, 496), state, POLICY).kind is DecisionKind.ADMIT
    d = decide(req(INTERACTIVE, 600, 500), state, POLICY)
    assert (d.kind, d.code) == (DecisionKind.DEFER, Reason.LEDGER_REBUILDING)


def test_interactive_preempts_batch_when_the_room_is_short() -> None:
    leases = [FakeLease("old", 3000, generated_tokens=2000), FakeLease("new", 3000)]
    state = PoolState(10_000, 16, interactive_in_use=3000, batch_in_use=6000)
    d = decide(req(INTERACTIVE, 1000, 1000), state, POLICY, leases)
    assert d.kind is DecisionKind.PREEMPT_THEN_ADMIT
    assert d.victims == ("new",)
    assert d.admitted
    assert "preempting 1 batch lease" in d.reason


def test_interactive_is_deferred_when_even_preemption_cannot_make_room() -> None:
    leases = [FakeLease("capped", 6000, preemptible=False)]
    state = PoolState(10_000, 16, interactive_in_use=3000, batch_in_use=6000)
    d = decide(req(INTERACTIVE, 1000, 1000), state, POLICY, leases)
    assert (d.kind, d.code) == (DecisionKind.DEFER, Reason.NO_ROOM)
    no_preempt = req(INTERACTIVE, 1000, 1000, allow_preemption=False)
    assert decide(no_preempt, state, POLICY, [FakeLease("x", 6000)]).code is Reason.NO_ROOM


def test_a_tenant_at_its_share_waits_even_where_the_pool_has_room() -> None:
    # A share of 0.5 of 10,000 tokens: 5,000; the tenant holds 4,000 of them.
    request = req(INTERACTIVE, 1000, 1000, tenant_share_ppm=500_000)
    state = PoolState(10_000, 16, interactive_in_use=4000)
    d = decide(request, state, POLICY, tenant_in_use=4000)
    assert (d.kind, d.code) == (DecisionKind.DEFER, Reason.TENANT_SHARE)
    assert d.retry_after_s is not None
    assert "share of 5000" in d.reason
    # Another tenant on the same pool, or this one with room under its share, is admitted.
    assert decide(request, state, POLICY, tenant_in_use=0).admitted
    assert decide(req(INTERACTIVE, 500, 492, tenant_share_ppm=500_000), state, POLICY,
                  tenant_in_use=4000).admitted  # fmt: skip


def test_a_tenant_over_its_share_preempts_no_batch() -> None:
    leases = [FakeLease("b", 6000)]
    state = PoolState(10_000, 16, interactive_in_use=4000, batch_in_use=6000)
    request = req(INTERACTIVE, 1000, 1000, tenant_share_ppm=500_000)
    d = decide(request, state, POLICY, leases, tenant_in_use=4000)
    assert (d.code, d.victims) == (Reason.TENANT_SHARE, ())


def test_a_tenant_holding_nothing_is_never_refused_by_its_share() -> None:
    request = req(INTERACTIVE, 1000, 1000, tenant_share_ppm=100_000)  # more than its 1,000
    assert decide(request, PoolState(10_000, 16), POLICY).admitted


def test_a_tenant_share_is_counted_in_millionths_and_one_is_no_bound() -> None:
    assert tenant_share_ppm(0.5) == 500_000
    assert tenant_share_ppm(0.0000001) == 1
    assert tenant_share_ppm(1.0) is None
    assert tenant_share_tokens(10_000, 333_333) == 3333  # rounded down, as the script does
    with pytest.raises(ValueError, match="share"):
        tenant_share_ppm(0.0)


def test_interactive_larger_than_the_whole_pool_is_rejected() -> None:
    policy = PoolPolicy(interactive=ClassLimits(1_000_000))
    d = decide(req(INTERACTIVE, 5000, 5001), PoolState(10_000, 16), policy)
    assert (d.kind, d.code) == (DecisionKind.REJECT, Reason.LARGER_THAN_POOL)


@given(
    capacity=st.integers(1, 50_000),
    reserve=st.integers(0, 50_000),
    headroom=st.integers(0, 5000),
    margin=st.integers(0, 5000),
    interactive=st.integers(0, 50_000),
    batch=st.integers(0, 50_000),
    prompt=st.integers(0, 4000),
    out=st.integers(1, 4000),
)
def test_an_admitted_batch_request_never_pushes_batch_past_its_slack(
    capacity: int,
    reserve: int,
    headroom: int,
    margin: int,
    interactive: int,
    batch: int,
    prompt: int,
    out: int,
) -> None:
    policy = PoolPolicy(
        interactive_reserve_tokens=reserve, headroom_tokens=headroom, safety_margin_tokens=margin
    )
    state = PoolState(capacity, 16, interactive, batch)
    d = decide(req(BATCH, prompt, out), state, policy)
    if d.kind is DecisionKind.ADMIT:
        r = policy.reserve_tokens(capacity)
        assert batch + d.tokens <= capacity - max(r, interactive + headroom) - margin
