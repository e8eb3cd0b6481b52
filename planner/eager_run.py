"""The module-level fallback's measurement: one eager run of a whole model, attributed to modules.

`run_eager` runs a model with real (CPU) weights forward and backward, recording every leaf-module
call (forward hooks) with its FLOPs (`FlopCounterMode`) and the tensors autograd saves during it
(saved-tensor hooks, counted by the same policies as `planner.measure`). Only an eager run can
follow control flow on tensor values, which defeats `torch.fx` and `torch.export`.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from planner.graph import Recompute
from planner.measure import (AttentionCoreMarker, GpuKernelSaves, ModuleRunError, NoGradOutputError, grads_kept,
                             policy_bytes, run_backward, storage_bytes, tensor_leaves)

aten = torch.ops.aten


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
        return policy_bytes(chosen, set(self.weights), set(self.core_inputs))


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
        NoGradOutputError: when a model with trainable parameters returns no tensor that
            requires grad (no backward to measure).
    """
    names = {m: fqn for fqn, m in model.named_modules()}
    recorder = _CallRecorder(names)
    with grads_kept(model), recorder.hooks(model), FlopCounterMode(display=False) as counter, _Fp32Matmuls():
        with sdpa_kernel(SDPBackend.MATH):
            recorder.counter = counter
            out = recorder.guarded(model, inputs)
            fwd = _flops_by_module(counter, model, names)
        if not run_backward(out) and any(param.requires_grad for param in model.parameters()):
            raise NoGradOutputError(type(out).__name__)
        total = _flops_by_module(counter, model, names)
    calls, in_bytes, out_bytes = recorder.calls, recorder.in_bytes, recorder.out_bytes
    saved: list[tuple[torch.Tensor, bool, int]] = []
    recorder = _CallRecorder(names)
    core = AttentionCoreMarker()

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((t, core.inside, recorder.started - 1))
        return t

    with recorder.hooks(model), GpuKernelSaves(), core, _Fp32Matmuls(), torch.autograd.graph.saved_tensors_hooks(
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


# Matrix products the CPU runs slowly in half precision (bf16 GEMMs at 0.9 GFLOP/s against 62 in
# fp32 on the 2-core development machine: `_Fp32Matmuls`).
_MATMULS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
                      aten.mv.default, aten.addmv.default})
_HALF_DTYPES = (torch.bfloat16, torch.float16)


class _Fp32Matmuls(TorchDispatchMode):
    """Runs half-precision matrix products of the eager run in fp32 and rounds their results back,
    so a model measured in bf16 runs at the CPU's fp32 GEMM speed. Below autograd: the tensors it
    keeps and their dtypes, the shapes and the FLOPs counted are unchanged; values differ only by
    the rounding of the inner sums."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _MATMULS:
            return func(*args, **kwargs)
        half = next((t.dtype for t in pytree.tree_leaves((args, kwargs))
                     if isinstance(t, torch.Tensor) and t.dtype in _HALF_DTYPES), None)
        if half is None:
            return func(*args, **kwargs)
        upcast = pytree.tree_map_only(torch.Tensor, lambda t: t.float() if t.dtype in _HALF_DTYPES else t, (args, kwargs))
        return func(*upcast[0], **upcast[1]).to(half)


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
        tensors = tensor_leaves(output)
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
