"""The engine step scheduler's pure parts (``backfill_vllm``): settings, step-time model,
per-step plan and victim choice. No vLLM needed; the scheduler itself is tested in the
engine's venv (``backfill_vllm/tests``, run by tests/e2e/test_step_scheduler_unit.py)."""

from __future__ import annotations

import pytest

from backfill_vllm.policy import (
    SequenceView,
    StepView,
    VictimView,
    chunk_cap,
    idle_ready,
    kv_victims,
    lifted_cap,
    plan_step,
    slot_victims,
)
from backfill_vllm.settings import SchedulerSettings, SettingsError
from backfill_vllm.stepmodel import StepFit, StepTimeModel

DEFAULTS = SchedulerSettings()


def seq(
    rid: str,
    *,
    batch: bool = True,
    resident: bool = True,
    prefill: int = 0,
    paused: int = 0,
    progress: float | None = 0.0,
) -> SequenceView:
    return SequenceView(rid, batch, resident, prefill, paused, progress)


def view(
    *seqs: SequenceView,
    now: float = 0.0,
    fit: StepFit | None = None,
    last_step_s: float = 0.01,
    budget: int = 2048,
    quiet_s: float = 0.0,
    async_steps: bool = False,
    in_flight: bool = False,
) -> StepView:
    return StepView(seqs, now, fit, last_step_s, budget, quiet_s, async_steps, in_flight)


# -- settings ----------------------------------------------------------------------------


def test_settings_come_from_the_environment_with_defaults_for_the_rest() -> None:
    got = SchedulerSettings.from_env(
        {
            "BACKFILL_SCHED_BATCH_PRIORITY": "5",
            "BACKFILL_SCHED_CHUNK_TARGET_S": "0.1",
            "BACKFILL_SCHED_METRICS_PORT": "8101",
            "BACKFILL_SCHED_RIDE_ALONG_SHARE": "",
            "UNRELATED": "x",
        }
    )
    assert got.batch_priority == 5
    assert got.chunk_target_s == 0.1
    assert got.metrics_port == 8101
    assert got.ride_along_share == DEFAULTS.ride_along_share
    assert SchedulerSettings.from_env({}) == DEFAULTS


@pytest.mark.parametrize(
    ("env", "says"),
    [
        (
            {"BACKFILL_SCHED_CHUNK_TARGET_S": "soon"},
            "BACKFILL_SCHED_CHUNK_TARGET_S='soon': must be a number",
        ),
        ({"BACKFILL_SCHED_CHUNK_TARGET_S": "0"}, "BACKFILL_SCHED_CHUNK_TARGET_S=0.0: must be > 0"),
        ({"BACKFILL_SCHED_BATCH_PRIORITY": "1.5"}, "must be an integer"),
        ({"BACKFILL_SCHED_RIDE_ALONG_SHARE": "2"}, "between 0 and 1"),
        ({"BACKFILL_SCHED_STARVATION_S": "nan"}, "a number >= 0"),
        ({"BACKFILL_SCHED_METRICS_PORT": "70000"}, "a port"),
        ({"BACKFILL_SCHED_CHUNK_TOKEN": "9"}, "unknown setting BACKFILL_SCHED_CHUNK_TOKEN"),
    ],
)
def test_a_bad_setting_is_refused_with_its_name(env: dict[str, str], says: str) -> None:
    with pytest.raises(SettingsError) as err:
        SchedulerSettings.from_env(env)
    assert says in str(err.value)
    assert "\n" not in str(err.value)


# -- step-time model ---------------------------------------------------------------------


def test_the_model_recovers_a_line_from_noisy_steps() -> None:
    model = StepTimeModel(window=64, min_samples=8)
    for i in range(200):
        tokens = 1 + (i * 37) % 512
        noise = 0.0005 * ((i * 7919) % 11 - 5) / 5
        model.observe(tokens, 0.004 + 0.0001 * tokens + noise)
    fit = model.fit()
    assert fit is not None
    assert len(model) == 64
    assert fit.base_s == pytest.approx(0.004, abs=0.0005)
    assert fit.per_token_s == pytest.approx(0.0001, rel=0.05)
    assert fit.tokens_within(0.01) == pytest.approx(100, abs=6)


def test_the_model_has_no_fit_before_enough_steps_and_ignores_empty_ones() -> None:
    model = StepTimeModel(window=16, min_samples=4)
    for _ in range(3):
        model.observe(100, 0.01)
    model.observe(0, 0.5)
    model.observe(10, float("nan"))
    assert model.fit() is None
    model.observe(100, 0.01)
    fit = model.fit()
    # One token count only: no slope to fit, so time is taken as proportional to tokens.
    assert fit == StepFit(0.0, pytest.approx(0.0001), 4)  # type: ignore[arg-type]


def test_the_model_follows_the_machine_as_it_slows_down() -> None:
    model = StepTimeModel(window=32, min_samples=8)
    for i in range(100):
        model.observe(10 + i % 50, 0.001 * (10 + i % 50))
    for i in range(32):
        model.observe(10 + i % 50, 0.004 * (10 + i % 50))
    fit = model.fit()
    assert fit is not None
    assert fit.per_token_s == pytest.approx(0.004, rel=0.01)


def test_the_model_tells_the_fixed_cost_from_the_decodes_a_busy_engine_carries() -> None:
    # What the CPU engine showed: a line in all tokens fitted 0.036 s "fixed" with a few
    # decoding sequences and 0.125 s with ~50, on the same engine. With decodes apart, the
    # fixed cost stays the engine's own, however many sequences decode.
    def step(prefill: int, decodes: int) -> float:
        return 0.036 + 0.00096 * prefill + 0.0018 * decodes

    line, plane = StepTimeModel(window=128, min_samples=16), StepTimeModel(128, 16)
    for i in range(300):
        decodes = 40 + (i * 13) % 21  # a busy engine: 40-60 sequences decoding
        prefill = 64 * (1 + (i * 29) % 32)
        noise = 0.002 * ((i * 7919) % 11 - 5) / 5
        line.observe(prefill + decodes, step(prefill, decodes) + noise)
        plane.observe(prefill + decodes, step(prefill, decodes) + noise, decodes=decodes)
    lined, fitted = line.fit(), plane.fit()
    assert lined is not None
    assert fitted is not None
    assert lined.base_s > 2 * 0.036  # the decodes taken for fixed cost
    assert fitted.base_s == pytest.approx(0.036, abs=0.004)
    assert fitted.per_token_s == pytest.approx(0.00096, rel=0.03)
    assert fitted.per_decode_s == pytest.approx(0.0018, rel=0.1)
    assert fitted.seconds(1000, 50) == pytest.approx(step(1000, 50), rel=0.02)
    assert fitted.decodes_within(0.018) == pytest.approx(10, abs=1)


def test_the_model_falls_back_to_the_line_when_decodes_and_prompt_move_together() -> None:
    model = StepTimeModel(window=32, min_samples=8)
    for i in range(32):
        decodes = 10 + i % 8
        model.observe(11 * decodes, 0.01 + 0.001 * 11 * decodes, decodes=decodes)
    fit = model.fit()
    assert fit is not None
    assert fit.per_decode_s is None  # one line in all tokens: no split the steps can tell
    assert fit.per_token_s == pytest.approx(0.001, rel=0.01)
    assert fit.decode_s == fit.per_token_s
    # No decode ever seen: the line as before.
    flat = StepTimeModel(window=32, min_samples=8)
    for i in range(32):
        flat.observe(100 + i, 0.01 + 0.001 * (100 + i), decodes=0)
    got = flat.fit()
    assert got is not None
    assert got.per_decode_s is None
    assert got.base_s == pytest.approx(0.01, abs=1e-6)


def test_a_window_of_steps_all_at_the_cap_keeps_the_last_fit_that_could_see_the_line() -> None:
    # Once the cap is lifted every step carries the whole budget: the fit of such a window is
    # noise (measured: the fixed cost "grew" from 0.047 s to 0.137 s as the decodes filled up),
    # so the model keeps the fit made while the steps still spread.
    def step(prefill: int, decodes: int) -> float:
        return 0.04 + 0.001 * prefill + 0.002 * decodes

    model = StepTimeModel(window=64, min_samples=16)
    for i in range(64):
        decodes = 5 + i % 20
        prefill = 32 * (1 + (i * 29) % 40)
        model.observe(prefill + decodes, step(prefill, decodes), decodes=decodes)
    seen = model.fit()
    assert seen is not None
    assert seen.base_s == pytest.approx(0.04, abs=0.002)
    for i in range(200):  # lifted: 2,048 tokens a step, slower as the engine fills
        decodes = 40 + i % 3
        model.observe(2048, step(2048 - decodes, decodes) + 0.0005 * i, decodes=decodes)
    assert model.fit() == seen
    for i in range(64):  # an interactive spell: steps spread again, the model follows
        decodes = 5 + i % 20
        prefill = 32 * (1 + (i * 29) % 40)
        model.observe(prefill + decodes, 2 * step(prefill, decodes), decodes=decodes)
    slower = model.fit()
    assert slower is not None
    assert slower.per_token_s == pytest.approx(0.002, rel=0.02)


# -- the plan ----------------------------------------------------------------------------


def test_without_interactive_work_pending_batch_runs_under_the_chunk_cap() -> None:
    plan = plan_step(view(seq("b1"), seq("b2", prefill=900), seq("i1", batch=False)), DEFAULTS)
    assert not plan.holding
    assert plan.paused == frozenset()
    assert plan.admit_batch
    assert plan.prefill_allowance == DEFAULTS.chunk_tokens == plan.chunk_cap


def test_after_a_quiet_spell_without_interactive_work_batch_prefill_is_not_capped() -> None:
    lift = DEFAULTS.lift_cap_after_s
    batch = (seq("b1"), seq("b2", prefill=900))
    before = plan_step(view(*batch, quiet_s=lift - 0.01), DEFAULTS)
    assert before.prefill_allowance == DEFAULTS.chunk_tokens
    after = plan_step(view(*batch, quiet_s=lift, budget=4096), DEFAULTS)
    assert after.prefill_allowance == after.chunk_cap == 4096
    assert after.admit_batch
    # Never lifted when the setting is 0, and an interactive arrival holds batch at once
    # (the quiet spell it ended is the scheduler's to reset).
    never = SchedulerSettings(lift_cap_after_s=0)
    assert plan_step(view(*batch, quiet_s=1e9), never).prefill_allowance == never.chunk_tokens
    arrival = seq("i1", batch=False, resident=False)
    held = plan_step(view(*batch, arrival, quiet_s=1e9), DEFAULTS)
    assert held.holding
    assert held.prefill_allowance == 0


def test_a_lift_goes_only_as_far_as_its_step_target_when_one_is_set() -> None:
    lift = DEFAULTS.lift_cap_after_s
    batch = (seq("b1"), seq("b2", prefill=3000))
    fit = StepFit(base_s=0.05, per_token_s=0.0005, samples=50)
    bounded = SchedulerSettings(chunk_target_s=0.05, lifted_step_target_s=0.25)
    plan = plan_step(view(*batch, fit=fit, quiet_s=lift, budget=2048), bounded)
    assert plan.prefill_allowance == plan.chunk_cap == 500  # 0.25 s at 0.5 ms a token
    assert plan.lifted
    capped = plan_step(view(*batch, fit=fit, quiet_s=0.0, budget=2048), bounded)
    assert capped.chunk_cap == 100  # the lift is 5x the capped chunk, not 20x
    assert not capped.lifted
    # Never past vLLM's budget, never under the capped chunk, and the whole budget before
    # the model has a fit.
    assert plan_step(view(*batch, fit=fit, quiet_s=lift, budget=300), bounded).chunk_cap == 300
    short = SchedulerSettings(chunk_target_s=0.05, lifted_step_target_s=0.01)
    assert plan_step(view(*batch, fit=fit, quiet_s=lift), short).chunk_cap == 100
    assert plan_step(view(*batch, quiet_s=lift, budget=2048), bounded).chunk_cap == 2048
    with pytest.raises(SettingsError, match="LIFTED_STEP_TARGET_S"):
        SchedulerSettings(lifted_step_target_s=-1)


def test_a_lift_with_a_fixed_share_stops_where_the_steps_fixed_cost_is_that_share() -> None:
    # A CPU engine without bfloat16: ~0.07 s a step whatever it carries, 2.4 ms a token. The
    # whole budget (2,048 tokens) is a ~5 s step; at a 5% share the step is ~1.4 s:
    # 0.07 * 19 / 0.0024 = 554 tokens.
    lift = DEFAULTS.lift_cap_after_s
    batch = (seq("b1"), seq("b2", prefill=3000))
    slow = StepFit(base_s=0.07, per_token_s=0.0024, samples=50)
    # Off by default: vLLM's whole budget.
    assert plan_step(view(*batch, fit=slow, quiet_s=lift, budget=2048), DEFAULTS).chunk_cap == 2048
    share = SchedulerSettings(lift_fixed_share=0.05)
    plan = plan_step(view(*batch, fit=slow, quiet_s=lift, budget=2048), share)
    assert plan.prefill_allowance == plan.chunk_cap == 554
    assert slow.seconds(plan.chunk_cap) == pytest.approx(0.07 / 0.05, rel=0.01)
    # Where the whole budget keeps the fixed cost under its share, the lift is the budget.
    fast = StepFit(base_s=0.046, per_token_s=0.00048, samples=50)
    assert plan_step(view(*batch, fit=fast, quiet_s=lift, budget=1024), share).chunk_cap == 1024
    # A fit with no fixed cost has nothing to weigh: the whole budget.
    flat = StepFit(base_s=0.0, per_token_s=0.0024, samples=50)
    assert plan_step(view(*batch, fit=flat, quiet_s=lift, budget=2048), share).chunk_cap == 2048
    # A larger share lifts less, never under the capped chunk; 0 is vLLM's whole budget.
    half = SchedulerSettings(lift_fixed_share=0.5)
    capped = plan_step(view(*batch, fit=slow, quiet_s=0.0, budget=2048), half).chunk_cap
    assert plan_step(view(*batch, fit=slow, quiet_s=lift, budget=2048), half).chunk_cap == max(
        capped, 29
    )
    whole = SchedulerSettings(lift_fixed_share=0)
    assert plan_step(view(*batch, fit=slow, quiet_s=lift, budget=2048), whole).chunk_cap == 2048
    # The fixed cost is the fit's own, not what the decoding sequences add: a busy engine
    # (decodes fitted apart) is bounded as an idle one, 0.036 * 19 / 0.00096 = 712 tokens.
    busy = StepFit(base_s=0.036, per_token_s=0.00096, samples=50, per_decode_s=0.0018)
    assert plan_step(view(*batch, fit=busy, quiet_s=lift, budget=2048), share).chunk_cap == 712
    with pytest.raises(SettingsError, match="LIFT_FIXED_SHARE"):
        SchedulerSettings(lift_fixed_share=1)


def test_an_interactive_request_waiting_pauses_every_resident_batch_sequence() -> None:
    plan = plan_step(
        view(seq("b1"), seq("b2", prefill=900), seq("i1", batch=False, resident=False)),
        DEFAULTS,
    )
    assert plan.holding
    assert plan.paused == {"b1", "b2"}
    assert not plan.admit_batch
    assert plan.prefill_allowance == 0
    assert plan.held_tokens == 1 + DEFAULTS.chunk_tokens


def test_an_interactive_request_still_prefilling_holds_batch_too() -> None:
    plan = plan_step(view(seq("b1"), seq("i1", batch=False, prefill=40)), DEFAULTS)
    assert plan.holding
    assert plan.paused == {"b1"}


def test_the_chunk_cap_is_sized_from_the_fitted_step_time() -> None:
    fit = StepFit(base_s=0.02, per_token_s=0.0002, samples=50)
    settings = SchedulerSettings(chunk_target_s=0.01)
    assert chunk_cap(settings, fit, 2048) == 50
    assert chunk_cap(settings, None, 2048) == settings.chunk_tokens
    # A machine so slow one token blows the target still moves: the floor holds.
    assert chunk_cap(settings, StepFit(0.0, 1.0, 50), 2048) == settings.min_chunk_tokens
    assert chunk_cap(settings, StepFit(0.0, 1e-9, 50), 2048) == 2048


def test_a_sequence_at_its_starvation_bound_in_steps_is_relieved() -> None:
    settings = SchedulerSettings(starvation_steps=4, starvation_s=0)
    pending = seq("i1", batch=False, resident=False)
    plan = plan_step(view(seq("b1", paused=2), seq("b2", paused=3), pending), settings)
    assert plan.relieved == {"b2"}
    assert plan.paused == {"b1"}


def test_a_sequence_at_its_starvation_bound_in_seconds_is_relieved_one_step_early() -> None:
    settings = SchedulerSettings(starvation_steps=0, starvation_s=1.0)
    pending = seq("i1", batch=False, resident=False)
    # Progress at 0; the step starting at 0.85 ends at about 0.95, the next at 1.05: too late.
    plan = plan_step(view(seq("b1", prefill=500), pending, now=0.85, last_step_s=0.1), settings)
    assert plan.relieved == {"b1"}
    assert plan.prefill_allowance == plan.chunk_cap
    plan = plan_step(view(seq("b1"), pending, now=0.7, last_step_s=0.1), settings)
    assert plan.relieved == frozenset()


def test_batch_decoders_ride_along_up_to_their_share_of_the_step() -> None:
    fit = StepFit(base_s=0.01, per_token_s=0.001, samples=50)
    settings = SchedulerSettings(ride_along_share=0.5)
    batch = [seq(f"b{i}", paused=i) for i in range(20)]
    pending = seq("i1", batch=False, resident=False, prefill=10)
    plan = plan_step(view(*batch, seq("b-pre", prefill=300), pending, fit=fit), settings)
    # The step costs 0.01 + 10 * 0.001 = 0.02 s without batch; half is 10 decode tokens,
    # given to the longest paused first. A batch prefill never rides.
    assert plan.riding == {f"b{i}" for i in range(10, 20)}
    assert plan.paused == {f"b{i}" for i in range(10)} | {"b-pre"}


# -- victims -----------------------------------------------------------------------------


def test_slot_victims_free_a_slot_per_waiting_interactive_request_losing_least_work() -> None:
    running = [
        VictimView("old", 900, 60, 1.0),
        VictimView("young", 20, 2, 2.0),
        VictimView("mid", 300, 20, 3.0),
    ]
    assert slot_victims(running, free_slots=0, interactive_waiting=2) == ["young", "mid"]
    assert slot_victims(running, free_slots=1, interactive_waiting=2) == ["young"]
    assert slot_victims(running, free_slots=2, interactive_waiting=2) == []
    assert slot_victims(running, free_slots=0, interactive_waiting=9) == ["young", "mid", "old"]


def test_kv_victims_free_blocks_only_for_requests_they_can_make_room_for() -> None:
    running = [VictimView("a", 100, 10, 1.0), VictimView("b", 50, 5, 2.0)]
    assert kv_victims(running, free_blocks=2, needs=[4]) == ["b"]
    assert kv_victims(running, free_blocks=2, needs=[4, 8]) == ["b", "a"]
    assert kv_victims(running, free_blocks=9, needs=[4]) == []
    # 2 free + 15 from batch cannot hold 30: nothing is thrown away for it.
    assert kv_victims(running, free_blocks=2, needs=[30]) == []
    assert kv_victims(running, free_blocks=2, needs=[4, 30]) == ["b"]


def test_waiting_batch_at_its_bound_in_seconds_is_admitted_while_holding() -> None:
    # Interactive waits (holding). Of two waiting batch requests, the one that has waited
    # past starvation_s (1 s) is admitted with a capped chunk; the other stays out.
    plan = plan_step(
        view(
            seq("i", batch=False, resident=False, prefill=50),
            seq("old", resident=False, prefill=40, progress=0.0),
            seq("new", resident=False, prefill=40, progress=0.9),
            now=1.0,
        ),
        DEFAULTS,
    )
    assert plan.holding
    assert not plan.admit_batch
    assert plan.admitted == frozenset({"old"})
    assert plan.prefill_allowance == plan.chunk_cap
    no_bound = SchedulerSettings(starvation_steps=0, starvation_s=0)
    plan = plan_step(
        view(
            seq("i", batch=False, resident=False, prefill=50),
            seq("old", resident=False, prefill=40, progress=-1e6),
            now=1.0,
        ),
        no_bound,
    )
    assert plan.admitted == frozenset()
    assert plan.prefill_allowance == 0


def test_a_stalled_step_is_kept_out_of_the_fit_but_a_changed_machine_is_followed() -> None:
    def step(prefill: int, decodes: int) -> float:
        return 0.01 + 0.0001 * prefill + 0.0005 * decodes

    model = StepTimeModel(window=64, min_samples=16)
    for i in range(64):
        decodes = 5 + i % 20
        prefill = 16 * (1 + (i * 29) % 40)
        model.observe(prefill + decodes, step(prefill, decodes), decodes=decodes)
    before = model.fit()
    assert before is not None
    model.observe(256 + 10, 20 * step(256, 10), decodes=10)  # the process stalled for a step
    assert model.fit() == before
    assert model.outliers == 1
    # Ten times slower, step after step: past MAX_OUTLIER_RUN in a row it is let in.
    for i in range(64):
        decodes = 5 + i % 20
        prefill = 16 * (1 + (i * 29) % 40)
        model.observe(prefill + decodes, 10 * step(prefill, decodes), decodes=decodes)
    after = model.fit()
    assert after is not None
    assert after.per_token_s > 5 * before.per_token_s


def test_a_flat_fit_never_lifts_the_capped_chunk_past_its_ceiling() -> None:
    flat = StepFit(base_s=0.01, per_token_s=1e-9, samples=64, per_decode_s=0.0005)
    assert chunk_cap(DEFAULTS, flat, 8192) == DEFAULTS.max_chunk_tokens
    low = SchedulerSettings(max_chunk_tokens=300)
    assert chunk_cap(low, flat, 8192) == 300
    with pytest.raises(SettingsError, match="BACKFILL_SCHED_MAX_CHUNK_TOKENS"):
        SchedulerSettings(min_chunk_tokens=64, max_chunk_tokens=32)


FIT = StepFit(base_s=0.005, per_token_s=0.0001, samples=64, per_decode_s=0.001)


def test_while_interactive_is_likely_batch_decodes_take_turns_within_the_step_target() -> None:
    # 0.01 s of batch a step at 1 ms a decode: 10 of 25 batch decoders move, the longest
    # without progress first; an interactive decode rides in the same step.
    decoders = [seq(f"b{k:02}", progress=float(k)) for k in range(25)]
    plan = plan_step(view(*decoders, seq("i", batch=False), now=30.0, fit=FIT), DEFAULTS)
    assert not plan.holding
    assert plan.bounded
    moving = {f"b{k:02}" for k in range(10)}
    assert plan.paused == frozenset(s.request_id for s in decoders) - moving
    # A step scheduled ahead of the one in flight (async scheduling): an arrival also waits
    # for it, so half.
    ahead = SchedulerSettings(ahead_while_likely=True)
    plan = plan_step(view(*decoders, now=30.0, fit=FIT, async_steps=True, in_flight=True), ahead)
    assert len(plan.paused) == 20
    # Scheduled with none in flight, the whole target.
    plan = plan_step(view(*decoders, now=30.0, fit=FIT, async_steps=True), ahead)
    assert len(plan.paused) == 15


def test_a_batch_only_step_is_not_scheduled_ahead_while_interactive_is_likely() -> None:
    # Async scheduling, a step in flight, interactive work a moment ago and none now: the
    # step is emptied (held back), so vLLM's loop waits for the one in flight and schedules
    # the next with whatever arrived meanwhile.
    decoders = [seq(f"b{k}") for k in range(4)]
    waiting = seq("w", resident=False, prefill=300)
    plan = plan_step(
        view(*decoders, waiting, fit=FIT, quiet_s=0.5, async_steps=True, in_flight=True),
        DEFAULTS,
    )
    assert plan.held_back
    assert plan.paused == frozenset(s.request_id for s in decoders)
    assert plan.prefill_allowance == 0
    assert not plan.admit_batch
    assert not plan.holding  # nobody's pause: no pause is counted for it


@pytest.mark.parametrize(
    ("why", "kwargs", "settings"),
    [
        ("no step in flight", {"in_flight": False}, DEFAULTS),
        ("sync scheduling", {"async_steps": False}, DEFAULTS),
        ("past the likely window", {"quiet_s": 5.0}, DEFAULTS),
        ("the setting on", {}, SchedulerSettings(ahead_while_likely=True)),
    ],
)
def test_steps_are_scheduled_ahead_otherwise(
    why: str, kwargs: dict[str, object], settings: SchedulerSettings
) -> None:
    args: dict[str, object] = {"quiet_s": 0.5, "async_steps": True, "in_flight": True}
    args |= kwargs
    plan = plan_step(view(*(seq(f"b{k}") for k in range(4)), fit=FIT, **args), settings)  # type: ignore[arg-type]
    assert not plan.held_back, why
    assert plan.prefill_allowance > 0, why


def test_interactive_work_in_the_engine_is_scheduled_ahead_with_batch_beside_it() -> None:
    # An interactive stream decodes: its next step is scheduled ahead as vLLM does (its
    # tokens keep coming), batch within the halved target beside it.
    decoders = [seq(f"b{k:02}") for k in range(25)]
    plan = plan_step(
        view(*decoders, seq("i", batch=False), fit=FIT, async_steps=True, in_flight=True),
        DEFAULTS,
    )
    assert not plan.held_back
    assert len(plan.paused) == 20


def test_with_room_left_batch_prefill_gets_what_the_decodes_leave() -> None:
    plan = plan_step(view(*(seq(f"b{k}") for k in range(6)), fit=FIT), DEFAULTS)
    # 6 decodes = 6 ms of 10: 4 ms of prefill at 0.1 ms a token.
    assert plan.paused == frozenset()
    assert plan.prefill_allowance == 40
    assert plan.bounded


def test_past_the_likely_window_only_the_prefill_cap_applies() -> None:
    decoders = [seq(f"b{k:02}") for k in range(25)]
    quiet = DEFAULTS.interactive_likely_s
    plan = plan_step(view(*decoders, fit=FIT, quiet_s=quiet), DEFAULTS)
    assert plan.paused == frozenset()
    assert not plan.bounded
    off = SchedulerSettings(interactive_likely_s=0)
    assert plan_step(view(*decoders, fit=FIT), off).paused == frozenset()


def test_a_flag_setting_takes_one_or_zero_and_refuses_anything_else() -> None:
    on = SchedulerSettings.from_env({"BACKFILL_SCHED_AHEAD_WHILE_LIKELY": "1"})
    assert on.ahead_while_likely
    off = SchedulerSettings.from_env({"BACKFILL_SCHED_AHEAD_WHILE_LIKELY": "false"})
    assert not off.ahead_while_likely
    with pytest.raises(SettingsError, match="BACKFILL_SCHED_AHEAD_WHILE_LIKELY='maybe'"):
        SchedulerSettings.from_env({"BACKFILL_SCHED_AHEAD_WHILE_LIKELY": "maybe"})


# -- idle-ready: batch sits out while interactive work is in the engine and right after ------


def test_right_after_interactive_work_batch_sits_out_and_leaves_the_engine_idle() -> None:
    # Interactive arrivals come in bursts: for ``idle_ready_s`` after the last one left the
    # engine, batch carries nothing (decoders paused, no prefill, nobody admitted), so the
    # next arrival of the burst finds no step in flight.
    decoders = [seq(f"b{k}", progress=0.9) for k in range(4)]
    prefilling = seq("p", prefill=500, progress=0.9)
    waiting = seq("w", resident=False, prefill=300, progress=0.9)
    settings = SchedulerSettings(idle_ready_s=0.5)
    plan = plan_step(view(*decoders, prefilling, waiting, now=1.0, fit=FIT, quiet_s=0.2), settings)
    assert plan.idle_ready
    assert plan.paused == frozenset({"b0", "b1", "b2", "b3", "p"})
    assert plan.prefill_allowance == 0
    assert not plan.admit_batch
    assert plan.admitted == frozenset()
    assert not plan.holding  # no interactive request waits on it
    assert plan.held_tokens == 4 + plan.chunk_cap  # what they would have carried: a chunk


def test_beside_a_decoding_interactive_request_batch_sits_out_rather_than_ride_in_turns() -> None:
    # Without the setting, batch decodes take turns within the step target beside it (the
    # whole-step bound); with it, the interactive stream's steps carry no batch at all.
    decoders = [seq(f"b{k:02}", progress=0.9) for k in range(25)]
    streaming = seq("i", batch=False)
    bounded = plan_step(view(*decoders, streaming, now=1.0, fit=FIT), DEFAULTS)
    assert bounded.bounded
    assert len(bounded.paused) == 15
    idle = plan_step(
        view(*decoders, streaming, now=1.0, fit=FIT), SchedulerSettings(idle_ready_s=1)
    )
    assert idle.idle_ready
    assert idle.paused == frozenset(s.request_id for s in decoders)
    assert idle.prefill_allowance == 0


@pytest.mark.parametrize(
    ("why", "quiet_s", "settings"),
    [
        ("past the window", 0.5, SchedulerSettings(idle_ready_s=0.5)),
        ("the setting off (the default)", 0.2, SchedulerSettings(interactive_likely_s=0)),
    ],
)
def test_batch_runs_past_the_idle_window_or_with_the_setting_off(
    why: str, quiet_s: float, settings: SchedulerSettings
) -> None:
    seqs = [seq(f"b{k}", progress=0.9) for k in range(4)]
    plan = plan_step(view(*seqs, now=1.0, fit=FIT, quiet_s=quiet_s), settings)
    assert not plan.idle_ready, why
    assert plan.paused == frozenset(), why
    assert plan.prefill_allowance > 0, why


def test_batch_at_its_starvation_bound_moves_in_an_idle_window() -> None:
    # The bound in seconds holds here as while holding: the resident sequence and the
    # waiting one due by it move, in one capped chunk; the rest sit out.
    settings = SchedulerSettings(idle_ready_s=2.0, starvation_s=1.0)
    due = seq("due", progress=0.0)
    fresh = seq("fresh", progress=0.95)
    late = seq("late", resident=False, prefill=300, progress=0.0)
    plan = plan_step(view(due, fresh, late, now=1.0, fit=FIT, quiet_s=0.1), settings)
    assert plan.idle_ready
    assert plan.relieved == frozenset({"due"})
    assert plan.admitted == frozenset({"late"})
    assert plan.paused == frozenset({"fresh"})
    assert plan.prefill_allowance == chunk_cap(settings, FIT, 2048)


def test_the_idle_window_is_a_setting_that_refuses_a_negative_value() -> None:
    got = SchedulerSettings.from_env({"BACKFILL_SCHED_IDLE_READY_S": "0.75"})
    assert got.idle_ready_s == 0.75
    assert SchedulerSettings().idle_ready_s == 0.0
    with pytest.raises(SettingsError, match="BACKFILL_SCHED_IDLE_READY_S"):
        SchedulerSettings(idle_ready_s=-1.0)


def test_the_idle_rule_reads_the_window_against_the_quiet_time() -> None:
    assert idle_ready(0.5, 0.0)  # interactive work in the engine
    assert idle_ready(0.5, 0.2)
    assert not idle_ready(0.5, 0.5)
    assert not idle_ready(0.0, 0.0)


def test_a_lifted_batch_only_step_is_held_back_while_interactive_is_likely() -> None:
    # A lift sooner than the likely window's end (idle-ready's setting): the lifted step, the
    # longest batch makes, is not scheduled ahead of the one in flight either.
    settings = SchedulerSettings(lift_cap_after_s=1.0, interactive_likely_s=30.0)
    decoders = [seq(f"b{k}") for k in range(4)]
    args: dict[str, object] = {"fit": FIT, "quiet_s": 5.0, "async_steps": True}
    held = plan_step(view(*decoders, in_flight=True, **args), settings)  # type: ignore[arg-type]
    assert held.held_back
    assert held.prefill_allowance == 0
    # With nothing in flight it runs lifted, not bounded.
    plan = plan_step(view(*decoders, **args), settings)  # type: ignore[arg-type]
    assert plan.lifted
    assert not plan.bounded
    assert plan.prefill_allowance == lifted_cap(settings, FIT, 2048)
