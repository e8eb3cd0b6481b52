"""Pipeline schedules (GPipe, 1F1B, interleaved 1F1B, zero bubble ZB-H1) in closed form.

`step_time_s` and `in_flight_microbatches` price a schedule in O(pp), for use inside the search;
`costmodel.pipeline_sim.simulate` runs the same model event by event, with true dependencies.

Model of one training step of one pipeline (every data-parallel replica runs the same timeline):

- Device `d` (0-based) holds pipeline stage `d`. `fwd_s[d]` / `bwd_s[d]` are the seconds of one
  micro-batch's forward / backward on that device; `bwd_s` includes the weight gradient.
- Interleaved (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", §2.2): device `d` holds `vpp` model chunks; chunk `c` is virtual
  stage `c * pp + d` of `vpp * pp`. The caller passes the device's total over its chunks and each
  chunk takes `1/vpp` of it (the layers are split evenly over the chunks).
- Zero bubble (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", ZB-H1): the backward splits into
  B, the input gradient (`(1 - bwd_weight_fraction) * bwd_s[d]`), and W, the weight gradient
  (`bwd_weight_fraction * bwd_s[d]`). W has no consumer on another device and fills bubbles.
- Dependencies: F of micro-batch j on virtual stage s needs F of j on s-1; B of j on s needs B of j
  on s+1 (and F of j on s, earlier on the same device); W needs B (earlier, same device). A
  dependency between two devices adds `p2p_s`. Transfers are asynchronous: they delay the consumer
  and occupy neither device's compute stream. A device sends one transfer at a time, to either
  neighbour, in the order it produced them (they leave through one NIC or NVLink port).
- Each device runs its ops in the schedule's fixed order, each as early as its dependencies and the
  previous op on the device allow. The step time is when the last op ends.

Per-device orders (the ones `torch.distributed.pipelining` and Megatron-LM run):

- GPipe (Huang et al. 2019): all forwards, then all backwards, micro-batches in order.
- 1F1B (Narayanan et al. 2021, PipeDream-Flush; Megatron order): `min(pp - d - 1, m)` warm-up
  forwards, then one forward and one backward in turn, then the remaining backwards.
- Interleaved 1F1B (Megatron-Core `forward_backward_pipelining_with_interleaving`, torch
  `ScheduleInterleaved1F1B`): forwards go in groups of `pp` micro-batches per chunk, chunk 0 first;
  backwards likewise with the chunks reversed; `2 (pp - d - 1) + (vpp - 1) pp` warm-up chunk
  forwards (at most `m vpp`), then 1F1B. Needs `m % pp == 0`.
- ZB-H1 (Qi et al. 2023 §3.1; torch `_get_1f1b_rank_ops(enable_zero_bubble=True)`): the 1F1B order
  with B for the backward; device d follows its t-th B with the W of its oldest pending micro-batch
  when `t >= d`, and runs the `d` W's it deferred at the end.
"""
from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum


class PipeSchedule(StrEnum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZERO_BUBBLE = "zb"


def step_time_s(
    schedule: PipeSchedule | str,
    fwd_s: Sequence[float],
    bwd_s: Sequence[float],
    num_microbatches: int,
    vpp: int = 1,
    p2p_s: float | Sequence[float] = 0.0,
    bwd_weight_fraction: float = 0.5,
) -> float:
    """Step time without events, in O(pp) (tens of microseconds), for use inside the search.

    Compute part:

    - GPipe: `sum(f) + (m-1) max(f) + sum(b) + (m-1) max(b)`, exact for any stages: each phase is a
      flow shop of identical jobs whose longest path runs all `m` on its slowest stage.
    - Other schedules: the longest of a few path families through the event graph
      (`_compute_bound_s`). Each is a real path, so with `p2p_s = 0` the result never exceeds the
      simulated step; for equal stages `f, b` it is exact: 1F1B `(m + p - 1)(f + b)`; interleaved
      `(m + (p-1)/vpp)(f + b)`, the Narayanan et al. 2021 bubble of `(p-1)/vpp` micro-batches; ZB-H1
      `m (f + b) + (p-1) max(f + b_in - w, f, b_in)` for `m >= p` (`b_in`, `w`: the B and W parts of
      `b`), which is the Qi et al. 2023 bubble `(p-1)(f + b_in - w)` while `w <= min(f, b_in)`.
      With unequal stages it can miss paths that dwell on several devices: on random instances
      with stage times within +-25% the gap was at most 0.3% (1F1B), 0.6% (ZB-H1) and 5.5%
      (interleaved; median 0.25%), and up to 16% when stage times differ 15-fold.

    Transfer part: `p2p_s` times the transfers on the critical path of an equal-stage pipeline:
    GPipe `2 (p-1)`; 1F1B `2 (p-1) + 2 floor((m-1)(p-1)/p)` (each run of `p` micro-batches waits
    one extra round trip in the steady state); interleaved `2 (vpp p - 1)`; ZB-H1 `2 (p-1)` (fill
    and drain only); or, where more, what the links carry one transfer at a time
    (`transfer_lines`). Exact for equal stages for GPipe, 1F1B and interleaved while
    `p2p_s <= min(f, b) / vpp`; ZB-H1 within 2.5% while `p2p_s` is under a tenth of
    `min(f, b_in, w)`. Beyond that the transfers outgrow the schedule's slack and the result is
    a lower bound (on random equal-stage pipelines at 10 x that `p2p_s`: 1F1B 10%, GPipe 20%,
    interleaved 32%, ZB-H1 47% under the simulation); use `pipeline_sim.simulate`.

    Args:
        schedule: which schedule.
        fwd_s: seconds of one micro-batch forward on each stage (the device's total over its chunks).
        bwd_s: seconds of one micro-batch backward on each stage, weight gradient included.
        num_microbatches: micro-batches per step (`m`).
        vpp: model chunks per device (interleaved only).
        p2p_s: seconds from an op's end to the earliest start of its consumer on another device;
            or one per device, for its transfers to and from the next (`hop_times`). The path
            transfers of `transfer_lines` are then priced at the mean over the boundaries the
            schedule crosses, the transfers one link carries one after another at the slowest.
        bwd_weight_fraction: share of `bwd_s` that is the weight gradient (zero bubble only).

    Returns:
        The predicted step time in seconds.

    Raises:
        ValueError: on inconsistent or out-of-range arguments (the message names the field).

    Example::

        >>> step_time_s("interleaved", [1.0] * 4, [2.0] * 4, num_microbatches=8, vpp=3)
        27.0
    """
    schedule = check_args(schedule, fwd_s, bwd_s, num_microbatches, vpp, p2p_s, bwd_weight_fraction)
    crossed = hop_times(p2p_s, len(fwd_s))
    if schedule != PipeSchedule.INTERLEAVED:
        crossed = crossed[:-1]  # only an interleaved schedule sends from the last device to the first
    mean_s, slowest_s = (sum(crossed) / len(crossed), max(crossed)) if crossed else (0.0, 0.0)
    return max(intercept + path * mean_s + queued * slowest_s
               for intercept, path, queued in transfer_lines(schedule, fwd_s, bwd_s, num_microbatches, vpp, bwd_weight_fraction))


def hop_times(p2p_s: float | Sequence[float], pp: int) -> tuple[float, ...]:
    """One transfer time per device `d`, for its transfers to and from device `d + 1` (the last
    device's: to and from the first, the wrap of an interleaved schedule), from one time for all
    or one per device."""
    if isinstance(p2p_s, (int, float)):
        return (float(p2p_s),) * pp
    return tuple(float(hop) for hop in p2p_s)


def transfer_lines(
    schedule: PipeSchedule | str,
    fwd_s: Sequence[float],
    bwd_s: Sequence[float],
    num_microbatches: int,
    vpp: int = 1,
    bwd_weight_fraction: float = 0.5,
) -> tuple[tuple[float, float, float], ...]:
    """`step_time_s` as the upper envelope of planes in the transfer times: (seconds without
    transfers, transfers along a path through the pipeline, transfers queued on one link).

    - The schedule's critical path: its compute part plus its critical transfers (`step_time_s`).
    - The link: a device sends one transfer at a time, and device 0 receives `m vpp` gradients
      from device 1 (a backward chunk per micro-batch and chunk). The
      first arrives no sooner than a micro-batch's forward through every virtual stage and its
      backward through the last chunk (`pp vpp - 1 + pp - 1` transfers), the others one transfer
      apart, and the last one's backward (and, under zero bubble, its weight gradient) ends the
      step on device 0: `sum(f) + sum(b_in) / vpp + w_0 + (pp vpp + pp - 2 + m vpp - 1) p2p_s`.
      Under GPipe the gradients set out only after the last stage's `m` forwards, which crossed
      each link one at a time: `sum(f) + sum(b) + (2 (pp - 1) + 2 (m - 1)) p2p_s`.
      These take over once a transfer outlasts a micro-batch's compute on a device (slow NICs,
      large activations), where the first line's count, of fill and drain only for zero bubble
      and interleaved, falls short; they remain lower bounds there (`pipeline_sim.priced_step_s`).
    """
    schedule = check_args(schedule, fwd_s, bwd_s, num_microbatches, vpp, 0.0, bwd_weight_fraction)
    pp, m = len(fwd_s), num_microbatches
    if schedule == PipeSchedule.GPIPE:
        compute = sum(fwd_s) + (m - 1) * max(fwd_s) + sum(bwd_s) + (m - 1) * max(bwd_s)
    else:
        split = bwd_weight_fraction if schedule == PipeSchedule.ZERO_BUBBLE else 0.0
        compute = _compute_bound_s(schedule, fwd_s, bwd_s, m, vpp, split)
    critical = (compute, float(critical_transfers(schedule, pp, m, vpp)), 0.0)
    if pp == 1:
        return (critical,)
    split = bwd_weight_fraction if schedule == PipeSchedule.ZERO_BUBBLE else 0.0
    round_trip_s = sum(fwd_s) + (1.0 - split) * sum(bwd_s) / vpp + split * bwd_s[0]
    lines = (critical, (round_trip_s, float(pp * vpp + pp - 2), float(m * vpp - 1)))
    if schedule == PipeSchedule.GPIPE:  # the gradients set out once the last stage has every forward
        lines += ((sum(fwd_s) + sum(bwd_s), float(2 * (pp - 1)), float(2 * (m - 1))),)
    return lines


def in_flight_microbatches(
    schedule: PipeSchedule | str, pp: int, stage: int, num_microbatches: int, vpp: int = 1
) -> float:
    """Activations alive at the peak on one device, in micro-batches of that device's layers.

    One unit is the activation memory of one micro-batch through all of the device's layers (all
    its chunks). Counted on the per-device order: an F adds one chunk's activations (`1/vpp`), a B
    (a W under zero bubble) frees them.

    - GPipe: `m` (every forward runs before the first backward).
    - 1F1B: `min(pp - stage, m)` (warm-up `pp - stage - 1`, plus the steady-state forward).
    - Interleaved: `min(2 (pp - stage - 1) + (vpp - 1) pp + 1, m vpp) / vpp`. On stage 0 that is
      `pp (1 + (pp - 1) / (pp vpp))`: 1F1B's `pp` times the Korthikanti et al. 2022 §4.2.3 factor
      `1 + (p-1)/(p m)` (their `m` is our `vpp`).
    - ZB-H1: `min(pp, m)` on every stage. Qi et al. 2023 (Table 1) give ZB-H1 1F1B's peak, `p`
      micro-batches, reached on stage 0; later stages reach it too because stage d defers d W's.
      Counting a micro-batch until its W is conservative: after B only the inputs the weight
      gradient needs stay alive.

    Args:
        schedule: which schedule.
        pp: pipeline stages (devices).
        stage: the device (0-based).
        num_microbatches: micro-batches per step (`m`).
        vpp: model chunks per device (interleaved only).

    Returns:
        The peak count; fractional for interleaved.

    Raises:
        ValueError: on out-of-range arguments.

    Example::

        >>> in_flight_microbatches("interleaved", pp=4, stage=0, num_microbatches=8, vpp=2)
        5.5
    """
    schedule = _check_schedule(schedule, vpp)
    _check_positive("pp", pp)
    _check_positive("num_microbatches", num_microbatches)
    if not 0 <= stage < pp:
        raise ValueError(f"stage={stage}: must be in [0, pp={pp})")
    m = num_microbatches
    if schedule == PipeSchedule.GPIPE:
        return float(m)
    if schedule == PipeSchedule.ZERO_BUBBLE:
        return float(min(pp, m))
    return min(warmup_forwards(schedule, pp, stage, m, vpp) + 1, m * vpp) / vpp


def _compute_bound_s(
    schedule: PipeSchedule, fwd_s: Sequence[float], bwd_s: Sequence[float], m: int, vpp: int, split: float
) -> float:
    """Longest of three path families through the event graph, transfers left out.

    Every family is a real path (each op on it starts no earlier than its predecessor ends), so the
    result never exceeds the simulated step; for equal stages one of them is the critical path.

    - Device work: the first forward reaches device d, which then runs its ops back to back.
    - Round trips: a prefix that ends with micro-batch `mb`'s forward on the last virtual stage, the
      chain of `mb`'s backwards up to chunk c of device d, the rest of d's ops, then `tail[d]`.
      The prefixes: the forward chain of micro-batch 0; and device j's ops up to its last forward
      (from its first forward's arrival, or from its first backward's round trip) followed by the
      last micro-batch's forwards on the devices after j.
    - `tail[d]`: after d's last backward, its deferred W's or the backward chain to device 0 and
      the W's there, whichever is longer.
    """
    pp, chunks = len(fwd_s), m * vpp
    chunk_fwd = [f / vpp for f in fwd_s]
    chunk_input_grad = [b * (1.0 - split) / vpp for b in bwd_s]
    weight_grad = [b * split for b in bwd_s]
    warmup = [warmup_forwards(schedule, pp, d, m, vpp) for d in range(pp)]
    deferred_w = [min(m, d + 1) if split else 0 for d in range(pp)]
    upstream_fwd = [0.0] * (pp + 1)
    downstream_input_grad = [0.0] * (pp + 1)
    for d in range(pp):
        upstream_fwd[d + 1] = upstream_fwd[d] + chunk_fwd[d]
        downstream_input_grad[pp - 1 - d] = downstream_input_grad[pp - d] + chunk_input_grad[pp - 1 - d]
    total_fwd, loop_input_grad = upstream_fwd[pp] * vpp, downstream_input_grad[0]
    tail = [0.0] * pp
    chain_up = 0.0
    for d in range(pp):
        chain_up = max(deferred_w[d] * weight_grad[d], chain_up)
        tail[d] = chain_up
        chain_up += chunk_input_grad[d]

    def back_to_device(mb: int) -> float:
        longest = 0.0
        first_backward = (mb // pp) * vpp * pp + mb % pp
        for d in range(pp):
            for chunk in {0, vpp - 1}:
                backward = first_backward + (vpp - 1 - chunk) * pp
                forwards_after = chunks - warmup[d] - backward - 1
                weights_after = m - 1 - max(backward, d) if split else 0
                path = (
                    (vpp - 1 - chunk) * loop_input_grad
                    + downstream_input_grad[d]
                    + (chunks - 1 - backward) * chunk_input_grad[d]
                    + max(forwards_after, 0) * chunk_fwd[d]
                    + max(weights_after, 0) * weight_grad[d]
                    + tail[d]
                )
                longest = max(longest, path)
        return longest

    device_work = max(
        upstream_fwd[d] + m * (fwd_s[d] + bwd_s[d]) - deferred_w[d] * weight_grad[d] + tail[d] for d in range(pp)
    )
    to_last_forward = 0.0
    for d in range(pp):
        between = max(chunks - warmup[d] - 1, 0)
        weights_between = max(between - d, 0) * weight_grad[d]
        last_forward_end = upstream_fwd[d] + m * fwd_s[d] + between * chunk_input_grad[d] + weights_between
        if between:
            first_backward_ready = total_fwd + downstream_input_grad[d + 1]
            last_forward_end = max(
                last_forward_end,
                first_backward_ready + between * (chunk_fwd[d] + chunk_input_grad[d]) + weights_between,
            )
        to_last_forward = max(to_last_forward, last_forward_end + upstream_fwd[pp] - upstream_fwd[d + 1])
    return max(device_work, total_fwd + back_to_device(0), to_last_forward + back_to_device(m - 1))


def critical_transfers(schedule: PipeSchedule | str, pp: int, m: int, vpp: int) -> int:
    """Transfers on the critical path of an equal-stage pipeline (see `step_time_s`)."""
    if pp == 1:
        return 0
    if schedule == PipeSchedule.ONE_F_ONE_B:
        return 2 * (pp - 1) + 2 * ((m - 1) * (pp - 1) // pp)
    if schedule == PipeSchedule.INTERLEAVED:
        return 2 * (vpp * pp - 1)
    return 2 * (pp - 1)


def warmup_forwards(schedule: PipeSchedule, pp: int, device: int, m: int, vpp: int) -> int:
    """Chunk forwards a device runs before its steady state (Megatron's warm-up count)."""
    if schedule == PipeSchedule.INTERLEAVED:
        return min(2 * (pp - device - 1) + (vpp - 1) * pp, m * vpp)
    return min(pp - device - 1, m)


def check_args(
    schedule: PipeSchedule | str,
    fwd_s: Sequence[float],
    bwd_s: Sequence[float],
    num_microbatches: int,
    vpp: int,
    p2p_s: float | Sequence[float],
    bwd_weight_fraction: float,
) -> PipeSchedule:
    """The schedule of a `step_time_s` or `pipeline_sim.simulate` call, its arguments checked (same meanings).

    Raises:
        ValueError: on inconsistent or out-of-range arguments (the message names the field).
    """
    schedule = _check_schedule(schedule, vpp)
    if not fwd_s or len(fwd_s) != len(bwd_s):
        raise ValueError(f"fwd_s/bwd_s: need one time per stage each, got {len(fwd_s)} and {len(bwd_s)}")
    hops = hop_times(p2p_s, len(fwd_s))
    if len(hops) != len(fwd_s):
        raise ValueError(f"p2p_s: need one time or one per stage ({len(fwd_s)}), got {len(hops)}")
    if min(fwd_s) < 0 or min(bwd_s) < 0 or min(hops) < 0:
        raise ValueError("fwd_s/bwd_s/p2p_s: times must be non-negative seconds")
    _check_positive("num_microbatches", num_microbatches)
    if schedule == PipeSchedule.INTERLEAVED and num_microbatches % len(fwd_s):
        raise ValueError(
            f"num_microbatches={num_microbatches}: the interleaved schedule needs a multiple of pp={len(fwd_s)}"
        )
    if not 0.0 <= bwd_weight_fraction <= 1.0:
        raise ValueError(f"bwd_weight_fraction={bwd_weight_fraction}: must be in [0, 1]")
    return schedule


def _check_schedule(schedule: PipeSchedule | str, vpp: int) -> PipeSchedule:
    try:
        schedule = PipeSchedule(schedule)
    except ValueError:
        raise ValueError(f"schedule={schedule!r}: use one of {[s.value for s in PipeSchedule]}") from None
    _check_positive("vpp", vpp)
    if vpp > 1 and schedule != PipeSchedule.INTERLEAVED:
        raise ValueError(f"vpp={vpp}: model chunks need schedule=interleaved")
    return schedule


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r}: must be a positive integer")
