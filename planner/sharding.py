"""Tensor-parallel layout of one layer: an ILP over per-op strategies with resharding costs.

The input is the op graph of one layer (`planner.graph.Op`); the planner passes one representative
block and applies its layout to every block with the same `Layer.signature`, so the problem does not
grow with depth. Hardware enters only through two callbacks (op compute time, collective time), so
this module knows nothing about devices and imports no torch.

The first input from outside the layer is the activation entering it (the previous layer's output);
further outside inputs (rotary tables, masks, position ids, labels) are taken as present on every
rank at no cost.

Layouts, per-op strategies and the layer's strategy graph live in `planner.tp_strategies`.

ILP. Let V be the ops plus a boundary node B (the activation entering and leaving the layer: inputs
from outside the layer are produced by B, outputs of the layer are consumed by B; B's strategy is
the layout of that activation, the same on both sides as for a repeated block), S(v) the
strategies of v, and edges (u, v, k) "input k of v comes from u".

    x[v, s]     in {0, 1}  v runs strategy s
    need[u, t]  in [0, 1]  u's output is needed in layout t by some consumer
    conv[u, l, t] in [0, 1]  u's output, produced in layout l, is converted to layout t

    one_strategy[v]      sum_s x[v, s] = 1                                   (_add_one_strategy_constraints)
    need[u,v,k,t]        need[u, t] >= sum_{s in S(v): in_k(s) = t} x[v, s]  (_add_need_constraints)
    convert[u,l,t]       conv[u, l, t] >= produced[u, l] + need[u, t] - 1, produced[u, l] =
                         sum_{s: out(s) = l} x[u, s], for every l -> t that costs a collective
                                                                             (_add_conversion_constraints)
    tie[fqn,u,p]         ops of one module pick the same placement           (_add_module_tie_constraints)
    pin[fqn]             a module sharing its weight with an earlier layer's module takes one of
                         the placements that split the weight the same way   (_add_pin_constraints)
    param_memory         sum x[v, s] * param_bytes(v) / param_shards(s) <= cap, when a budget is
                         given                                               (_add_param_memory_constraint)
    least_params         with shard_params: sum x[v, s] * params(v) / param_shards(s) <= its least
                         value, found by a first solve minimising it        (_add_least_params_constraint)

    minimise  sum x[v, s] * compute_time_s(v, shards(s))
            + COLLECTIVES_PER_CONVERSION * sum conv[u, l, t] * comm_time_s(collective(l -> t), bytes(u))

`need` is per producer and layout, not per edge: one all-gather of a norm's output feeds q, k and v.
Conversions: P -> R all-reduce; P -> S(sequence) reduce-scatter; S(.) -> R all-gather; S(feature)
<-> S(sequence) all-to-all; R -> S(sequence) free (each rank slices); anything else is impossible
(impossible[u,l,t]: produced[u, l] + need[u, t] <= 1). No strategy consumes P, so P is only ever
converted away. Size: |V| * max|S| binaries, the rest continuous (integral at the optimum).
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from ortools.math_opt.python import mathopt

from planner.errors import PlannerError, PlannerErrorKind
from planner.graph import Op, OpKind
from planner.milp import MilpResult, SolveStatus, solve_milp
from planner.tp_strategies import (BOUNDARY, CONVERSIONS, SLICES, Collective, Placement, Strategy, StrategyGraph,
                                   TensorLayout)

# Each forward conversion has a conjugate in backward moving the same bytes (all-reduce <-> identity
# pairs of Megatron-LM's f/g operators, all-gather <-> reduce-scatter with sequence parallelism;
# Shoeybi et al. 2019 Fig. 3, Korthikanti et al. 2022 Fig. 5), so a layer's forward+backward pays twice.
COLLECTIVES_PER_CONVERSION = 2
OBJECTIVE_FLOOR_S = 1e-12  # keeps the cost normalisation finite when every cost is 0
# With shard_params, how far above its least value the (normalised) parameter count per device may
# lie in the time solve: the solver's feasibility tolerance, not a trade-off.
LEAST_PARAMS_TOLERANCE = 1e-6
GIB_BYTES = 2**30  # only for rendering messages
MS_PER_S = 1e3  # only for rendering `Layout.explain`

ComputeTime = Callable[[Op, int], float]   # (op, ways its work is split) -> forward+backward seconds
CommTime = Callable[[Collective, float], float]  # (collective, bytes of the whole tensor) -> seconds on the tp group


@dataclass(frozen=True)
class ParamBudget:
    """Cap on the parameter-proportional memory of the layer per device.

    Attributes:
        cap_bytes: bytes available per device for the layer's parameters and their state.
        bytes_per_param: bytes each parameter costs (weights + grads + optimizer state on this device).
    """

    cap_bytes: float
    bytes_per_param: float


@dataclass(frozen=True)
class CollectiveCall:
    """One collective of the layer's forward: `producer`'s output converted to `layout`."""

    kind: Collective
    bytes: float
    producer: str
    layout: TensorLayout

    @property
    def where(self) -> str:
        return f"{self.producer} -> {self.layout}"


@dataclass(frozen=True)
class OpChoice:
    """The strategy chosen for one op and what it costs (forward+backward)."""

    name: str
    fqn: str
    strategy: Strategy
    compute_s: float
    comm_s: float


@dataclass(frozen=True)
class Layout:
    """Tensor-parallel layout of one layer.

    Attributes:
        tp: tensor-parallel degree.
        per_fqn: module FQN -> placement, for modules with parameters and attention modules.
        per_op: op name -> placement, for every op.
        boundary: layout of the activation entering and leaving the layer.
        collectives: the forward's collectives (backward runs their conjugates).
        choices: per-op strategy and cost, in graph order, then the boundary pseudo-op (its comm is the
            conversion of the layer's input).
        compute_s, comm_s: forward+backward compute and communication time of the layer.
        objective_s: compute_s + comm_s.
        status, gap, solve_time_s: solver outcome.
    """

    tp: int
    per_fqn: dict[str, Placement]
    per_op: dict[str, Placement]
    boundary: TensorLayout
    collectives: tuple[CollectiveCall, ...]
    choices: tuple[OpChoice, ...]
    compute_s: float
    comm_s: float
    objective_s: float
    status: SolveStatus
    gap: float
    solve_time_s: float

    def explain(self) -> list[str]:
        """One line per op: placement, layouts in and out, compute and communication time."""
        lines = []
        for choice in self.choices:
            inputs = ",".join(str(layout or "-") for layout in choice.strategy.input_layouts)
            lines.append(
                f"{choice.name} [{choice.fqn or '-'}]: {choice.strategy.placement} ({inputs} -> {choice.strategy.output_layout}) "
                f"compute {choice.compute_s * MS_PER_S:.3f} ms, comm {choice.comm_s * MS_PER_S:.3f} ms"
            )
        return lines


def solve_layout(
    ops: Iterable[Op],
    tp: int,
    compute_time_s: ComputeTime,
    comm_time_s: CommTime,
    *,
    sequence_parallel: bool = True,
    boundary: TensorLayout | None = None,
    input_bytes: float | None = None,
    param_budget: ParamBudget | None = None,
    shard_params: bool = False,
    pins: Mapping[str, frozenset[Placement]] | None = None,
    time_limit_s: float = 10.0,
    rel_gap: float = 1e-4,
) -> Layout:
    """Choose a strategy per op minimising compute plus resharding time (see the module docstring).

    Args:
        ops: the ops of one layer in graph order; the first input naming an op outside the layer is
            the activation entering it.
        tp: tensor-parallel degree.
        compute_time_s: forward+backward seconds of an op whose work is split the given number of ways.
        comm_time_s: seconds of one collective over the tp group, given the bytes of the whole tensor.
        sequence_parallel: allow S(sequence) activations (Megatron sequence parallelism).
        boundary: fix the layout of the activation entering/leaving the layer (e.g. to the layout the
            blocks chose, when solving the embedding or head layer); None lets the solver choose.
        input_bytes: bytes of the activation entering the layer; default: the largest output of the
            layer, which is right for a repeated block.
        param_budget: optional cap on parameter memory per device.
        shard_params: first find the least parameters per device any layout reaches, then the
            fastest layout holding no more (what tensor parallelism is for: Megatron-LM shards every
            large weight, the embedding by vocabulary); otherwise time alone decides.
        pins: module FQN -> the placements it may take (a head tied to an embedding must split the
            shared weight as the embedding does; Plan.apply runs some modules outside the blocks whole).
        time_limit_s: solver wall-clock limit.
        rel_gap: relative gap at which the solver stops.

    Returns:
        The Layout, with status "optimal" or "time_limit" and its gap.

    Raises:
        PlannerError: INVALID_INPUT for a bad graph or option; INSUFFICIENT_MEMORY when the
            parameters cannot fit `param_budget` at this tp.
    """
    start_s = time.perf_counter()
    ops = tuple(ops)
    graph = StrategyGraph.build(ops, tp, sequence_parallel, boundary, input_bytes)
    model = mathopt.Model(name="tp_layout")
    # x[v, s]: op v runs its strategy s (the boundary's strategies are its layouts)
    choose = {
        (name, s): model.add_binary_variable(name=f"x[{name},{s}]")
        for name, strategies in graph.strategies.items()
        for s in range(len(strategies))
    }
    # need[u, t]: u's output is needed in layout t by some consumer
    need = {
        (producer, layout): model.add_variable(lb=0.0, ub=1.0, name=f"need[{producer},{layout}]")
        for producer, layout in graph.needed_layouts()
    }
    _add_one_strategy_constraints(model, choose, graph)
    _add_need_constraints(model, choose, need, graph)
    conversions = _add_conversion_constraints(model, choose, need, graph)
    _add_module_tie_constraints(model, choose, graph)
    _add_pin_constraints(model, choose, graph, pins or {})
    if param_budget is not None:
        _add_param_memory_constraint(model, choose, graph, param_budget)
    if shard_params:
        _add_least_params_constraint(model, choose, graph, tp, time_limit_s, rel_gap)
    compute_cost = {
        name: [0.0 if name == BOUNDARY else compute_time_s(graph.ops[name], s.compute_shards) for s in strategies]
        for name, strategies in graph.strategies.items()
    }
    comm_cost = {key: comm_time_s(CONVERSIONS[key[1:]], graph.out_bytes[key[0]]) for key in conversions}
    # Costs are divided by the largest one so the solver sees coefficients of order 1, not 1e-6 s.
    scale_s = max([cost for costs in compute_cost.values() for cost in costs] + list(comm_cost.values()) + [OBJECTIVE_FLOOR_S])
    model.minimize(
        mathopt.fast_sum(
            choose[name, s] * (cost / scale_s) for name, costs in compute_cost.items() for s, cost in enumerate(costs)
        )
        + COLLECTIVES_PER_CONVERSION * mathopt.fast_sum(var * (comm_cost[key] / scale_s) for key, var in conversions.items())
    )
    result = solve_milp(model, time_limit_s=time_limit_s, rel_gap=rel_gap, what=f"tp layout (tp={tp})")
    if result.status == SolveStatus.INFEASIBLE:  # all-replicated always fits the other constraints
        raise _param_budget_error(graph, param_budget)
    chosen = {
        name: next(s for s in range(len(strategies)) if result.values[choose[name, s]] > 0.5)
        for name, strategies in graph.strategies.items()
    }
    return _make_layout(graph, chosen, compute_cost, comm_cost, conversions, result, time.perf_counter() - start_s)


def _add_one_strategy_constraints(model: mathopt.Model, choose: dict, graph: StrategyGraph) -> None:
    for name, strategies in graph.strategies.items():
        model.add_linear_constraint(
            mathopt.fast_sum(choose[name, s] for s in range(len(strategies))) == 1, name=f"one_strategy[{name}]"
        )


def _add_need_constraints(model: mathopt.Model, choose: dict, need: dict, graph: StrategyGraph) -> None:
    for producer, consumer, index in graph.edges:
        by_layout = defaultdict(list)
        for s, strategy in enumerate(graph.strategies[consumer]):
            layout = graph.required_layout(consumer, strategy, index)
            if layout is not None:
                by_layout[layout].append(choose[consumer, s])
        for layout, variables in by_layout.items():
            model.add_linear_constraint(
                need[producer, layout] >= mathopt.fast_sum(variables), name=f"need[{producer},{consumer},{index},{layout}]"
            )


def _add_conversion_constraints(model: mathopt.Model, choose: dict, need: dict, graph: StrategyGraph) -> dict:
    """conv[u, l, t] >= produced[u, l] + need[u, t] - 1 per costly conversion; produced + need <= 1 per impossible one.

    Returns:
        (producer, produced layout, needed layout) -> conv variable.
    """
    conversions = {}
    for producer, layout in need:
        produced = defaultdict(list)
        for s, strategy in enumerate(graph.strategies[producer]):
            produced[strategy.output_layout].append(choose[producer, s])
        for source, variables in produced.items():
            if source == layout or (source, layout) in SLICES:
                continue
            if (source, layout) not in CONVERSIONS:
                model.add_linear_constraint(
                    mathopt.fast_sum(variables) + need[producer, layout] <= 1, name=f"impossible[{producer},{source},{layout}]"
                )
                continue
            var = model.add_variable(lb=0.0, ub=1.0, name=f"conv[{producer},{source},{layout}]")
            model.add_linear_constraint(
                var >= mathopt.fast_sum(variables) + need[producer, layout] - 1, name=f"convert[{producer},{source},{layout}]"
            )
            conversions[producer, source, layout] = var
    return conversions


def _add_module_tie_constraints(model: mathopt.Model, choose: dict, graph: StrategyGraph) -> None:
    """Ops of one module (same FQN, with parameters or attention) pick the same placement."""
    for fqn, names in graph.modules().items():
        first = names[0]
        placements = {strategy.placement for name in names for strategy in graph.strategies[name]}
        for other in names[1:]:
            for placement in placements:
                same = _placement_indicator(choose, graph, first, placement) == _placement_indicator(choose, graph, other, placement)
                model.add_linear_constraint(same, name=f"tie[{fqn},{other},{placement}]")


def _add_pin_constraints(model: mathopt.Model, choose: dict, graph: StrategyGraph,
                         pins: Mapping[str, frozenset[Placement]]) -> None:
    """Ops of a pinned module take only its allowed placements; its parameter-free ops (a container's
    own sums and reshapes) only when it is pinned whole."""
    for name, op in graph.ops.items():
        allowed = pins.get(op.fqn)
        if allowed is None or (not op.param_shapes and allowed != {Placement.REPLICATE}):
            continue
        for s, strategy in enumerate(graph.strategies[name]):
            if strategy.placement not in allowed:
                model.add_linear_constraint(choose[name, s] == 0, name=f"pin[{name},{strategy.placement}]")


def _add_param_memory_constraint(model: mathopt.Model, choose: dict, graph: StrategyGraph, budget: ParamBudget) -> None:
    """Parameter memory / cap <= 1 (normalised so the row has coefficients of order 1)."""
    terms = [
        choose[name, s] * graph.params[name] * budget.bytes_per_param / strategy.param_shards / budget.cap_bytes
        for name, strategies in graph.strategies.items()
        for s, strategy in enumerate(strategies)
    ]
    model.add_linear_constraint(mathopt.fast_sum(terms) <= 1.0, name="param_memory")


def _add_least_params_constraint(model: mathopt.Model, choose: dict, graph: StrategyGraph, tp: int,
                                 time_limit_s: float, rel_gap: float) -> None:
    """Parameters per device (as a fraction of the layer's) <= the least any layout reaches."""
    total = sum(graph.params.values())
    if total == 0:
        return
    share = mathopt.fast_sum(
        choose[name, s] * (graph.params[name] / strategy.param_shards / total)
        for name, strategies in graph.strategies.items()
        for s, strategy in enumerate(strategies)
        if graph.params.get(name)
    )
    model.minimize(share)
    least = solve_milp(model, time_limit_s=time_limit_s, rel_gap=rel_gap, what=f"least-parameter tp layout (tp={tp})")
    model.add_linear_constraint(share <= least.objective + LEAST_PARAMS_TOLERANCE, name="least_params")


def _placement_indicator(choose: dict, graph: StrategyGraph, name: str, placement: Placement):
    strategies = graph.strategies[name]
    return mathopt.fast_sum(choose[name, s] for s, strategy in enumerate(strategies) if strategy.placement == placement)


def _param_budget_error(graph: StrategyGraph, budget: ParamBudget) -> PlannerError:
    least_bytes = sum(
        graph.params[name] * budget.bytes_per_param / max(s.param_shards for s in strategies)
        for name, strategies in graph.strategies.items()
    )
    return PlannerError(
        PlannerErrorKind.INSUFFICIENT_MEMORY,
        f"tp layout: the layer's parameters need at least {least_bytes / GIB_BYTES:.2f} GiB per device at tp={graph.tp} "
        f"(budget {budget.cap_bytes / GIB_BYTES:.2f} GiB); raise tp, shard optimizer state or add pipeline stages",
    )


def _make_layout(
    graph: StrategyGraph, chosen: dict, compute_cost: dict, comm_cost: dict, conversions: dict, result: MilpResult, solve_time_s: float
) -> Layout:
    active = [key for key, var in conversions.items() if result.values[var] > 0.5]
    collectives = tuple(
        CollectiveCall(CONVERSIONS[source, layout], graph.out_bytes[producer], producer, layout) for producer, source, layout in active
    )
    comm_by_producer = defaultdict(float)
    for key in active:
        comm_by_producer[key[0]] += COLLECTIVES_PER_CONVERSION * comm_cost[key]
    choices = tuple(
        OpChoice(name, graph.ops[name].fqn, strategies[chosen[name]], compute_cost[name][chosen[name]], comm_by_producer[name])
        for name, strategies in graph.strategies.items()
    )
    per_op = {choice.name: choice.strategy.placement for choice in choices if choice.name != BOUNDARY}
    per_fqn = {
        choice.fqn: choice.strategy.placement
        for choice in choices
        if choice.fqn and (graph.ops[choice.name].param_shapes or graph.ops[choice.name].kind == OpKind.ATTENTION)
    }
    compute_s = sum(choice.compute_s for choice in choices)
    comm_s = sum(comm_by_producer.values())
    return Layout(
        tp=graph.tp,
        per_fqn=per_fqn,
        per_op=per_op,
        boundary=graph.strategies[BOUNDARY][chosen[BOUNDARY]].output_layout,
        collectives=collectives,
        choices=choices,
        compute_s=compute_s,
        comm_s=comm_s,
        objective_s=compute_s + comm_s,
        status=result.status,
        gap=result.gap,
        solve_time_s=solve_time_s,
    )
