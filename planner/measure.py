"""Measures pieces of a model: FLOPs and the bytes autograd keeps for backward.

`measure_piece` measures one standalone piece (an fx partition holding one layer) whose
parameters and example inputs are on `meta`; PyTorch does the measuring:

- FLOPs: `torch.utils.flop_counter.FlopCounterMode` around a forward and a backward on `meta`.
  On meta, scaled-dot-product attention runs its math decomposition, which the counter prices
  exactly (QK^T and AV, no causal halving; TOOLCHAIN.md).
- Saved bytes: `torch.autograd.graph.saved_tensors_hooks` around a forward under
  `FakeTensorMode` on the CPU device, where attention takes the flash-like path and keeps what
  flash attention keeps on a GPU (q, k, v, output and log-sum-exp, no s x s matrices). Saved
  tensors are deduplicated by storage; parameters and buffers are skipped (they are weights, not
  activations). Where a CPU kernel keeps more than its CUDA counterpart (RMSNorm), the run
  substitutes what the CUDA kernel keeps (`GpuKernelSaves`).

`planner.eager_run` (the module-level fallback) reuses the saved-tensor accounting
(`policy_bytes`, `AttentionCoreMarker`, `GpuKernelSaves`) and the backward helpers here.

Recompute policies (`planner.graph.Recompute`), from the same forward:

- NONE: every storage autograd saves.
- SELECTIVE: the attention core (each `scaled_dot_product_attention` call) is recomputed in
  backward, as in Korthikanti et al. 2022. A storage saved only by the core is dropped unless it
  is one of the core's inputs (q, k, v, mask), which recomputation needs; storages that other ops
  save too (the core output, saved again by the output projection) stay. With the flash-like
  path this drops only the log-sum-exp, because flash attention never keeps s x s scores; with a
  hand-written attention (matmul + softmax) nothing is recognised as the core and SELECTIVE
  equals NONE.
- FULL: only the piece's input tensors (the activation checkpoint of the layer).
- SELECTIVE_OP: the piece's inputs plus the outputs torchtitan's op-level policy keeps
  (`planner.op_sac`), recorded op by op in the same forward (`OpSacRecorder`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from planner.graph import Recompute
from planner.op_sac import OpSacCounter

# The CPU device: under FakeTensorMode, bf16 SDPA on it dispatches to the flash-like kernel whose
# saved tensors match flash attention on GPUs (measured, TOOLCHAIN.md). Fake CUDA tensors abort
# this CPU build of PyTorch.
SAVED_BYTES_DEVICE = torch.device("cpu")
_META = torch.device("meta")
_RMS_NORM_FUNCS = frozenset({F.rms_norm, torch.ops.aten.rms_norm.default})
# Position of `dropout_p` in scaled_dot_product_attention's arguments (query, key, value, attn_mask, dropout_p).
SDPA_DROPOUT_ARG = 4
# Out-of-place dropout, (input, p, training) in this order (F.dropout also takes `inplace`).
_DROPOUT_FUNCS = frozenset({F.dropout, torch.dropout, torch.ops.aten.dropout.default})
_ATTENTION_CORE_FUNCS = frozenset({
    F.scaled_dot_product_attention,
    torch.ops.aten.scaled_dot_product_attention.default,
})


@dataclass(frozen=True)
class PieceCost:
    """What one forward and backward of a piece costs, for the example inputs it was run on.

    Attributes:
        fwd_flops, bwd_flops: FLOPs of the forward and of the backward (input and weight grads).
        saved_bytes: bytes autograd keeps between forward and backward, per recompute policy.
        in_bytes: bytes of the piece's tensor inputs (deduplicated by storage).
        out_bytes: bytes of the piece's tensor outputs (deduplicated by storage).
        bwd_work_fraction: `bwd_flops` over the backward FLOPs of the same piece with every
            parameter trainable and every floating input needing a gradient: the share of a fully
            trainable backward that runs (1 when nothing is frozen or data; 0 when no gradient
            flows through the piece).
    """

    fwd_flops: float
    bwd_flops: float
    saved_bytes: dict[Recompute, int]
    in_bytes: int
    out_bytes: int
    bwd_work_fraction: float = 1.0


class NoGradOutputError(Exception):
    """A trainable model returned no tensor that requires grad (the message names what it returned)."""


class ModuleRunError(Exception):
    """Running model code failed; `fqn` names the innermost module running ("" for the root) and
    `__cause__` holds the original error."""

    def __init__(self, fqn: str):
        super().__init__(fqn)
        self.fqn = fqn


def measure_piece(module: nn.Module, args: tuple, *, data_args: frozenset[int] = frozenset()
                  ) -> PieceCost:
    """Counts FLOPs and saved-activation bytes of `module(*args)`.

    Args:
        module: a module whose parameters and buffers are on `meta` (left as they were).
        args: example inputs; tensors on `meta`. Floating tensors are activations that require
            grad, like a layer's input during training, unless listed in `data_args`.
        data_args: positions of the args that need no gradient: training data (the model's own
            inputs, such as images), or activations of layers before which nothing trains.

    Returns:
        The PieceCost of one forward and backward.
    """
    inputs = tuple(_as_input(arg, i not in data_args) for i, arg in enumerate(args))
    fwd_flops, bwd_flops, out = _count_flops(module, inputs)
    fraction = 1.0
    float_data = any(t.is_floating_point() for i in data_args for t in pytree.tree_leaves(args[i]) if isinstance(t, torch.Tensor))
    if float_data or not all(p.requires_grad for p in module.parameters()):
        with all_trainable(module):
            trainable_bwd_flops = _count_flops(module, tuple(_as_input(arg, True) for arg in args))[1]
        fraction = bwd_flops / trainable_bwd_flops if trainable_bwd_flops else 1.0
    in_bytes = storage_bytes(inputs)
    saved, op_sac_kept = _saved_bytes_by_policy(module, inputs)
    # A checkpointed region keeps its inputs (and op-level checkpointing its kept outputs) only for
    # a backward; none runs through a piece whose outputs need no gradient.
    grad_out = any(t.requires_grad for t in tensor_leaves(out))
    saved[Recompute.FULL] = in_bytes if grad_out else 0
    saved[Recompute.SELECTIVE_OP] = in_bytes + op_sac_kept if grad_out else 0
    return PieceCost(fwd_flops=float(fwd_flops), bwd_flops=float(bwd_flops), saved_bytes=saved,
                     in_bytes=in_bytes, out_bytes=storage_bytes(out), bwd_work_fraction=fraction)


def tensor_leaves(value: object) -> list[torch.Tensor]:
    """The tensors in a model's or module's output: inside tuples, lists, mappings (Hugging Face's
    `ModelOutput` is an OrderedDict) and dataclasses, which torch's pytree leaves whole unless
    registered."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        items = list(value.values())
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [getattr(value, field.name) for field in dataclasses.fields(value)]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        return []
    return [tensor for item in items for tensor in tensor_leaves(item)]


def storage_bytes(tree: object) -> int:
    """Bytes of the distinct storages behind the tensors in `tree` (`tensor_leaves`)."""
    sizes = {}
    for leaf in tensor_leaves(tree):
        storage = leaf.untyped_storage()
        sizes[storage._cdata] = storage.nbytes()
    return sum(sizes.values())


def _as_input(arg: object, activation: bool) -> object:
    """Detached copies of the tensors in `arg`; floating ones require grad if `activation`."""
    return pytree.tree_map_only(
        torch.Tensor, lambda t: t.detach().requires_grad_(activation and t.is_floating_point()),
        arg)


def _count_flops(module: nn.Module, args: tuple) -> tuple[int, int, object]:
    with grads_kept(module), FlopCounterMode(display=False) as counter:
        out = module(*args)
        fwd_flops = counter.get_total_flops()
        run_backward(out)
        total_flops = counter.get_total_flops()
    return fwd_flops, total_flops - fwd_flops, out


def run_backward(out: object) -> int:
    """Backward from every output tensor that requires grad (`tensor_leaves`); returns how many
    there were. (Not autograd.grad, which the module hooks of FlopCounterMode reject; callers
    restore the parameters' .grad.)"""
    outputs = [t for t in tensor_leaves(out) if t.requires_grad]
    if outputs:
        torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
    return len(outputs)


@contextmanager
def all_trainable(module: nn.Module) -> Iterator[None]:
    """Inside, every parameter of `module` requires grad; afterwards the frozen ones are frozen again."""
    frozen = [p for p in module.parameters() if not p.requires_grad]
    try:
        for param in frozen:
            param.requires_grad_(True)
        yield
    finally:
        for param in frozen:
            param.requires_grad_(False)


@contextmanager
def grads_kept(module: nn.Module) -> Iterator[None]:
    """Restores every parameter's .grad after a measuring backward."""
    before = [(param, param.grad) for param in module.parameters()]
    try:
        yield
    finally:
        for param, grad in before:
            param.grad = grad


class OpSacRecorder(TorchDispatchMode):
    """Bytes of the distinct storages torchtitan's op-level policy keeps in one forward (`planner.op_sac`)."""

    def __init__(self) -> None:
        super().__init__()
        self.counter = OpSacCounter()
        self.kept: dict[int, int] = {}
        self._held: list = []  # the kept storages, alive so that no later storage reuses a key of `kept`

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.counter.keeps(func):
            for leaf in pytree.tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    storage = leaf.untyped_storage()
                    self._held.append(storage)
                    self.kept[storage._cdata] = storage.nbytes()
        return out


def _saved_bytes_by_policy(module: nn.Module, args: tuple) -> tuple[dict[Recompute, int], int]:
    """NONE and SELECTIVE bytes (`policy_bytes`) and the bytes op-level checkpointing keeps besides the inputs."""
    saved: list[tuple[torch.Tensor, bool]] = []
    with FakeTensorMode():
        fakes: dict[int, torch.Tensor] = {}
        state = {name: _fake_cpu(t, fakes, t.requires_grad)
                 for name, t in [*module.named_parameters(remove_duplicate=False),
                                 *module.named_buffers(remove_duplicate=False)]}
        fake_args = pytree.tree_map_only(
            torch.Tensor, lambda t: _fake_cpu(t, fakes, t.requires_grad), args)
        core = AttentionCoreMarker()

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append((t, core.inside))
            return t

        with GpuKernelSaves(), core, torch.autograd.graph.saved_tensors_hooks(
                pack, lambda t: t), OpSacRecorder() as op_sac:
            torch.func.functional_call(module, state, fake_args)
    weights = {t.untyped_storage()._cdata for t in state.values()}
    return policy_bytes(saved, weights, core.input_storages), sum(op_sac.kept.values())


def policy_bytes(saved: list[tuple[torch.Tensor, bool]], weights: set[int],
                 core_inputs: set[int]) -> dict[Recompute, int]:
    """NONE and SELECTIVE bytes of saved (tensor, saved inside an attention core) pairs."""
    activations: dict[int, int] = {}
    outside_core: set[int] = set()
    for tensor, in_core in saved:
        storage = tensor.untyped_storage()
        if storage._cdata in weights:
            continue
        activations[storage._cdata] = storage.nbytes()
        if not in_core:
            outside_core.add(storage._cdata)
    kept_selective = outside_core | core_inputs
    return {
        Recompute.NONE: sum(activations.values()),
        Recompute.SELECTIVE: sum(n for key, n in activations.items() if key in kept_selective),
    }


def _fake_cpu(t: torch.Tensor, fakes: dict[int, torch.Tensor], requires_grad: bool) -> torch.Tensor:
    """A fake CPU tensor shaped like `t` (call inside FakeTensorMode); one per distinct `t`."""
    if id(t) not in fakes:
        fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=SAVED_BYTES_DEVICE)
        fakes[id(t)] = fake.requires_grad_(requires_grad)
    return fakes[id(t)]


class AttentionCoreMarker(TorchFunctionMode):
    """Flags the tensors autograd saves inside scaled-dot-product attention calls.

    Attributes:
        inside: True while an attention core runs (read by the pack hook).
        input_storages: storages of the tensors passed to attention cores (q, k, v, mask).
    """

    def __init__(self):
        super().__init__()
        self.inside = False
        self.input_storages: set[int] = set()
        self._held: list = []  # those storages, alive so that no later storage reuses their keys

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _ATTENTION_CORE_FUNCS:
            return func(*args, **kwargs)
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                self._held.append(t.untyped_storage())
                self.input_storages.add(t.untyped_storage()._cdata)
        self.inside = True
        try:
            return func(*args, **kwargs)
        finally:
            self.inside = False


class GpuKernelSaves(TorchFunctionMode):
    """Makes the fake CPU run keep for backward what the GPU kernels keep.

    - RMSNorm: the CPU kernel decomposes and keeps fp32 copies of its input and output (8 bytes
      per element); the fused CUDA kernel (`aten._fused_rms_norm`) keeps only its input and the
      fp32 reciprocal RMS per row, which `_FusedRMSNorm` reproduces.
    - Dropout: off CUDA, `aten.dropout` multiplies by a mask in the input's dtype and keeps it
      (2 bytes per element in bf16); on CUDA it runs `aten.native_dropout`, which keeps a bool
      mask (1 byte), and so does this run.
    - Attention with dropout: the CPU runs the math path in fp32 and keeps s x s matrices; CUDA's
      flash, memory-efficient and cuDNN kernels draw the dropout mask from a saved RNG offset and
      keep what they keep without dropout, which this run measures by dropping nothing.
    - Factory calls that name the `meta` device, which `torch.export` bakes into graphs traced
      from a meta model (`aten.arange(..., device=meta)`), create their tensors on the CPU.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _RMS_NORM_FUNCS:
            return _fused_rms_norm(*args, **kwargs)
        if func in _DROPOUT_FUNCS:
            return _cuda_dropout(func, args, kwargs)
        if func in _ATTENTION_CORE_FUNCS:
            args, kwargs = _without_dropout(args, kwargs)
        if kwargs.get("device") == _META:
            kwargs = {**kwargs, "device": SAVED_BYTES_DEVICE}
        return func(*args, **kwargs)


def _cuda_dropout(func, args: tuple, kwargs: dict) -> torch.Tensor:
    """Dropout as ATen runs it on CUDA: out of place, in training and with 0 < p < 1 it is
    `native_dropout`, saving a bool mask; otherwise (in place, or nothing to drop) as called."""
    names = ("input", "p", "training", "inplace")
    bound = {**dict(zip(names, args)), **kwargs}
    bound.setdefault("train", bound.pop("training", True))
    p = bound.get("p", 0.5)
    if bound["train"] and 0 < p < 1 and not bound.get("inplace", False) and bound["input"].numel():
        return torch.native_dropout(bound["input"], p, True)[0]
    return func(*args, **kwargs)


def _without_dropout(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Scaled-dot-product attention's arguments with `dropout_p` (its fifth) set to 0."""
    if len(args) > SDPA_DROPOUT_ARG:
        return (*args[:SDPA_DROPOUT_ARG], 0.0, *args[SDPA_DROPOUT_ARG + 1:]), kwargs
    return args, {**kwargs, "dropout_p": 0.0} if "dropout_p" in kwargs else kwargs


def _fused_rms_norm(input: torch.Tensor, normalized_shape: Sequence[int],
                    weight: torch.Tensor | None = None, eps: float | None = None) -> torch.Tensor:
    """F.rms_norm's signature, saving for backward what the fused CUDA kernel saves."""
    dims = tuple(range(-len(normalized_shape), 0))
    return _FusedRMSNorm.apply(input, weight, dims,
                               torch.finfo(input.dtype).eps if eps is None else eps)


class _FusedRMSNorm(torch.autograd.Function):
    """RMSNorm whose forward saves (input, fp32 reciprocal RMS). Only its forward runs: the
    saved-bytes measurement never calls backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, dims: tuple[int, ...],
                eps: float) -> torch.Tensor:
        rstd = torch.rsqrt(x.float().pow(2).mean(dims, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, weight)
        out = (x.float() * rstd).to(x.dtype)
        return out if weight is None else out * weight
