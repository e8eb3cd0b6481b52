"""Pipeline schedules: closed forms from the papers, true dependencies, orders, in-flight counts."""
from __future__ import annotations

import math
import random
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from costmodel.pipeline import PipeSchedule, in_flight_microbatches, step_time_s, transfer_lines
from costmodel.pipeline_sim import EventKind, priced_step_s, simulate
from planner.config import Schedule

SCHEDULES = list(PipeSchedule)


def test_schedule_values_match_the_planner_enum():
    # The planner maps its Schedule to PipeSchedule by value.
    assert {s.value for s in PipeSchedule} == {s.value for s in Schedule}


@pytest.mark.parametrize("schedule", [PipeSchedule.GPIPE, PipeSchedule.ONE_F_ONE_B])
@pytest.mark.parametrize("pp,m", [(1, 1), (1, 5), (2, 1), (4, 1), (4, 3), (4, 8), (8, 32)])
def test_gpipe_and_1f1b_take_m_plus_p_minus_1_slots(schedule, pp, m):
    # Huang et al. 2019 / Narayanan et al. 2021: equal stages finish in (m + p - 1)(f + b).
    f, b = 1.0, 2.0
    expected = (m + pp - 1) * (f + b)
    result = simulate(schedule, [f] * pp, [b] * pp, m)
    assert result.step_time_s == pytest.approx(expected)
    assert step_time_s(schedule, [f] * pp, [b] * pp, m) == pytest.approx(expected)
    # Bubble fraction: idle (p-1)(f+b) of (m+p-1)(f+b) per device.
    assert result.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1))
    assert result.busy_s == tuple([m * (f + b)] * pp)


@pytest.mark.parametrize("pp,m,vpp", [(2, 2, 2), (4, 8, 3), (4, 16, 2), (8, 8, 4), (8, 64, 2)])
def test_interleaved_bubble_is_p_minus_1_over_v(pp, m, vpp):
    # Narayanan et al. 2021 §2.2: the bubble shrinks to (p-1)/v micro-batches: (m + (p-1)/v)(f + b).
    f, b = 1.0, 2.0
    expected = (m + (pp - 1) / vpp) * (f + b)
    assert simulate("interleaved", [f] * pp, [b] * pp, m, vpp=vpp).step_time_s == pytest.approx(expected)
    assert step_time_s("interleaved", [f] * pp, [b] * pp, m, vpp=vpp) == pytest.approx(expected)


@pytest.mark.parametrize("pp,m", [(2, 2), (4, 4), (4, 12), (8, 24)])
def test_zero_bubble_h1_cuts_the_1f1b_bubble_to_a_third(pp, m):
    # Qi et al. 2023 §3.1 with T_F = T_B = T_W: ZB-H1's bubble (p-1)(T_F + T_B - T_W) = (p-1) T_F is a
    # third of 1F1B's (p-1)(T_F + T_B + T_W). Here f = 1 and b = 2 split evenly into B = W = 1.
    f, b = 1.0, 2.0
    zb = simulate("zb", [f] * pp, [b] * pp, m, bwd_weight_fraction=0.5)
    one_f_one_b = simulate("1f1b", [f] * pp, [b] * pp, m)
    assert zb.step_time_s == pytest.approx(m * (f + b) + (pp - 1) * 1.0)
    assert zb.step_time_s - m * (f + b) == pytest.approx((one_f_one_b.step_time_s - m * (f + b)) / 3)
    assert step_time_s("zb", [f] * pp, [b] * pp, m) == pytest.approx(zb.step_time_s)


@pytest.mark.parametrize(
    "f,b,weight_fraction",
    [(1.0, 2.0, 0.3), (1.0, 2.0, 0.7), (2.0, 1.0, 0.5), (0.5, 4.0, 0.6), (1.0, 1.0, 0.0), (1.0, 1.0, 1.0)],
)
def test_zero_bubble_h1_bubble_for_any_split(f, b, weight_fraction):
    # For m >= p the idle time per stage is (p-1) max(f + b_in - w, f, b_in): the Qi et al. form while
    # W fits the bubbles (w <= min(f, b_in)), else the wait for the first B (b_in) or for the forward
    # wave (f). Case (1, 2, 0.3): b_in = 1.4, w = 0.6 -> max(1.8, 1, 1.4) = 1.8.
    pp, m = 4, 12
    b_in, w = b * (1 - weight_fraction), b * weight_fraction
    expected = m * (f + b) + (pp - 1) * max(f + b_in - w, f, b_in)
    args = ("zb", [f] * pp, [b] * pp, m)
    assert simulate(*args, bwd_weight_fraction=weight_fraction).step_time_s == pytest.approx(expected)
    assert step_time_s(*args, bwd_weight_fraction=weight_fraction) == pytest.approx(expected)


@pytest.mark.parametrize("pp,m", [(2, 2), (4, 4), (4, 5), (4, 9), (3, 12), (8, 20)])
def test_1f1b_with_p2p_waits_one_round_trip_per_p_microbatches(pp, m):
    # Each of the 2(p-1) fill/drain transfers is on the critical path, and in the steady state a
    # round trip of p micro-batches carries 2(p-1) transfers for p micro-batches of work: hand count
    # 2(p-1) + 2 floor((m-1)(p-1)/p). E.g. p=4, m=9: 6 + 2 * 6 = 18 transfers.
    f, b, c = 1.0, 2.0, 0.25
    transfers = 2 * (pp - 1) + 2 * ((m - 1) * (pp - 1) // pp)
    expected = (m + pp - 1) * (f + b) + transfers * c
    assert simulate("1f1b", [f] * pp, [b] * pp, m, p2p_s=c).step_time_s == pytest.approx(expected)
    assert step_time_s("1f1b", [f] * pp, [b] * pp, m, p2p_s=c) == pytest.approx(expected)


def test_gpipe_is_exact_for_unequal_stages_and_p2p():
    # Flow shop of identical jobs: sum(f) + (m-1) max(f) + sum(b) + (m-1) max(b) + 2 (p-1) c.
    fwd, bwd, m, c = [1.0, 3.0, 2.0], [2.0, 1.0, 5.0], 6, 0.5
    expected = 6.0 + 5 * 3.0 + 8.0 + 5 * 5.0 + 2 * 2 * c
    assert simulate("gpipe", fwd, bwd, m, p2p_s=c).step_time_s == pytest.approx(expected)
    assert step_time_s("gpipe", fwd, bwd, m, p2p_s=c) == pytest.approx(expected)


@st.composite
def equal_stage_cases(draw):
    schedule = draw(st.sampled_from(SCHEDULES))
    pp = draw(st.integers(1, 8))
    vpp = draw(st.integers(1, 4)) if schedule == PipeSchedule.INTERLEAVED else 1
    m = pp * draw(st.integers(1, 6)) if schedule == PipeSchedule.INTERLEAVED else draw(st.integers(1, 5 * pp))
    f = draw(st.floats(0.1, 3.0))
    b = draw(st.floats(0.1, 3.0))
    weight_fraction = draw(st.floats(0.0, 1.0))
    return schedule, pp, m, vpp, f, b, weight_fraction


@given(equal_stage_cases())
def test_closed_form_equals_simulation_for_equal_stages_without_p2p(case):
    schedule, pp, m, vpp, f, b, weight_fraction = case
    args = (schedule, [f] * pp, [b] * pp, m, vpp, 0.0, weight_fraction)
    assert step_time_s(*args) == pytest.approx(simulate(*args).step_time_s, rel=1e-9)


@given(equal_stage_cases(), st.floats(0.0, 1.0))
def test_closed_form_equals_simulation_with_p2p_inside_the_slack(case, p2p_share):
    # GPipe, 1F1B and interleaved while p2p <= min(f, b) / vpp (step_time_s docstring): no
    # transfer waits for the one before it on its link.
    schedule, pp, m, vpp, f, b, weight_fraction = case
    if schedule == PipeSchedule.ZERO_BUBBLE:
        return
    args = (schedule, [f] * pp, [b] * pp, m, vpp, p2p_share * min(f, b) / vpp, weight_fraction)
    assert step_time_s(*args) == pytest.approx(simulate(*args).step_time_s, rel=1e-9)


def test_a_slow_link_carries_one_transfer_at_a_time():
    # GPipe, 2 stages, 2 micro-batches, f = b = 1, transfers of 3 s. By hand: F0 on device 0 at
    # [0, 1], F1 at [1, 2]; over the link F0 arrives at 4, F1 queues behind it and arrives at 7.
    # Device 1: F0 [4, 5], F1 [7, 8], B0 [8, 9] (arrives 12), B1 [9, 10] (queued: arrives 15).
    # Device 0: B0 [12, 13], B1 [15, 16]: 16 s, not the 12 s of transfers that overlap on a link.
    args = ("gpipe", [1.0, 1.0], [1.0, 1.0], 2, 1, 3.0)
    assert simulate(*args).step_time_s == pytest.approx(16.0)
    assert step_time_s(*args) == pytest.approx(16.0)


@pytest.mark.parametrize("schedule, vpp", [("zb", 1), ("interleaved", 2), ("1f1b", 1), ("gpipe", 1)])
def test_estimates_price_the_simulation_once_transfers_outgrow_the_closed_form(schedule, vpp):
    # Up to a quarter of the shortest op per transfer the closed form holds (within 4.8%); beyond it
    # the schedule's round trips wait on the transfers, which only the simulation follows: zero
    # bubble on 8 stages with transfers of 1.5 forwards runs far slower than its fill and drain.
    fwd, bwd, m = [1.0, 1.1, 0.9, 1.0] * 2, [2.0, 2.2, 1.8, 2.0] * 2, 16
    for hop_s, simulated in ((0.05, False), (1.5, True)):
        args = (schedule, fwd, bwd, m, vpp, hop_s)
        expected = simulate(*args).step_time_s if simulated else step_time_s(*args)
        assert priced_step_s(*args) == expected
    zb = ("zb", fwd, bwd, m, 1, 1.5)
    assert priced_step_s(*zb) > 1.3 * step_time_s(*zb)


def test_slower_links_never_price_a_step_faster():
    # 1F1B, stages f = (2, 1), b = (4, 2), 4 micro-batches. The closed form charges the slow stage
    # 2(p-1) + 2 floor((m-1)(p-1)/p) = 4 transfers: 24 + 4h = 26 at h = 0.25, the edge of its range
    # (a quarter of the shortest op, 1). By hand the simulation ends at 25 + 2h = 25.5: stage 0
    # waits on the first round trip only. Just beyond the edge the price stays at the closed form's
    # 26 until the simulation passes it (at h = 0.5), so it never drops as the link slows.
    args = ("1f1b", [2.0, 1.0], [4.0, 2.0], 4)
    assert simulate(*args, 1, 0.25).step_time_s == pytest.approx(25.5)
    prices = [priced_step_s(*args, 1, hop_s) for hop_s in (0.2, 0.25, 0.250025, 0.4, 0.5, 0.75, 1.0)]
    assert prices == sorted(prices) and prices[2] == pytest.approx(26.0)
    assert prices[-1] == pytest.approx(simulate(*args, 1, 1.0).step_time_s)


@given(fwd=st.lists(st.floats(0.5, 2.0), min_size=2, max_size=6), m=st.integers(1, 12),
       schedule=st.sampled_from(["1f1b", "gpipe", "zb"]))
def test_the_priced_step_is_monotone_in_the_transfer_time(fwd, m, schedule):
    bwd = [2 * f for f in fwd]
    prices = [priced_step_s(schedule, fwd, bwd, m, 1, 0.05 * k) for k in range(40)]
    assert all(later >= earlier - 1e-9 for earlier, later in zip(prices, prices[1:]))


@pytest.mark.parametrize("schedule, vpp", [("zb", 1), ("interleaved", 2), ("1f1b", 1), ("gpipe", 1)])
def test_no_schedule_beats_its_links_throughput(schedule, vpp):
    # 8 stages of 0.01 s per micro-batch, 64 micro-batches, 0.9 s per transfer (activations over a
    # 25 GbE NIC): device 0 receives 64 vpp gradients over one link, so no step is under 64 vpp x 0.9 s.
    pp, m, c = 8, 64, 0.9
    args = (schedule, [0.01] * pp, [0.02] * pp, m, vpp, c)
    simulated = simulate(*args).step_time_s
    assert m * vpp * c <= step_time_s(*args) <= simulated * (1 + 1e-9)


def test_zero_bubble_with_small_p2p_stays_close():
    # step_time_s counts only the 2(p-1) fill/drain transfers for ZB-H1; its docstring promises 2.5%
    # for equal stages while p2p_s is under a tenth of min(f, b_in, w).
    rng = random.Random(3)
    for _ in range(300):
        pp, weight_fraction = rng.choice([2, 3, 4, 6, 8]), rng.uniform(0.2, 0.8)
        m = rng.randint(1, 5 * pp)
        f, b = rng.uniform(0.2, 3.0), rng.uniform(0.2, 3.0)
        p2p_s = rng.uniform(0.0, 0.1) * min(f, b * (1 - weight_fraction), b * weight_fraction)
        args = ("zb", [f] * pp, [b] * pp, m, 1, p2p_s, weight_fraction)
        simulated = simulate(*args).step_time_s
        assert abs(step_time_s(*args) - simulated) <= 0.025 * simulated


@st.composite
def unequal_stage_cases(draw):
    schedule = draw(st.sampled_from(SCHEDULES))
    pp = draw(st.integers(1, 6))
    vpp = draw(st.integers(1, 3)) if schedule == PipeSchedule.INTERLEAVED else 1
    m = pp * draw(st.integers(1, 4)) if schedule == PipeSchedule.INTERLEAVED else draw(st.integers(1, 4 * pp))
    fwd = draw(st.lists(st.floats(0.05, 5.0), min_size=pp, max_size=pp))
    bwd = draw(st.lists(st.floats(0.05, 5.0), min_size=pp, max_size=pp))
    return schedule, fwd, bwd, m, vpp, draw(st.floats(0.0, 1.0))


@given(unequal_stage_cases())
def test_closed_form_never_exceeds_the_simulation_without_p2p(case):
    # Every path family in the closed form is a real path of the event graph: a lower bound.
    schedule, fwd, bwd, m, vpp, weight_fraction = case
    args = (schedule, fwd, bwd, m, vpp, 0.0, weight_fraction)
    assert step_time_s(*args) <= simulate(*args).step_time_s * (1 + 1e-9)


@given(unequal_stage_cases(), st.floats(0.0, 20.0))
def test_every_transfer_line_is_below_the_simulation(case, p2p_share):
    # Each line of the envelope is a real path through the event graph and its links.
    schedule, fwd, bwd, m, vpp, weight_fraction = case
    p2p_s = p2p_share * min(fwd + bwd)
    simulated = simulate(schedule, fwd, bwd, m, vpp, p2p_s, weight_fraction).step_time_s
    for intercept, path, queued in transfer_lines(schedule, fwd, bwd, m, vpp, weight_fraction)[1:]:
        assert intercept + (path + queued) * p2p_s <= simulated * (1 + 1e-9)


@pytest.mark.parametrize(
    "schedule,max_gap", [("1f1b", 0.01), ("zb", 0.01), ("interleaved", 0.06), ("gpipe", 1e-9)]
)
def test_closed_form_is_tight_for_stages_within_25_percent(schedule, max_gap):
    # The stage split balances stages; on such pipelines the closed form stays within the gaps
    # measured when it was written (1F1B 0.3%, ZB-H1 0.6%, interleaved 5.5%).
    rng = random.Random(2)
    for _ in range(150):
        pp = rng.choice([2, 4, 8, 16])
        vpp = rng.choice([2, 3, 4]) if schedule == "interleaved" else 1
        m = pp * rng.randint(1, 8) if schedule == "interleaved" else rng.randint(pp, 8 * pp)
        base = rng.uniform(0.5, 2.0)
        fwd = [base * rng.uniform(0.75, 1.25) for _ in range(pp)]
        bwd = [2 * f * rng.uniform(0.95, 1.05) for f in fwd]
        weight_fraction = rng.uniform(0.3, 0.6)
        args = (schedule, fwd, bwd, m, vpp, 0.0, weight_fraction)
        simulated = simulate(*args).step_time_s
        assert abs(step_time_s(*args) - simulated) <= max_gap * simulated


@given(unequal_stage_cases(), st.floats(0.0, 0.5))
def test_simulation_respects_every_dependency(case, p2p_s):
    schedule, fwd, bwd, m, vpp, weight_fraction = case
    pp = len(fwd)
    result = simulate(schedule, fwd, bwd, m, vpp, p2p_s, weight_fraction)
    hop = p2p_s if pp > 1 else 0.0
    by_key = {(e.kind, e.microbatch, e.chunk * pp + e.device): e for e in result.events}
    last_stage = vpp * pp - 1
    split = weight_fraction if schedule == PipeSchedule.ZERO_BUBBLE else 0.0
    for (kind, mb, stage), event in by_key.items():
        device = stage % pp
        if kind == EventKind.FORWARD:
            assert event.end_s - event.start_s == pytest.approx(fwd[device] / vpp)
            if stage > 0:
                assert event.start_s >= by_key[(kind, mb, stage - 1)].end_s + hop - 1e-9
        elif kind == EventKind.BACKWARD:
            assert event.end_s - event.start_s == pytest.approx(bwd[device] * (1 - split) / vpp)
            assert event.start_s >= by_key[(EventKind.FORWARD, mb, stage)].end_s - 1e-9
            if stage < last_stage:
                assert event.start_s >= by_key[(kind, mb, stage + 1)].end_s + hop - 1e-9
        else:
            assert event.start_s >= by_key[(EventKind.BACKWARD, mb, stage)].end_s - 1e-9
    ops_per_microbatch = 3 if schedule == PipeSchedule.ZERO_BUBBLE else 2
    assert len(by_key) == len(result.events) == ops_per_microbatch * m * vpp * pp
    for device in range(pp):
        timeline = [e for e in result.events if e.device == device]
        assert all(a.end_s <= b.start_s + 1e-9 for a, b in zip(timeline, timeline[1:]))
    assert result.step_time_s == max(e.end_s for e in result.events)


@given(unequal_stage_cases(), st.floats(0.0, 0.5))
def test_every_op_starts_as_soon_as_its_device_and_its_input_allow(case, p2p_s):
    # Replayed from the events alone: a device's results leave one at a time, in the order it made
    # them, and arrive a hop later (its link's queue); each op then starts exactly at the later of
    # its device's previous end and its input's arrival, with the same floating-point operations.
    schedule, fwd, bwd, m, vpp, weight_fraction = case
    pp = len(fwd)
    hop = p2p_s if pp > 1 else 0.0
    result = simulate(schedule, fwd, bwd, m, vpp, p2p_s, weight_fraction)
    last_stage = vpp * pp - 1
    arrival = {}
    for device in range(pp):
        link_free = 0.0
        for event in (e for e in result.events if e.device == device):
            stage = event.chunk * pp + device
            sends = (event.kind == EventKind.FORWARD and stage < last_stage) or (event.kind == EventKind.BACKWARD and stage > 0)
            if sends:
                link_free = max(event.end_s, link_free) + hop
            arrival[(event.kind, event.microbatch, stage)] = link_free if sends else event.end_s
    for device in range(pp):
        previous_end = 0.0
        for event in (e for e in result.events if e.device == device):
            stage = event.chunk * pp + device
            ready = 0.0
            if event.kind == EventKind.FORWARD and stage > 0:
                ready = arrival[(EventKind.FORWARD, event.microbatch, stage - 1)]
            elif event.kind == EventKind.BACKWARD and stage < last_stage:
                ready = arrival[(EventKind.BACKWARD, event.microbatch, stage + 1)]
            assert event.start_s == max(previous_end, ready)
            previous_end = event.end_s


def _order(result, device):
    """Device's ops as text: "F3" is micro-batch 3's forward, "B0.1" micro-batch 0's backward of chunk 1."""
    ops = (f"{e.kind}{e.microbatch}" + (f".{e.chunk}" if e.chunk else "") for e in result.events if e.device == device)
    return " ".join(ops)


def test_device_orders_follow_megatron_and_torch():
    # 1F1B, p=4: stage 0 warms up with p-1 = 3 forwards, the last stage alternates at once.
    one_f_one_b = simulate("1f1b", [1.0] * 4, [2.0] * 4, 6)
    assert _order(one_f_one_b, 0) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5"
    assert _order(one_f_one_b, 3) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"
    # Interleaved, p=2, v=2, m=4: groups of p micro-batches per chunk; device 0 warms up with
    # 2(p-1) + (v-1)p = 4 chunk forwards, device 1 with 2.
    interleaved = simulate("interleaved", [1.0] * 2, [2.0] * 2, 4, vpp=2)
    assert _order(interleaved, 0) == "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3"
    assert _order(interleaved, 1) == "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3"
    # ZB-H1, p=3: device d follows its t-th B with a W once t >= d and runs the d deferred W's last.
    zero_bubble = simulate("zb", [1.0] * 3, [2.0] * 3, 4)
    assert _order(zero_bubble, 0) == "F0 F1 F2 B0 W0 F3 B1 W1 B2 W2 B3 W3"
    assert _order(zero_bubble, 2) == "F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3"


@pytest.mark.parametrize("pp", [1, 2, 4, 8])
@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_in_flight_closed_forms(pp, m):
    for stage in range(pp):
        assert in_flight_microbatches("gpipe", pp, stage, m) == m
        assert in_flight_microbatches("1f1b", pp, stage, m) == min(pp - stage, m)
        assert in_flight_microbatches("zb", pp, stage, m) == min(pp, m)


@pytest.mark.parametrize("pp,vpp", [(2, 2), (4, 2), (8, 3), (35, 3)])
def test_interleaving_multiplies_first_stage_activations_by_korthikanti_factor(pp, vpp):
    # Korthikanti et al. 2022 §4.2.3: interleaving scales stage-0 activation memory by
    # 1 + (p-1)/(p v) over 1F1B's p micro-batches.
    m = 4 * pp
    assert in_flight_microbatches("interleaved", pp, 0, m, vpp) == pytest.approx(pp * (1 + (pp - 1) / (pp * vpp)))


@given(equal_stage_cases())
def test_in_flight_matches_the_peak_counted_on_the_timeline(case):
    # Oracle: walk each device's events; F adds one chunk's activations, B (W under zero bubble) frees them.
    schedule, pp, m, vpp, f, b, weight_fraction = case
    result = simulate(schedule, [f] * pp, [b] * pp, m, vpp, 0.0, weight_fraction)
    frees = EventKind.WEIGHT if schedule == PipeSchedule.ZERO_BUBBLE else EventKind.BACKWARD
    for device in range(pp):
        alive = peak = 0
        for event in (e for e in result.events if e.device == device):
            alive += (event.kind == EventKind.FORWARD) - (event.kind == frees)
            peak = max(peak, alive)
        assert in_flight_microbatches(schedule, pp, device, m, vpp) == pytest.approx(peak / vpp)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: simulate("interleaved", [1.0] * 4, [2.0] * 4, 6, vpp=2), "multiple of pp=4"),
        (lambda: step_time_s("1f1b", [1.0] * 4, [2.0] * 4, 8, vpp=2), "schedule=interleaved"),
        (lambda: simulate("pipedream", [1.0], [2.0], 1), "use one of"),
        (lambda: step_time_s("gpipe", [1.0, 1.0], [2.0], 4), "one time per stage"),
        (lambda: simulate("gpipe", [1.0], [-2.0], 4), "non-negative"),
        (lambda: simulate("zb", [1.0], [2.0], 4, bwd_weight_fraction=1.5), "bwd_weight_fraction"),
        (lambda: step_time_s("1f1b", [1.0], [2.0], 0), "num_microbatches"),
        (lambda: in_flight_microbatches("1f1b", 4, 4, 8), "stage=4"),
    ],
)
def test_bad_arguments_name_the_field(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_simulation_scales_to_large_pipelines():
    # pp=64, m=1000 is 128,000 ops; measured 0.4 s of CPU on the 2-core dev machine.
    fwd, bwd = [1.0 + 0.01 * d for d in range(64)], [2.0] * 64
    started = time.process_time()
    result = simulate("1f1b", fwd, bwd, 1000, p2p_s=0.01)
    assert time.process_time() - started < 2.0
    assert len(result.events) == 2 * 64 * 1000
    started = time.process_time()
    for _ in range(100):
        step_time_s("interleaved", fwd[:8], bwd[:8], 64, vpp=2, p2p_s=0.01)
    # Measured about 50 us per call on the same machine.
    assert (time.process_time() - started) / 100 < 1e-3
    assert math.isfinite(result.step_time_s)
