"""Pipeline schedules: their bubbles and memory against the formulas, and their errors."""

from __future__ import annotations

import dataclasses

import pytest

from nnxscale.parallelism.schedules import (
    BACKWARD,
    CHECK_COLUMNS,
    FORWARD,
    WEIGHTS,
    ScheduleError,
    Task,
    bubble_formula,
    check,
    expected_bubble,
    expected_peaks,
    gpipe,
    interleaved,
    one_f_one_b,
    simulate,
    split_layers,
    validate,
    zero_bubble,
    zero_bubble_formula,
    zero_bubble_v,
    zero_bubble_v_formula,
)

SHAPES = [(2, 2), (2, 8), (4, 4), (4, 8), (4, 16), (8, 8), (8, 32)]
COSTS = {"equal": lambda t: 1.0, "backward twice forward": None}


@pytest.mark.parametrize("cost", COSTS)
@pytest.mark.parametrize(("p", "m"), SHAPES)
def test_gpipe_and_1f1b_bubbles_are_the_formula(p, m, cost) -> None:
    for schedule in (gpipe(p, m), one_f_one_b(p, m)):
        timeline = simulate(schedule, COSTS[cost])
        assert timeline.bubble() == pytest.approx(bubble_formula(p, m), abs=1e-12)


@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 8), (4, 4), (4, 8), (8, 16)])
def test_interleaved_bubble_is_the_formula(p, m, v) -> None:
    timeline = simulate(interleaved(p, m, v))
    assert timeline.bubble() == pytest.approx(bubble_formula(p, m, v), abs=1e-12)
    assert timeline.bubble() < bubble_formula(p, m)  # less idle than without interleaving


@pytest.mark.parametrize(("p", "m"), SHAPES)
def test_peak_activations_are_m_for_gpipe_and_p_for_1f1b(p, m) -> None:
    assert simulate(gpipe(p, m)).peak_in_flight() == [m] * p
    peaks = simulate(one_f_one_b(p, m)).peak_in_flight()
    assert peaks == [min(m, p - d) for d in range(p)] and max(peaks) == min(m, p)


def test_interleaved_holds_its_warm_up_plus_one() -> None:
    peaks = simulate(interleaved(4, 8, 2)).peak_in_flight()
    assert peaks == [(4 - d - 1) * 2 + (2 - 1) * 4 + 1 for d in range(4)]  # chunks of 1/v stage


def test_every_task_runs_once_on_its_device() -> None:
    schedule = interleaved(4, 8, 2)
    validate(schedule)
    assert sum(len(tasks) for tasks in schedule.order) == 2 * 8 * 8
    for d, tasks in enumerate(schedule.order):
        assert {t.stage for t in tasks} == {d, d + 4}


def test_validate_names_duplicates_misplaced_and_missing_tasks() -> None:
    good = one_f_one_b(2, 2)
    twice = dataclasses.replace(good, order=(good.order[0] + good.order[0][:1], good.order[1]))
    with pytest.raises(ScheduleError, match=r"F0@0 appears twice"):
        validate(twice)
    swapped = dataclasses.replace(good, order=(good.order[1], good.order[0]))
    with pytest.raises(ScheduleError, match=r"on device 0, but stage 1 lives on device 1"):
        validate(swapped)
    short = dataclasses.replace(good, order=(good.order[0][:-1], good.order[1]))
    with pytest.raises(ScheduleError, match=r"1 tasks never run, e.g. \['B1@0'\]"):
        validate(short)


def test_a_deadlock_is_named() -> None:
    good = gpipe(2, 2)
    backward_first = tuple(sorted(good.order[1], key=lambda t: t.kind != BACKWARD))
    bad = dataclasses.replace(good, order=(good.order[0], backward_first))
    stuck = r"deadlocks: B0@0 waits for B0@1; B0@1 waits for F0@1\."
    with pytest.raises(ScheduleError, match=stuck):
        validate(bad)


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ScheduleError, match="not a multiple of it: use m = 4"):
        interleaved(4, 6, 2)
    with pytest.raises(ScheduleError, match="at least 1"):
        gpipe(0, 4)
    with pytest.raises(ScheduleError, match=r"among \[1, 2, 3, 6\]"):
        split_layers(6, 4)
    assert split_layers(6, 3) == [range(0, 2), range(2, 4), range(4, 6)]


def test_latency_delays_only_hand_overs() -> None:
    plain, slow = simulate(gpipe(2, 2)), simulate(gpipe(2, 2), latency=0.5)
    assert slow.makespan == plain.makespan + 2 * 0.5  # one hand-over each way on the path
    assert str(Task(FORWARD, 3, 1)) == "F3@1"


ZB_COSTS = [(1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (1.0, 1.5, 0.5), (2.0, 1.0, 1.0)]


@pytest.mark.parametrize(("f", "b", "w"), ZB_COSTS)
@pytest.mark.parametrize(("p", "m"), [(1, 4), (2, 2), (2, 8), (3, 5), (4, 4), (4, 16), (8, 32)])
def test_zero_bubble_is_qi_et_al_s_formula(p, m, f, b, w) -> None:
    costs = {FORWARD: f, BACKWARD: b, WEIGHTS: w}
    timeline = simulate(zero_bubble(p, m), lambda t: costs[t.kind])
    assert timeline.bubble() == pytest.approx(zero_bubble_formula(p, m, f, b, w), abs=1e-12)
    if p > 1:  # a third of 1F1B's idle time when B = W = F and the backward is B + W
        whole = simulate(one_f_one_b(p, m), lambda t: f if t.kind == FORWARD else b + w)
        idle = timeline.bubble() * timeline.makespan, whole.bubble() * whole.makespan
        assert idle[0] == pytest.approx(idle[1] * (f + b - w) / (f + b + w))


def test_zero_bubble_defers_w_and_holds_what_1f1b_holds_at_most() -> None:
    schedule = zero_bubble(4, 8)
    validate(schedule)
    assert schedule.split and not one_f_one_b(4, 8).split
    assert sum(len(tasks) for tasks in schedule.order) == 3 * 4 * 8
    assert simulate(schedule).peak_in_flight() == [4] * 4  # 1F1B's peak, on every device
    for d, tasks in enumerate(schedule.order):  # device d runs W of i after B of i + d
        for i in range(8 - d):
            assert tasks.index(Task(WEIGHTS, i, d)) > tasks.index(Task(BACKWARD, i + d, d))


def test_zero_bubble_below_p_micro_batches_runs_but_misses_the_formula() -> None:
    timeline = simulate(zero_bubble(4, 2))
    assert timeline.bubble() > zero_bubble_formula(4, 2)  # the formula assumes m >= p


def test_w_before_its_b_is_a_deadlock() -> None:
    good = zero_bubble(1, 1)
    bad = dataclasses.replace(good, order=(tuple(reversed(good.order[0])),))
    with pytest.raises(ScheduleError, match=r"W0@0 waits for B0@0"):
        validate(bad)
    two = zero_bubble(2, 2)
    missing = dataclasses.replace(two, order=(two.order[0][:-1], two.order[1]))
    with pytest.raises(ScheduleError, match=r"1 tasks never run, e.g. \['W1@0'\]"):
        validate(missing)


def test_check_returns_every_row_it_verified() -> None:
    rows = check([(4, 8, 1), (4, 8, 2), (4, 2, 1)])
    names = ["GPipe", "1F1B", "ZB-H1", "interleaved 1F1B (v=2)", "ZB-V", "GPipe", "1F1B"]
    assert [row[0] for row in rows] == names  # ZB-H1's formula needs m >= p
    assert len(CHECK_COLUMNS) == len(rows[0])
    assert rows[0][1:4] == [4, 8, 1] and rows[0][4] == pytest.approx(3 / 11)
    assert [row[6] for row in rows] == [8, 4, 4, 2 * 3 + 4 + 1, 8, 2, 2]


def test_expected_peaks_are_each_schedule_s_rule() -> None:
    assert expected_peaks(gpipe(4, 8)) == [8] * 4
    assert expected_peaks(one_f_one_b(4, 8)) == [4, 3, 2, 1]
    assert expected_peaks(zero_bubble(4, 8)) == [4] * 4
    assert expected_peaks(interleaved(4, 8, 2)) == [11, 9, 7, 5]
    assert expected_bubble(interleaved(4, 8, 2)) == bubble_formula(4, 8, 2)


def test_check_fails_when_a_formula_is_wrong(monkeypatch) -> None:
    from nnxscale import schedules

    monkeypatch.setattr(schedules, "bubble_formula", lambda p, m, v=1: (p - 1) / (v * m + p))
    with pytest.raises(AssertionError, match=r"GPipe at p=4, m=8: bubble"):
        check([(4, 8, 1)])
    monkeypatch.undo()
    monkeypatch.setattr(schedules, "expected_peaks", lambda s: [s.micro_batches] * s.devices)
    with pytest.raises(AssertionError, match=r"1F1B at p=4, m=8.*peaks \[4, 3, 2, 1\]"):
        check([(4, 8, 1)])


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_zb_v_holds_two_stages_a_device_in_a_v_and_idles_a_sixth_of_1f1b(p) -> None:
    """With F, B and W equal the idle share is (p-1)/(6m+p-1), against 1F1B's (p-1)/(m+p-1)
    and ZB-H1's (p-1)/(3m+p-1); every device holds 2p half-stages, 1F1B's first device's p
    stages; formulas checked to 1e-12 from m = 2p - 1 up."""
    for m in (2 * p - 1, 2 * p, 3 * p, 8 * p):
        schedule = zero_bubble_v(p, m)
        assert [schedule.device_of(s) for s in range(2 * p)] == [*range(p), *reversed(range(p))]
        timeline = simulate(schedule)
        assert timeline.bubble() == pytest.approx(zero_bubble_v_formula(p, m), abs=1e-12)
        assert timeline.peak_in_flight() == expected_peaks(schedule) == [2 * p] * p
        assert timeline.makespan == 3 * m + (p - 1) / 2  # in stage-passes of F, B or W
    if p > 1:
        assert zero_bubble_v_formula(p, 8 * p) < zero_bubble_formula(p, 8 * p) / 1.9


@pytest.mark.parametrize("b", [1.0, 1.2, 1.5, 1.8, 2.0])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_zb_v_idles_as_zb_h1_on_twice_the_micro_batches(p, b) -> None:
    """ZB-V's chunks are half-stages: with F = W and B from one to two forwards, its idle
    share is ZB-H1's at 2m. Outside that range this order idles longer than the formula
    (B = 3F, or W = F/2: its cool-down waits)."""
    costs = {FORWARD: 0.5, BACKWARD: b / 2, WEIGHTS: 0.5}
    for m in (2 * p - 1, 2 * p, 3 * p + 1, 8 * p):
        timeline = simulate(zero_bubble_v(p, m), lambda t: costs[t.kind])
        expected = zero_bubble_v_formula(p, m, 1.0, b, 1.0)
        assert timeline.bubble() == pytest.approx(expected, abs=1e-12)
        assert expected == zero_bubble_formula(p, 2 * m, 1.0, b, 1.0)
    if p > 1:
        wide = simulate(zero_bubble_v(p, 4 * p), lambda t: 0.5 * (3.0 if t.kind == BACKWARD else 1))
        assert wide.bubble() > zero_bubble_v_formula(p, 4 * p, 1.0, 3.0, 1.0)


def test_zb_v_turns_on_the_last_device_and_ends_on_the_first() -> None:
    schedule = zero_bubble_v(4, 8)
    assert schedule.order[0][0] == Task(FORWARD, 0, 0)  # chunk 0 of device 0: stage 0
    assert Task(FORWARD, 0, 7) in schedule.order[0]  # and the last stage, where the loss is
    assert Task(FORWARD, 0, 4) in schedule.order[3]  # the turn: stages 3 and 4 on device 3
    assert schedule.split and schedule.virtual == 2 and schedule.stages == 8


def test_zb_v_needs_its_v_filled() -> None:
    with pytest.raises(ScheduleError, match=r"ZB-V fills its V of 8 stages.*use m >= 7"):
        zero_bubble_v(4, 6)
    with pytest.raises(ScheduleError, match="at least 1"):
        zero_bubble_v(0, 4)
