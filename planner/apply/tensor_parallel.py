"""The plan's per-module placements turned into DTensor parallel styles (`parallelize_module`).

Convention: every activation passed between modules is a plain local tensor in a known
`TensorLayout` (R replicated, S(sequence) split on dim 1, S(feature) split on the last dim). The
residual stream between the model's top-level units and between the children of a block has one
layout, the *stream* layout: S(sequence) when the blocks' norms are sequence-parallel (Megatron-SP),
R otherwise. Each stream module converts its input from the stream layout to what it needs and its
output back, so any mix of placements the sharding ILP chooses composes:

- norm: `sequence` -> SequenceParallel; `replicate` -> plain (gathered around when the stream is
  split). A sequence-parallel final norm on a replicated stream runs replicated (same numbers).
- container (attention, MLP): its input linears (every Linear child but the output projection)
  read the full input, as one replicated DTensor when they are all colwise (one gradient reduction
  for all of them, `_shared_input`). When they are all colwise (and, for attention, the core runs
  on `heads`), the middle (attention core, activation) runs on local heads / feature slices;
  otherwise colwise input linears gather their outputs. The output projection is rowwise (reduces
  straight into the stream layout), colwise, or replicate (gathers a feature-split input first).
  A container the plan leaves whole runs as written (torch's nn.MultiheadAttention). One whose only
  input Linear is a fused projection (GPT-2's q, k and v side by side) is refused where its output
  would be used on local slices, which would mix q, k and v heads (`_check_unfused`).
- embedding: `rowwise` -> vocab-parallel (RowwiseParallel), `replicate` -> plain.
- head: colwise keeps the logits split over the vocabulary for a vocab-parallel cross entropy
  (`loss_parallel`, Megatron's parallel cross entropy; a pipeline's last stage too, as in torchtitan);
  rowwise gathers them; `replicate` -> plain. A head tied to the embedding (GPT) shares its weight
  split by vocabulary in both (rowwise embedding, colwise head), as Megatron-LM shares it:
  `parallelize_module` distributes each module's weight on its own, so `tied.retie` points both at one
  DTensor again (`validate` refuses a plan that splits a tied weight two ways).
- mixture of experts (a container with `experts` of `GroupedLinear` projections): routing runs on
  the full, replicated input (the router as a Linear; colwise gathers its logits); the experts'
  gate and up projections are colwise and the down projection rowwise, each expert's weights split
  like a Megatron MLP's (`GroupedLinearParallel`), the down projection's partial sums all-reduced
  before the combine; shared experts are a nested MLP container on the replicated input.

Attention modules split heads through the projection widths: the zoo's attention infers its
local head count from the projected tensor, so column-sharded q/k/v give `heads / tp` local heads
(and `kv_heads / tp` for grouped-query attention) with no change to the module. With fewer
key/value heads than tp ranks (tp a multiple of them; multi-query attention's one head), the query
heads split and every rank keeps the key/value head its queries share (`SharedKeyValueParallel`).
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from planner.head_attrs import KEY_VALUE_HEAD_ATTRS, QUERY_HEAD_ATTRS, head_count
from planner.apply.styles import GroupedLinearParallel, SharedKeyValueParallel
from planner.errors import unsupported
from planner.tp_strategies import Placement, TensorLayout
from planner.zoo.moe import GroupedLinear

# Names of the projection that produces a container's output (zoo: attention o_proj, GPT MLP fc2,
# SwiGLU down_proj); every other Linear child reads the container's input.
OUTPUT_PROJECTIONS = ("o_proj", "fc2", "down_proj")
NORM_TYPES = (nn.LayerNorm, nn.RMSNorm)
# Tensor dimension holding the sequence in (batch, seq, hidden) activations.
SEQUENCE_DIM = 1

R, Q, F = TensorLayout.REPLICATE, TensorLayout.SHARD_SEQUENCE, TensorLayout.SHARD_FEATURE
_DTENSOR_PLACEMENT = {R: Replicate(), Q: Shard(SEQUENCE_DIM), F: Shard(-1)}


@dataclass(frozen=True)
class TensorParallelPlan:
    """Parallel style per module FQN, the stream layout they assume, and whether the loss is vocab-parallel.

    With `loss_parallel`, the head returns logits as a DTensor split over the vocabulary and the loss
    must run (forward and backward) inside `torch.distributed.tensor.parallel.loss_parallel()`.
    """

    stream: TensorLayout
    styles: dict[str, ParallelStyle]
    loss_parallel: bool = False


def _placement(layouts: dict[str, str], fqn: str) -> Placement:
    return Placement(layouts.get(fqn, Placement.REPLICATE))


def _convert(module_in: TensorLayout | None, need: TensorLayout | None, out: TensorLayout | None,
             want: TensorLayout | None) -> ParallelStyle | None:
    """A style that converts a module's input from `module_in` to `need` and its output from `out` to `want`."""
    has_in = module_in is not None and module_in != need
    has_out = out is not None and out != want
    p = _DTENSOR_PLACEMENT
    if has_in and has_out:
        return PrepareModuleInputOutput(input_layouts=(p[module_in],), desired_input_layouts=(p[need],),
                                        output_layouts=(p[out],), desired_output_layouts=(p[want],),
                                        use_local_input=True, use_local_output=True)
    if has_in:
        return PrepareModuleInput(input_layouts=(p[module_in],), desired_input_layouts=(p[need],), use_local_output=True)
    if has_out:
        return PrepareModuleOutput(output_layouts=(p[out],), desired_output_layouts=(p[want],), use_local_output=True)
    return None


def _linear_style(placement: Placement, fqn: str, need_in: TensorLayout, out: TensorLayout) -> ParallelStyle | None:
    """Style of a Linear/Embedding reading `need_in` and producing `out` under `placement`."""
    p = _DTENSOR_PLACEMENT
    if placement == Placement.COLWISE:
        return ColwiseParallel(input_layouts=p[need_in], output_layouts=p[out])
    if placement == Placement.ROWWISE:
        return RowwiseParallel(input_layouts=p[need_in], output_layouts=p[out])
    if placement == Placement.REPLICATE:
        return _convert(need_in, R, R, out)
    raise unsupported(f"layout {fqn}: placement '{placement}' on a {nn.Linear.__name__} cannot be applied; "
                      f"re-plan (`paraplan plan`) or use tp=1")


def _moe_styles(fqn: str, module: nn.Module, layouts: dict[str, str], stream: TensorLayout,
                tp: int, expert_parallel: bool) -> dict[str, ParallelStyle]:
    """Styles of a mixture-of-experts container (see the module docstring); with expert parallelism
    the experts are left to `expert_parallel`, which splits them over (ep, tp) itself."""
    styles: dict[str, ParallelStyle] = {}
    for name, child in module.named_children():
        child_fqn = f"{fqn}.{name}"
        if isinstance(child, nn.Linear):
            style = _linear_style(_placement(layouts, child_fqn), child_fqn, R, R)
        elif any(isinstance(c, GroupedLinear) for c in child.children()):
            if not expert_parallel:
                styles.update(_grouped_expert_styles(child_fqn, child, layouts))
            continue
        elif any(isinstance(c, nn.Linear) for c in child.children()):
            styles.update(_container_styles(child_fqn, child, layouts, R, tp))
            continue
        else:
            style = None
        if style is not None:
            styles[child_fqn] = style
    style = _convert(stream, R, R, stream)
    if style is not None:
        styles[fqn] = style
    return styles


def _is_moe(module: nn.Module) -> bool:
    """A mixture-of-experts container: its `experts` child holds `GroupedLinear` projections."""
    experts = getattr(module, "experts", None)
    return isinstance(experts, nn.Module) and any(isinstance(c, GroupedLinear) for c in experts.children())


def _grouped_expert_styles(fqn: str, module: nn.Module, layouts: dict[str, str]) -> dict[str, ParallelStyle]:
    """The experts' projections: all replicated, or inputs colwise and the output rowwise."""
    placements = {name: _placement(layouts, f"{fqn}.{name}") for name, _ in module.named_children()}
    outputs = [name for name in placements if name in OUTPUT_PROJECTIONS]
    if set(placements.values()) == {Placement.REPLICATE}:
        return {}
    if len(outputs) != 1 or placements[outputs[0]] != Placement.ROWWISE or any(
            placement != Placement.COLWISE for name, placement in placements.items() if name != outputs[0]):
        raise unsupported(f"layout {fqn}: experts apply with colwise input projections and a rowwise "
                          f"{' or '.join(OUTPUT_PROJECTIONS)}, or all replicated; got {placements}; re-plan")
    return {f"{fqn}.{name}": GroupedLinearParallel(colwise=name != outputs[0]) for name in placements}


def _shared_key_value(module: nn.Module, inputs: list[str], tp: int) -> list[str]:
    """The input projections that produce the keys and values of attention whose key/value heads
    are fewer than tp and shared by tp / kv_heads ranks each (query heads split over tp); none for
    other modules."""
    head_dim, heads, kv_heads = _head_dim(module, inputs), head_count(module, QUERY_HEAD_ATTRS), head_count(module, KEY_VALUE_HEAD_ATTRS)
    if not head_dim or not kv_heads or kv_heads >= tp or tp % kv_heads or not heads or heads % tp:
        return []
    return [name for name in inputs if getattr(module, name).out_features == kv_heads * head_dim]


def _head_dim(module: nn.Module, inputs: list[str]) -> int | None:
    """The attention's head width: its `head_dim`, else the query projection's width over its heads."""
    heads = head_count(module, QUERY_HEAD_ATTRS)
    return getattr(module, "head_dim", None) or (getattr(module, inputs[0]).out_features // heads if heads and inputs else None)


def _check_heads(fqn: str, module: nn.Module, inputs: list[str], tp: int) -> None:
    """Local heads must be whole: every head-projection's heads divisible by tp (attention has `head_dim`)."""
    head_dim = getattr(module, "head_dim", None)
    for name in inputs if head_dim else ():
        heads = getattr(module, name).out_features // head_dim
        if heads % tp:
            raise unsupported(f"layout {fqn}.{name}: its {heads} heads do not split over tp={tp}; "
                              f"re-plan with a tp that divides the key/value heads")


def _check_unfused(fqn: str, module: nn.Module, inputs: list[str], output: str, attention: bool) -> None:
    """Refuses a container whose only input Linear is wider or narrower than its output projection's
    input: a fused projection (GPT-2's q, k and v side by side; a gate and an up projection), whose
    contiguous column slices would hand each rank q heads for k heads (another model, trained silently)."""
    width, read = getattr(module, inputs[0]).out_features, getattr(module, output).in_features
    if len(inputs) == 1 and width != read:
        held, cut, fix = (("q, k and v", "heads", "q, k, v") if attention else ("a gate and an up projection", "them", "gate and up"))
        raise unsupported(f"layout {fqn}.{inputs[0]}: a fused projection ({width} outputs for {output}'s {read} inputs) "
                          f"holds {held} side by side, which a column split would cut across {cut}; split it into "
                          f"separate {fix} Linears, or plan with --tp 1")


def _container_styles(fqn: str, module: nn.Module, layouts: dict[str, str], stream: TensorLayout,
                      tp: int) -> dict[str, ParallelStyle]:
    """Styles of an attention or MLP container and its Linear children (see the module docstring)."""
    linears = {name: child for name, child in module.named_children() if isinstance(child, nn.Linear)}
    others = [f"{fqn}.{name}" for name, child in module.named_children()
              if not isinstance(child, nn.Linear) and any(True for _ in child.parameters())]
    placements = {name: _placement(layouts, f"{fqn}.{name}") for name in linears}
    if others and any(p != Placement.REPLICATE for p in placements.values()):
        raise unsupported(f"layout {fqn}: tensor parallelism of nested module {others[0]} is not supported; use tp=1")
    core = layouts.get(fqn)  # attention core placement; MLPs have none and follow their input linears
    if core != Placement.HEADS and all(p == Placement.REPLICATE for p in placements.values()):
        style = _convert(stream, R, R, stream)  # runs whole (torch's nn.MultiheadAttention, which has no o_proj)
        return {fqn: style} if style is not None else {}
    outputs = [name for name in linears if name in OUTPUT_PROJECTIONS]
    if len(outputs) != 1:
        raise unsupported(f"module {fqn}: expected one output projection named one of {', '.join(OUTPUT_PROJECTIONS)}, "
                          f"found {outputs or 'none'}; tensor parallelism needs the zoo layout")
    inputs = [name for name in linears if name not in outputs]
    shared = _shared_key_value(module, inputs, tp) if core == Placement.HEADS else []
    split = [name for name in inputs if name not in shared]
    all_colwise = bool(split) and all(placements[name] == Placement.COLWISE for name in split) and all(
        placements[name] in (Placement.COLWISE, Placement.REPLICATE) for name in shared)
    if core == Placement.HEADS and not all_colwise:
        raise unsupported(f"layout {fqn}: attention on local heads needs colwise {', '.join(split)}; re-plan")
    middle = F if all_colwise and core != Placement.REPLICATE else R
    if middle == F:
        _check_unfused(fqn, module, inputs, outputs[0], core is not None or head_count(module, QUERY_HEAD_ATTRS) is not None)
        _check_heads(fqn, module, split, tp)
    styles: dict[str, ParallelStyle] = {
        f"{fqn}.{name}": SharedKeyValueParallel(placements[name] == Placement.COLWISE, _head_dim(module, inputs),
                                                 tp // head_count(module, KEY_VALUE_HEAD_ATTRS))
        for name in shared}
    for name in split:
        if placements[name] == Placement.ROWWISE:
            raise unsupported(f"layout {fqn}.{name}: a rowwise input projection cannot read the replicated input; re-plan")
        style = _linear_style(placements[name], f"{fqn}.{name}", R, middle)
        if style is not None:
            styles[f"{fqn}.{name}"] = style
    out_name = outputs[0]
    out_placement = placements[out_name]
    produced = {Placement.ROWWISE: stream, Placement.COLWISE: F, Placement.REPLICATE: R}.get(out_placement)
    if produced is None:
        raise unsupported(f"layout {fqn}.{out_name}: placement '{out_placement}' cannot be applied; re-plan")
    style = _linear_style(out_placement, f"{fqn}.{out_name}", middle, produced)
    if style is not None:
        styles[f"{fqn}.{out_name}"] = style
    style = _shared_input(stream, produced) if all_colwise else _convert(stream, R, produced, stream)
    if style is not None:
        styles[fqn] = style
    return styles


def _shared_input(stream: TensorLayout, produced: TensorLayout) -> ParallelStyle:
    """A container whose input linears are all colwise reads its input as one replicated DTensor, so
    their partial input gradients add up before a single all-reduce (reduce-scatter on a
    sequence-split stream), Megatron's f operator; converted to local tensors, each would be reduced
    on its own (three all-reduces for q, k and v). Its output goes back to the stream layout."""
    p = _DTENSOR_PLACEMENT
    if produced == stream:
        return PrepareModuleInput(input_layouts=(p[stream],), desired_input_layouts=(Replicate(),), use_local_output=False)
    return PrepareModuleInputOutput(input_layouts=(p[stream],), desired_input_layouts=(Replicate(),),
                                    output_layouts=(p[produced],), desired_output_layouts=(p[stream],),
                                    use_local_input=False, use_local_output=True)


def _norm_styles(fqn: str, layouts: dict[str, str], stream: TensorLayout) -> dict[str, ParallelStyle]:
    """A norm: sequence-parallel on a sequence-split stream, else replicated (gathered around if needed)."""
    if _placement(layouts, fqn) == Placement.SEQUENCE and stream == Q:
        return {fqn: SequenceParallel(sequence_dim=SEQUENCE_DIM, use_local_output=True)}
    style = _convert(stream, R, R, stream)
    return {fqn: style} if style is not None else {}


def _embedding_styles(fqn: str, module: nn.Module, layouts: dict[str, str], stream: TensorLayout) -> dict[str, ParallelStyle]:
    """Styles of the input embedding: one nn.Embedding, or a container summing several (token ids in)."""
    if isinstance(module, nn.Embedding):
        style = _linear_style(_placement(layouts, fqn), fqn, R, stream)
        return {fqn: style} if style is not None else {}
    styles: dict[str, ParallelStyle] = {}
    for name, child in module.named_children():
        placement = _placement(layouts, f"{fqn}.{name}")
        if placement != Placement.REPLICATE and not isinstance(child, (nn.Embedding, nn.Linear)):
            raise unsupported(f"layout {fqn}.{name}: placement '{placement}' on a {type(child).__name__} inside the input "
                              f"embedding cannot be applied; plan with --tp 1 to apply it")
        style = _linear_style(placement, f"{fqn}.{name}", R, R)
        if style is not None:
            styles[f"{fqn}.{name}"] = style
    style = _convert(None, None, R, stream)
    if style is not None:
        styles[fqn] = style
    return styles


def _head_styles(fqn: str, module: nn.Module, layouts: dict[str, str], stream: TensorLayout) -> dict[str, ParallelStyle]:
    """The output head reads the stream; a colwise head keeps its logits vocabulary-split for a
    vocab-parallel loss, every other head hands full logits to the loss."""
    placement = _placement(layouts, fqn)
    if not isinstance(module, nn.Linear) and placement != Placement.REPLICATE:
        raise unsupported(f"layout {fqn}: placement '{placement}' on a {type(module).__name__} cannot be applied")
    if placement == Placement.REPLICATE:  # it reads the whole stream (a ViT's class-token pooling)
        style = _convert(stream, R, None, None)
        return {fqn: style} if style is not None else {}
    if placement == Placement.COLWISE:
        return {fqn: ColwiseParallel(input_layouts=_DTENSOR_PLACEMENT[stream], output_layouts=Shard(-1),
                                     use_local_output=False)}
    if placement != Placement.ROWWISE:
        raise unsupported(f"layout {fqn}: placement '{placement}' on the output head cannot be applied; re-plan")
    return {fqn: RowwiseParallel(input_layouts=_DTENSOR_PLACEMENT[stream], output_layouts=Replicate())}


def stream_layout(layouts: dict[str, str], block_fqns: list[str], model: nn.Module) -> TensorLayout:
    """S(sequence) when any norm inside a block is sequence-parallel, else R."""
    for block in block_fqns:
        for name, module in model.get_submodule(block).named_children():
            if isinstance(module, NORM_TYPES) and _placement(layouts, f"{block}.{name}") == Placement.SEQUENCE:
                return Q
    return R


def tensor_parallel_plan(model: nn.Module, units: list[str], block_fqns: list[str], layouts: dict[str, str],
                         tp: int, expert_parallel: bool = False) -> TensorParallelPlan:
    """Parallel styles for every unit of `model` under per-module `layouts` (FQN -> placement, all blocks).

    Args:
        model: the model (its module tree decides which rule each module follows).
        units: pipeline-cut units in order (top-level modules, blocks expanded).
        block_fqns: the units that are repeated blocks.
        layouts: placement of every module FQN that is not replicated.
        tp: tensor-parallel degree.
        expert_parallel: the plan has ep > 1, so the experts' projections are split by
            `expert_parallel` over the (ep, tp) mesh rather than here.

    Raises:
        PlannerError: UNSUPPORTED_MODEL naming the module whose placement cannot be applied.
    """
    stream = stream_layout(layouts, block_fqns, model)
    styles: dict[str, ParallelStyle] = {}
    embedded = False
    first_block = min((units.index(block) for block in block_fqns), default=len(units))
    for position, unit in enumerate(units):
        module = model.get_submodule(unit)
        if unit in block_fqns:
            for name, child in module.named_children():
                fqn = f"{unit}.{name}"
                if isinstance(child, NORM_TYPES):
                    styles.update(_norm_styles(fqn, layouts, stream))
                elif _is_moe(child):
                    styles.update(_moe_styles(fqn, child, layouts, stream, tp, expert_parallel))
                elif any(isinstance(c, nn.Linear) for c in child.children()):
                    styles.update(_container_styles(fqn, child, layouts, stream, tp))
                elif any(True for _ in child.parameters()) and _placement(layouts, fqn) != Placement.REPLICATE:
                    raise unsupported(f"layout {fqn}: Plan.apply splits a block's Linears only inside its attention, MLP "
                                      f"or mixture-of-experts child (input Linears and an output projection named "
                                      f"{', '.join(OUTPUT_PROJECTIONS)}), and this {type(child).__name__} sits directly "
                                      f"in block {unit}; move it into such a child, or plan with --tp 1")
        elif isinstance(module, NORM_TYPES):
            styles.update(_norm_styles(unit, layouts, stream))
        elif not embedded and (isinstance(module, nn.Embedding) or any(isinstance(c, nn.Embedding) for c in module.children())):
            styles.update(_embedding_styles(unit, module, layouts, stream))
            embedded = True
        elif position < first_block and any(True for _ in module.parameters()):
            # A replicated input module (a ViT's patch embedding): its whole output becomes the stream.
            if _placement(layouts, unit) != Placement.REPLICATE:
                raise unsupported(f"layout {unit}: placement '{_placement(layouts, unit)}' on a {type(module).__name__} "
                                  f"before the blocks cannot be applied")
            style = _convert(None, None, R, stream)
            styles.update({unit: style} if style is not None else {})
        elif any(True for _ in module.parameters()):
            if not isinstance(module, nn.Linear):
                _check_whole_head_ties(unit, module, model, styles)
            styles.update(_head_styles(unit, module, layouts, stream))
    loss_parallel = any(isinstance(style, ColwiseParallel) and not style.use_local_output for style in styles.values())
    return TensorParallelPlan(stream, styles, loss_parallel)


def _check_whole_head_ties(fqn: str, head: nn.Module, model: nn.Module, styles: dict[str, ParallelStyle]) -> None:
    """Raises PlannerError where an output head that runs whole (a container: its layers keep their
    weights whole) shares a weight the plan splits (BERT's decoder tied to the vocabulary-split
    embedding would mix a split weight with whole tensors at the first step)."""
    own = {id(param) for param in head.parameters()}
    for name, style in styles.items():
        if isinstance(style, (ColwiseParallel, RowwiseParallel)) and any(
                id(param) in own for param in model.get_submodule(name).parameters(recurse=False)):
            raise unsupported(f"layout {name}: the plan splits a weight the output head {fqn} ({type(head).__name__}) "
                              f"shares, and Plan.apply runs that head whole; plan with --tp 1 to apply it")
