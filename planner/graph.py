"""Hardware-free facts about a model: layers (the pipeline-cut units) and their ops.

Every number is measured by PyTorch during tracing (`planner.trace`) for one micro-batch of
`ModelGraph.micro_batch` sequences of `ModelGraph.seq_len` tokens; the cost model scales FLOPs and
activation bytes linearly with the micro-batch it prices.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

# Parameters under a submodule of this name are expert weights (`Layer.expert_params`).
EXPERTS_MODULE = "experts"


class Recompute(StrEnum):
    """Activation recompute policy of a layer.

    NONE keeps every tensor autograd saves; SELECTIVE recomputes the attention core (scores,
    softmax, attention-weighted values) so only its inputs and output stay; FULL keeps only the
    layer input and reruns the whole forward during backward. SELECTIVE_OP is torchtitan's
    op-level selective checkpointing (`planner.op_sac`): the attention kernels' outputs and every
    other matmul output stay, the rest of the block is recomputed.
    """

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"
    SELECTIVE_OP = "selective_op"


class LayerKind(StrEnum):
    EMBEDDING = "embedding"
    BLOCK = "block"
    HEAD = "head"
    OTHER = "other"


# Recurrent modules' targets (`module_target` of nn.LSTM, nn.GRU, nn.RNN): their time steps run in
# sequence order.
RECURRENT_TARGETS = frozenset({"lstm", "gru", "rnn"})


def recurrent_targets(layers: Sequence[Layer]) -> tuple[str, ...]:
    """The recurrent modules `layers` run (`RECURRENT_TARGETS`), by target."""
    return tuple(sorted({op.target for layer in layers for op in layer.ops if op.target in RECURRENT_TARGETS}))


class OpKind(StrEnum):
    MATMUL = "matmul"          # linear / mm / bmm: FLOPs dominate
    ATTENTION = "attention"    # scaled-dot-product attention core
    EMBEDDING = "embedding"    # table lookup
    NORM = "norm"              # layer/RMS norm
    ELEMENTWISE = "elementwise"
    LOSS = "loss"
    OTHER = "other"


@dataclass(frozen=True)
class Op:
    """One node of the traced op graph.

    Attributes:
        name: fx node name, unique within the graph.
        fqn: fully qualified name of the module the op belongs to ("" for the root).
        target: what the op calls (e.g. "linear", "scaled_dot_product_attention", "add").
        kind: coarse class used by the cost model and the sharding ILP.
        inputs: names of the producer ops (graph edges).
        out_shape: shape of the (first) output tensor.
        out_bytes: bytes of the outputs.
        fwd_flops: forward FLOPs of this op for the traced micro-batch.
        param_shapes: shapes of the parameters this op reads (e.g. the Linear weight).
        attrs: op-specific facts the sharding ILP needs, e.g. {"heads": 32, "kv_heads": 8} for
            attention, {"in_features": 4096, "out_features": 11008} for a linear.
        takes_grad: its output is floating point and can take a gradient; an op whose output is
            integer or bool (indices, masks, counts) runs no backward.
    """

    name: str
    fqn: str
    target: str
    kind: OpKind
    inputs: tuple[str, ...] = ()
    out_shape: tuple[int, ...] = ()
    out_bytes: int = 0
    fwd_flops: float = 0.0
    param_shapes: tuple[tuple[int, ...], ...] = ()
    attrs: dict = field(default_factory=dict, compare=False, hash=False)
    takes_grad: bool = True


@dataclass(frozen=True)
class Layer:
    """A pipeline-cut unit: the embedding, one repeated block, or the final norm + head + loss.

    Attributes:
        name: display name, e.g. "embed", "layers.3", "head".
        kind: LayerKind.
        fqns: module FQNs covered by this layer (what a pipeline stage lists).
        params: parameter count.
        param_bytes: bytes of the parameters in the traced dtype.
        expert_params: parameters that belong to MoE experts (sharded by expert parallelism).
        frozen_params: parameters outside the experts that take no gradient (`requires_grad=False`):
            no gradients or optimizer states, no gradient reduction, no update (frozen experts are
            priced as trainable).
        bwd_work_fraction: the share of a fully trainable backward the layer runs: its measured
            backward FLOPs over those with every parameter trainable and a gradient reaching its
            input (`planner.measure.PieceCost`); the cost model scales its backward by it.
        buffer_bytes: bytes of the buffers the layer reads (e.g. a precomputed table, batch-norm
            statistics), floating ones in fp32 (`planner.layering.buffer_element_bytes`): on every
            device that holds the layer, whole.
        fwd_flops, bwd_flops: FLOPs of one forward / backward for the traced micro-batch.
        saved_bytes: bytes autograd keeps for backward, per recompute policy.
        out_bytes: bytes of the activation passed to the next layer.
        signature: structural key; identical blocks share it and were measured once.
        ops: the op-level graph of this layer.
    """

    name: str
    kind: LayerKind
    fqns: tuple[str, ...]
    params: int
    param_bytes: int
    fwd_flops: float
    bwd_flops: float
    saved_bytes: dict[Recompute, int]
    out_bytes: int
    signature: str = ""
    expert_params: int = 0
    ops: tuple[Op, ...] = ()
    frozen_params: int = 0
    bwd_work_fraction: float = 1.0
    buffer_bytes: int = 0


@dataclass(frozen=True)
class ModelDims:
    """Architecture facts that decide which parallel degrees are legal (heads for TP, experts for EP)."""

    hidden: int = 0
    heads: int = 0
    kv_heads: int = 0
    layers: int = 0
    vocab: int = 0
    ffn_hidden: int = 0
    experts: int = 0
    top_k: int = 0


@dataclass(frozen=True)
class ModelGraph:
    """Everything the planner knows about a model, measured once and reusable across clusters.

    `trace_method` is how the graph was captured ("fx", "export" or "module"); `notes` says why
    earlier methods failed and any other caveat of the measurement; `tied` lists the module FQNs
    that share one parameter (a tied embedding and output head), one group per shared parameter.
    """

    name: str
    seq_len: int
    micro_batch: int
    dtype: str
    trace_method: str
    layers: tuple[Layer, ...]
    dims: ModelDims = ModelDims()
    notes: tuple[str, ...] = ()
    tied: tuple[tuple[str, ...], ...] = ()

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self.layers)

    @property
    def fwd_flops(self) -> float:
        return sum(layer.fwd_flops for layer in self.layers)

    @property
    def bwd_flops(self) -> float:
        return sum(layer.bwd_flops for layer in self.layers)

    @functools.cached_property
    def recurrent_targets(self) -> tuple[str, ...]:
        return recurrent_targets(self.layers)

    @property
    def blocks(self) -> tuple[Layer, ...]:
        return tuple(layer for layer in self.layers if layer.kind == LayerKind.BLOCK)

    def recompute_notes(self, recompute: Recompute) -> tuple[str, ...]:
        """A note when `recompute` is asked of a model none of whose layers is a block: recompute
        applies to blocks only, so nothing is recomputed."""
        if recompute == Recompute.NONE or self.blocks:
            return ()
        return (f"recompute={recompute} recomputes blocks, and no layer of this model is one (blocks are the "
                f"structurally identical children of an nn.ModuleList or nn.Sequential), so nothing is recomputed",)

    @functools.cached_property
    def tied_users(self) -> tuple[tuple[tuple[int, Op], ...], ...]:
        """Per group of `tied`, the (layer index, op) of each module using the shared weight, in layer
        order: the first owns it, the later ones reuse it."""
        where = {op.fqn: (index, op) for index, layer in enumerate(self.layers) for op in layer.ops if op.param_shapes}
        return tuple(tuple(sorted((where[fqn] for fqn in group if fqn in where), key=lambda user: user[0]))
                     for group in self.tied)

    @functools.cached_property
    def stage_copy_params(self) -> tuple[int, ...]:
        """Per layer, the parameters of the weights it shares with an earlier layer (a head tied to the
        embedding). Split over pipeline stages, the later layer's stage holds its own copy (Megatron-LM
        and Plan.apply tie them so; `layers[i].params` counts a shared weight once, where first used)."""
        copies = [0] * len(self.layers)
        for users in self.tied_users:
            for index, op in users[1:]:
                shared = set(users[0][1].param_shapes) & set(op.param_shapes)
                copies[index] += sum(math.prod(shape) for shape in shared)
        return tuple(copies)

    @functools.cached_property
    def recompute_policies(self) -> tuple[Recompute, ...]:
        """Recompute policies measured and priced on every layer, computed once per graph (every
        configuration check asks). Op-level checkpointing needs an fx/export trace; so does pricing
        selective recompute, whose rerun is the attention ops' time: a module-level trace measures
        what it drops but has no attention op inside a module to time."""
        return tuple(policy for policy in Recompute if all(policy in layer.saved_bytes for layer in self.layers)
                     and not (policy is Recompute.SELECTIVE and self.trace_method == "module"))

    @functools.cached_property
    def stream_tokens(self) -> int:
        """Tokens per sequence in the stream between blocks, which sequence parallelism splits: the
        first block's first (batch, tokens, features) output (a ViT's patches and class token, where
        `seq_len` counts one token per image); `seq_len` without such an op."""
        shapes = (op.out_shape for layer in self.layers if layer.kind == LayerKind.BLOCK for op in layer.ops)
        return next((shape[1] for shape in shapes if len(shape) == 3), self.seq_len)
