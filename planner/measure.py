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
  substitutes what the CUDA kernel keeps (`_GpuKernelSaves`).

`run_eager` is the module-level fallback: one real forward and backward of a whole model on the
CPU, attributed to modules by hooks.

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
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from planner.graph import Recompute

# The CPU device: under FakeTensorMode, bf16 SDPA on it dispatches to the flash-like kernel whose
# saved tensors match flash attention on GPUs (measured, TOOLCHAIN.md). Fake CUDA tensors abort
# this CPU build of PyTorch.
SAVED_BYTES_DEVICE = torch.device("cpu")
_META = torch.device("meta")
_RMS_NORM_FUNCS = frozenset({F.rms_norm, torch.ops.aten.rms_norm.default})
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
    """

    fwd_flops: float
    bwd_flops: float
    saved_bytes: dict[Recompute, int]
    in_bytes: int
    out_bytes: int


def measure_piece(module: nn.Module, args: tuple, *, data_args: frozenset[int] = frozenset()
                  ) -> PieceCost:
    """Counts FLOPs and saved-activation bytes of `module(*args)`.

    Args:
        module: a module whose parameters and buffers are on `meta` (never modified).
        args: example inputs; tensors on `meta`. Floating tensors are activations that require
            grad, like a layer's input during training, unless listed in `data_args`.
        data_args: positions of the args that are training data (the model's own inputs, such
            as images), which need no gradient.

    Returns:
        The PieceCost of one forward and backward.
    """
    args = tuple(_as_input(arg, i not in data_args) for i, arg in enumerate(args))
    fwd_flops, bwd_flops, out = _count_flops(module, args)
    in_bytes = storage_bytes(args)
    saved = _saved_bytes_by_policy(module, args)
    saved[Recompute.FULL] = in_bytes
    return PieceCost(fwd_flops=float(fwd_flops), bwd_flops=float(bwd_flops), saved_bytes=saved,
                     in_bytes=in_bytes, out_bytes=storage_bytes(out))


def storage_bytes(tree: object) -> int:
    """Bytes of the distinct storages behind the tensors in a pytree."""
    sizes = {}
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            storage = leaf.untyped_storage()
            sizes[storage._cdata] = storage.nbytes()
    return sum(sizes.values())


def _as_input(arg: object, activation: bool) -> object:
    """Detached copies of the tensors in `arg`; floating ones require grad if `activation`."""
    return pytree.tree_map_only(
        torch.Tensor, lambda t: t.detach().requires_grad_(activation and t.is_floating_point()),
        arg)


def _count_flops(module: nn.Module, args: tuple) -> tuple[int, int, object]:
    with _grads_kept(module), FlopCounterMode(display=False) as counter:
        out = module(*args)
        fwd_flops = counter.get_total_flops()
        _backward(out)
        total_flops = counter.get_total_flops()
    return fwd_flops, total_flops - fwd_flops, out


def _backward(out: object) -> None:
    """Backward from every output that requires grad. (Not autograd.grad, which the module
    hooks of FlopCounterMode reject; callers restore the parameters' .grad.)"""
    outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
               and t.requires_grad]
    if outputs:
        torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])


@contextmanager
def _grads_kept(module: nn.Module) -> Iterator[None]:
    """Restores every parameter's .grad after a measuring backward."""
    before = [(param, param.grad) for param in module.parameters()]
    try:
        yield
    finally:
        for param, grad in before:
            param.grad = grad


def _saved_bytes_by_policy(module: nn.Module, args: tuple) -> dict[Recompute, int]:
    saved: list[tuple[torch.Tensor, bool]] = []
    with FakeTensorMode():
        fakes: dict[int, torch.Tensor] = {}
        state = {name: _fake_cpu(t, fakes, t.requires_grad)
                 for name, t in [*module.named_parameters(remove_duplicate=False),
                                 *module.named_buffers(remove_duplicate=False)]}
        fake_args = pytree.tree_map_only(
            torch.Tensor, lambda t: _fake_cpu(t, fakes, t.requires_grad), args)
        core = _AttentionCoreMarker()

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append((t, core.inside))
            return t

        with _GpuKernelSaves(), core, torch.autograd.graph.saved_tensors_hooks(
                pack, lambda t: t):
            torch.func.functional_call(module, state, fake_args)
    weights = {t.untyped_storage()._cdata for t in state.values()}
    return _policy_bytes(saved, weights, core.input_storages)


def _policy_bytes(saved: list[tuple[torch.Tensor, bool]], weights: set[int],
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


class _AttentionCoreMarker(TorchFunctionMode):
    """Flags the tensors autograd saves inside scaled-dot-product attention calls.

    Attributes:
        inside: True while an attention core runs (read by the pack hook).
        input_storages: storages of the tensors passed to attention cores (q, k, v, mask).
    """

    def __init__(self):
        super().__init__()
        self.inside = False
        self.input_storages: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _ATTENTION_CORE_FUNCS:
            return func(*args, **kwargs)
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                self.input_storages.add(t.untyped_storage()._cdata)
        self.inside = True
        try:
            return func(*args, **kwargs)
        finally:
            self.inside = False


class _GpuKernelSaves(TorchFunctionMode):
    """Makes the fake CPU run keep for backward what the GPU kernels keep.

    - RMSNorm: the CPU kernel decomposes and keeps fp32 copies of its input and output (8 bytes
      per element); the fused CUDA kernel (`aten._fused_rms_norm`) keeps only its input and the
      fp32 reciprocal RMS per row, which `_FusedRMSNorm` reproduces.
    - Factory calls that name the `meta` device, which `torch.export` bakes into graphs traced
      from a meta model (`aten.arange(..., device=meta)`), create their tensors on the CPU.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _RMS_NORM_FUNCS:
            return _fused_rms_norm(*args, **kwargs)
        if kwargs.get("device") == _META:
            kwargs = {**kwargs, "device": SAVED_BYTES_DEVICE}
        return func(*args, **kwargs)


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


# --- module-level fallback: one eager run of the whole model --------------------------------


class ModuleRunError(Exception):
    """An eager run failed; `fqn` names the innermost module running ("" for the root) and
    `__cause__` holds the original error."""

    def __init__(self, fqn: str):
        super().__init__(fqn)
        self.fqn = fqn


@dataclass(frozen=True)
class LeafCall:
    """One call of a leaf module (a module without children) during an eager run.

    Attributes:
        name: unique op name: the FQN with dots as underscores, plus `_<n>` for repeat calls.
        fqn: the module's FQN.
        module: the module.
        inputs: indices of the earlier calls whose outputs this call reads.
        out_shape: shape of the first output tensor.
        out_bytes: bytes of the output tensors.
        fwd_flops: forward FLOPs of the call.
    """

    name: str
    fqn: str
    module: nn.Module
    inputs: tuple[int, ...]
    out_shape: tuple[int, ...]
    out_bytes: int
    fwd_flops: float


@dataclass(frozen=True)
class EagerRun:
    """What one eager forward and backward of a whole model showed, attributed to modules.

    Attributes:
        calls: leaf-module calls in run order.
        module_flops: module FQN -> (forward, backward) FLOPs including its submodules; "" is
            the whole model, functional code outside modules included.
        saved: (tensor autograd saved, whether inside an attention core, index of the latest
            leaf call started when it was saved; -1 before the first).
        weights: storages of parameters and buffers.
        core_inputs: storages of the tensors passed to attention cores.
        in_bytes: module FQN -> bytes of the tensor inputs of its first call.
        out_bytes: module FQN -> bytes of the tensor outputs of its last call.
    """

    calls: tuple[LeafCall, ...]
    module_flops: dict[str, tuple[float, float]]
    saved: tuple[tuple[torch.Tensor, bool, int], ...]
    weights: frozenset[int]
    core_inputs: frozenset[int]
    in_bytes: dict[str, int]
    out_bytes: dict[str, int]

    def saved_bytes(self, during_call: Callable[[int], bool]) -> dict[Recompute, int]:
        """NONE and SELECTIVE bytes of the tensors saved while `during_call(call index)`."""
        chosen = [(t, in_core) for t, in_core, call in self.saved if during_call(call)]
        return _policy_bytes(chosen, set(self.weights), set(self.core_inputs))


def run_eager(model: nn.Module, inputs: tuple) -> EagerRun:
    """Runs `model(*inputs)` for real, forward and backward, recording leaf calls and costs.

    Two forwards run: one under FlopCounterMode with the math attention backend (so attention
    FLOPs are counted, as on meta) followed by a backward, and one under saved-tensor hooks with
    the default backend (flash-like on the CPU) for saved bytes.

    Args:
        model: a module with real (CPU) weights; it may branch on tensor values.
        inputs: real input tensors.

    Returns:
        The EagerRun.

    Raises:
        ModuleRunError: when the model fails, naming the innermost running module.
    """
    names = {m: fqn for fqn, m in model.named_modules()}
    recorder = _CallRecorder(names)
    with _grads_kept(model), recorder.hooks(model), FlopCounterMode(display=False) as counter:
        with sdpa_kernel(SDPBackend.MATH):
            recorder.counter = counter
            out = recorder.guarded(model, inputs)
            fwd = _flops_by_module(counter, model, names)
        _backward(out)
        total = _flops_by_module(counter, model, names)
    calls, in_bytes, out_bytes = recorder.calls, recorder.in_bytes, recorder.out_bytes
    saved: list[tuple[torch.Tensor, bool, int]] = []
    recorder = _CallRecorder(names)
    core = _AttentionCoreMarker()

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((t, core.inside, recorder.started - 1))
        return t

    with recorder.hooks(model), _GpuKernelSaves(), core, torch.autograd.graph.saved_tensors_hooks(
            pack, lambda t: t):
        recorder.guarded(model, inputs)
    return EagerRun(
        calls=tuple(calls),
        module_flops={fqn: (fwd.get(fqn, 0), total.get(fqn, 0) - fwd.get(fqn, 0))
                      for fqn in names.values()},
        saved=tuple(saved),
        weights=frozenset(t.untyped_storage()._cdata
                          for t in [*model.parameters(), *model.buffers()]),
        core_inputs=frozenset(core.input_storages),
        in_bytes=in_bytes, out_bytes=out_bytes)


def _flops_by_module(counter: FlopCounterMode, model: nn.Module,
                     names: dict[nn.Module, str]) -> dict[str, int]:
    """FlopCounterMode's per-module totals keyed by FQN ("" = everything)."""
    counts = {key: sum(ops.values()) for key, ops in counter.get_flop_counts().items()}
    root = type(model).__name__
    by_fqn = {fqn: counts.get(f"{root}.{fqn}", 0) for fqn in names.values() if fqn}
    by_fqn[""] = counts.get("Global", 0)
    return by_fqn


class _CallRecorder:
    """Forward hooks that record leaf calls and keep the stack of running modules.

    Attributes:
        counter: FlopCounterMode to read per-call forward FLOPs from, if any.
        calls: finished leaf calls in run order.
        started: leaf calls started so far (the index of the running one plus one).
        stack: FQNs of the modules running now, outermost first.
    """

    def __init__(self, names: dict[nn.Module, str]):
        self.names = names
        self.counter: FlopCounterMode | None = None
        self.calls: list[LeafCall] = []
        self.started = 0
        self.in_bytes: dict[str, int] = {}
        self.out_bytes: dict[str, int] = {}
        self.stack: list[str] = []
        self._pending: tuple[int, tuple[int, ...]] = (0, ())
        self._producers: dict[int, int] = {}
        self._repeats: dict[str, int] = {}
        self._outputs: list[object] = []

    @contextmanager
    def hooks(self, model: nn.Module) -> Iterator[None]:
        handles = []
        for module in model.modules():
            handles.append(module.register_forward_pre_hook(self._enter, with_kwargs=True))
            handles.append(module.register_forward_hook(self._exit, with_kwargs=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def guarded(self, model: nn.Module, inputs: tuple) -> object:
        try:
            return model(*inputs)
        except Exception as exc:  # noqa: BLE001 - user code may raise anything
            raise ModuleRunError(self.stack[-1] if self.stack else "") from exc

    def _flops(self) -> int:
        return self.counter.get_total_flops() if self.counter else 0

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        fqn = self.names[module]
        self.stack.append(fqn)
        self.in_bytes.setdefault(fqn, storage_bytes((args, kwargs)))
        if next(module.children(), None) is None:
            producers = tuple(dict.fromkeys(
                self._producers[id(t)] for t in pytree.tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor) and id(t) in self._producers))
            self._pending = (self._flops(), producers)
            self.started += 1

    def _exit(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        fqn = self.stack.pop()
        self.out_bytes[fqn] = storage_bytes(output)
        if next(module.children(), None) is not None:
            return
        flops_before, producers = self._pending
        tensors = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
        repeat = self._repeats.get(fqn, 0)
        self._repeats[fqn] = repeat + 1
        self._outputs.append(output)  # keeps the tensors alive so their ids stay unique
        for t in tensors:
            self._producers[id(t)] = len(self.calls)
        self.calls.append(LeafCall(
            name=fqn.replace(".", "_") + (f"_{repeat}" if repeat else ""), fqn=fqn,
            module=module, inputs=producers,
            out_shape=tuple(tensors[0].shape) if tensors else (),
            out_bytes=sum(t.numel() * t.element_size() for t in tensors),
            fwd_flops=float(self._flops() - flops_before)))
