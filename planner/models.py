"""Resolves what the user calls a model into a ModelSource (a recipe the tracer can build).

A model is one of:

- a built-in name (`paraplan models`, e.g. "llama3-8b");
- a spec file path ending in .yaml, .yml or .json (keys in `planner.zoo.spec`);
- "package.module:factory": a callable taking no arguments, or `seq_len=` and/or `micro_batch=`
  when its signature accepts them, returning an nn.Module or a pair (module, example_inputs);
- a ModelSpec, or an nn.Module instance (with example inputs, unless it starts with an
  embedding).

Factories are called once here, under `torch.device("meta")`, to check what they return; then
again by `ModelSource.build` under the tracer's device and dtype context (meta, or FakeTensorMode
with a bf16 default dtype), so they must build on the ambient device without `.to()` or loading
weights, and be cheap to call repeatedly. Example inputs are re-created as zero tensors of the
same shapes and dtypes on the device the tracer asks for; values are never read for planning.

Example::

    >>> source = resolve_model("gpt2")
    >>> import torch
    >>> with torch.device("meta"):
    ...     model = source.build(seq_len=1024)
    >>> source.example_inputs(2, 1024, torch.device("meta"))[0].shape
    torch.Size([2, 1024])
"""
from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import warnings
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from planner.errors import invalid
from planner.source import ModelSource
from planner.zoo import build_model, example_inputs as zoo_example_inputs, zoo_specs
from planner.zoo.spec import LEARNED_POSITION_ARCHS, ModelSpec, load_spec

SPEC_SUFFIXES = (".yaml", ".yml", ".json")
_FACTORY_KWARGS = ("seq_len", "micro_batch")
# Tokens per sample of fixed inputs without a sequence (an image, a feature vector): throughput and
# FLOPs per token are then per sample.
NO_SEQUENCE_SEQ_LEN = 1
_SOURCE_DEFAULT_SEQ_LEN = next(f.default for f in fields(ModelSource)
                               if f.name == "default_seq_len")
# Micro-batch passed to a factory that accepts `micro_batch` but gives it no default.
_PROBE_MICRO_BATCH = 1
_NEAREST_NAMES = 3


def list_models() -> list[str]:
    """Names of the built-in models, grouped by family (gpt, llama, moe, bert, vit), small first."""
    return list(zoo_specs())


def resolve_model(model: str | nn.Module | ModelSpec,
                  example_inputs: tuple | torch.Tensor | None = None) -> ModelSource:
    """Turns a model reference into a ModelSource.

    Args:
        model: a built-in name, a spec file path, "package.module:factory", a ModelSpec, an
            nn.Module, or a pair (nn.Module, example_inputs).
        example_inputs: forward inputs for an nn.Module, or for a factory that returns a module
            alone; only their shapes and dtypes are used. Not accepted for built-in and spec
            models, whose inputs are known.

    Returns:
        The ModelSource (dims filled in for built-in and spec models).

    Raises:
        PlannerError: INVALID_INPUT with a one-line message naming the fix.
    """
    if isinstance(model, tuple) and len(model) == 2 and isinstance(model[0], nn.Module):
        if example_inputs is not None:
            raise invalid("model: a (module, example_inputs) pair and example_inputs both given; fix: pass one of them")
        model, example_inputs = model
    if isinstance(model, nn.Module):
        return _module_source(model, type(model).__name__, example_inputs)
    if isinstance(model, ModelSpec):
        return _spec_source(model, example_inputs)
    if not isinstance(model, str):
        raise invalid(f"model: expected a built-in name, a spec file, 'package.module:factory', "
                      f"a ModelSpec, an nn.Module or a pair (nn.Module, example_inputs), got "
                      f"{type(model).__name__}; fix: pass one of those")
    if model.lower().endswith(SPEC_SUFFIXES):
        return _spec_source(load_spec(Path(model)), example_inputs)
    if model in zoo_specs():
        return _spec_source(zoo_specs()[model], example_inputs)
    if ":" in model:
        return _factory_source(model, example_inputs)
    nearest = difflib.get_close_matches(model, list_models(), n=_NEAREST_NAMES, cutoff=0.0)
    raise invalid(f"model `{model}`: not a built-in model, a spec file (.yaml/.json) or "
                  f"'package.module:factory'; nearest built-in names: {', '.join(nearest)}; "
                  f"fix: use one of them (`paraplan models` lists all)")


def _spec_source(spec: ModelSpec, example_inputs: Any) -> ModelSource:
    if example_inputs is not None:
        raise invalid(f"example_inputs: model `{spec.name}` is a built-in or spec model whose "
                      f"inputs are known; fix: pass no example inputs")

    def build(seq_len: int | None = None) -> nn.Module:
        try:
            return build_model(spec, seq_len)
        except (RuntimeError, TypeError, OverflowError, ValueError) as exc:  # sizes torch cannot allocate, even on meta
            raise invalid(f"model `{spec.name}`: torch cannot build it ({_describe(exc)}); fix: check the spec's sizes "
                          f"(layers, hidden, heads, vocab, ...) for a value too large") from None

    return ModelSource(
        name=spec.name,
        build=build,
        example_inputs=functools.partial(zoo_example_inputs, spec),
        dims=spec.dims,
        default_seq_len=spec.default_seq_len,
        fixed_by="its image patches plus the class token" if spec.num_patches else "",
        learned_positions=spec.max_seq_len if spec.arch in LEARNED_POSITION_ARCHS else 0,
    )


def _module_source(module: nn.Module, name: str, example_inputs: Any) -> ModelSource:
    """A source for a module instance; `build` returns the instance itself."""
    def build(seq_len: int | None = None) -> nn.Module:
        return module

    _check_positional_forward(module, name)
    if example_inputs is None:
        return ModelSource(name=name, build=build, example_inputs=_inputs_for_module(module, name, example_inputs))
    given = _checked_inputs(example_inputs, f"model `{name}`: example_inputs")
    return ModelSource(name=name, build=build, example_inputs=_inputs_for_module(module, name, given),
                       default_seq_len=_token_seq_len(given), fixed_by="set by the example inputs given with it",
                       fixed_micro_batch=_batch_of(given))


def _check_positional_forward(module: nn.Module, name: str) -> None:
    """Example inputs reach the forward by position: one that needs a keyword-only input gets none."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):  # no signature to read: tracing says what fails
        return
    keyword_only = [p.name for p in parameters if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    if keyword_only:
        raise invalid(f"model `{name}`: its forward needs keyword-only input {', '.join(map(repr, keyword_only))}, and example "
                      f"inputs are passed by position; fix: wrap it in a module whose forward takes it by position (or "
                      f"give it a default)")


def _inputs_for_module(module: nn.Module, name: str,
                       example_inputs: Any) -> Callable[[int, int, torch.device], tuple]:
    """Input maker for a module: the given inputs' shapes, or token ids if it starts with an
    embedding (the first module its forward calls, or the first registered where torch.fx cannot
    trace the forward without inputs)."""
    if example_inputs is not None:
        shapes = _checked_inputs(example_inputs, f"model `{name}`: example_inputs")
        return lambda micro_batch, seq_len, device: _zeros_like_inputs(shapes, device)
    required = required_inputs(module)
    if len(required) > 1:
        raise invalid(f"model `{name}`: its forward takes {len(required)} inputs ({', '.join(required)}), and only token "
                      f"ids can be made up without example inputs; fix: pass the model as (module, example_inputs), or "
                      f"return that pair from the factory")
    first_name, first_leaf, which = _first_module(module)
    if not isinstance(first_leaf, nn.Embedding):
        first = f"`{first_name}` ({type(first_leaf).__name__})" if first_name else f"the {type(first_leaf).__name__} itself"
        raise invalid(f"model `{name}`: cannot infer example inputs (token ids need an nn.Embedding as the first "
                      f"{which} module; the first is {first}); fix: pass the model as (module, example_inputs), "
                      f"or return that pair from the factory")
    vocab = first_leaf.num_embeddings
    return lambda micro_batch, seq_len, device: (
        torch.randint(0, vocab, (micro_batch, seq_len), device=device),)


def required_inputs(module: nn.Module) -> list[str]:
    """The names of the inputs `module`'s forward requires (no default, not *args or **kwargs); []
    when its signature cannot be read (a C++ forward)."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in parameters if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _first_module(module: nn.Module) -> tuple[str, nn.Module | None, str]:
    """(name, module, "called" or "registered"): the first leaf module the forward calls, from a
    torch.fx trace with symbolic inputs; the first registered leaf where fx cannot trace it."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # what fx says of a forward it cannot follow is not the user's concern here
            graph = torch.fx.symbolic_trace(module).graph
    except Exception:  # noqa: BLE001 - any forward fx cannot follow without inputs
        graph = None
    if graph is not None:
        called = next((node.target for node in graph.nodes if node.op == "call_module"), None)
        if called is not None:
            return called, module.get_submodule(called), "called"
    leaf = next(((n, m) for n, m in module.named_modules() if next(m.children(), None) is None), ("", None))
    return (*leaf, "registered")


def _factory_source(ref: str, example_inputs: Any) -> ModelSource:
    factory = _load_factory(ref)
    probe = _probe_kwargs(factory)
    with torch.device("meta"):
        module, returned_inputs = _call_factory(ref, factory, probe)

    def build(seq_len: int | None = None) -> nn.Module:
        kwargs = dict(probe, seq_len=seq_len) if seq_len and "seq_len" in probe else probe
        return _call_factory(ref, factory, kwargs)[0]

    def fresh_inputs(micro_batch: int, seq_len: int, device: torch.device) -> tuple:
        requested = {"seq_len": seq_len, "micro_batch": micro_batch}
        with torch.device("meta"):
            inputs = _call_factory(ref, factory, {k: requested[k] for k in probe})[1]
        got = {"seq_len": _token_seq_len(inputs), "micro_batch": _batch_of(inputs)}
        for key in probe:
            if got[key] != requested[key] and not (key == "seq_len" and got[key] == NO_SEQUENCE_SEQ_LEN):
                raise invalid(f"model `{ref}`: called with {key}={requested[key]}, the factory returned example inputs "
                              f"with {key} {got[key]}; fix: shape the example inputs by the factory's {key} argument")
        return _zeros_like_inputs(inputs, device)

    def fixed_inputs(micro_batch: int, seq_len: int, device: torch.device) -> tuple:
        return _zeros_like_inputs(returned_inputs, device)

    if returned_inputs is None:
        make_inputs = _inputs_for_module(module, ref, example_inputs)
    elif example_inputs is not None:
        raise invalid(f"example_inputs: factory `{ref}` already returns example inputs; fix: "
                      f"pass none, or return the module alone from the factory")
    else:
        make_inputs = fresh_inputs if probe else fixed_inputs
    if "seq_len" in probe or returned_inputs is None:
        default_seq_len = probe.get("seq_len", _SOURCE_DEFAULT_SEQ_LEN)
    else:
        default_seq_len = _token_seq_len(returned_inputs)
    own_inputs = returned_inputs is not None
    return ModelSource(name=ref, build=build, example_inputs=make_inputs, default_seq_len=default_seq_len,
                       fixed_by="set by the example inputs its factory returns; it takes no seq_len="
                       if own_inputs and "seq_len" not in probe else "",
                       fixed_micro_batch=_batch_of(returned_inputs) if own_inputs and "micro_batch" not in probe else 0)


def _load_factory(ref: str) -> Callable:
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise invalid(f"model `{ref}`: expected 'package.module:factory'; fix: name both the "
                      f"module and the factory, e.g. 'mypkg.models:build'")
    try:
        py_module = importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - user code may raise anything on import, or exit
        raise invalid(f"model `{ref}`: cannot import module `{module_name}` ({_describe(exc)}); "
                      f"fix: check the module path, and that `python -c 'import {module_name}'` works from "
                      f"the current directory (or add its folder to PYTHONPATH)") from None
    if not hasattr(py_module, attr):
        nearest = difflib.get_close_matches(attr, [n for n in dir(py_module)
                                                   if not n.startswith("_")], n=1)
        hint = f" (did you mean `{nearest[0]}`?)" if nearest else ""
        raise invalid(f"model `{ref}`: module `{module_name}` has no attribute `{attr}`{hint}; "
                      f"fix: name a factory function defined in `{module_name}`")
    factory = getattr(py_module, attr)
    if not callable(factory):
        raise invalid(f"model `{ref}`: `{attr}` is not callable (it is "
                      f"{type(factory).__name__}); fix: name a function that returns an nn.Module")
    return factory


def _probe_kwargs(factory: Callable) -> dict[str, int]:
    """The keyword arguments among seq_len/micro_batch the factory accepts, with the values to
    call it with when the tracer asks for none: the factory's own positive integer default,
    else the ModelSource default sequence length and a micro-batch of 1."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return {}
    takes_any = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
    fallback = {"seq_len": _SOURCE_DEFAULT_SEQ_LEN, "micro_batch": _PROBE_MICRO_BATCH}
    probe = {}
    for name in _FACTORY_KWARGS:
        param = params.get(name)
        if param is not None and param.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                inspect.Parameter.KEYWORD_ONLY):
            default = param.default
            usable = isinstance(default, int) and not isinstance(default, bool) and default > 0
            probe[name] = default if usable else fallback[name]
        elif takes_any:
            probe[name] = fallback[name]
    return probe


def _call_factory(ref: str, factory: Callable, kwargs: dict) -> tuple[nn.Module, tuple | None]:
    """Calls the factory under the ambient device/dtype and checks its result: (module, inputs
    or None)."""
    try:
        result = factory(**kwargs)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - user code may raise anything, or exit
        args = ", ".join(f"{k}={v}" for k, v in kwargs.items())
        fix = ("give its other arguments defaults: it is called with none, or with seq_len= and micro_batch="
               if isinstance(exc, TypeError) and "argument" in str(exc) else
               "make it build the model on the ambient device (meta while planning) without loading weights")
        raise invalid(f"model `{ref}`: the factory raised {_describe(exc)} when called as "
                      f"{ref.partition(':')[2]}({args}); fix: {fix}") from None
    if isinstance(result, nn.Module):
        return result, None
    if (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module)):
        return result[0], _checked_inputs(result[1], f"model `{ref}`: factory example inputs")
    raise invalid(f"model `{ref}`: the factory returned {_describe_value(result)}, expected an "
                  f"nn.Module or a pair (module, example_inputs); fix: return one of those")


def _checked_inputs(inputs: Any, what: str) -> tuple:
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if isinstance(inputs, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in inputs):
        for index, x in enumerate(inputs):
            if isinstance(x, torch.Tensor) and 0 in x.shape:
                raise invalid(f"{what}: input {index} has shape {tuple(x.shape)}, with an empty dimension, so the "
                              f"model would do no work; fix: give at least one sample and one token or feature")
        return tuple(inputs)
    raise invalid(f"{what}: expected a tensor or a tuple of tensors, got "
                  f"{_describe_value(inputs)}; fix: pass e.g. (torch.zeros(2, 128, "
                  f"dtype=torch.long),)")


def _zeros_like_inputs(inputs: tuple, device: torch.device) -> tuple:
    """Zero tensors with the shapes and dtypes of `inputs` on `device`; non-tensors unchanged."""
    return tuple(torch.zeros(x.shape, dtype=x.dtype, device=device)
                 if isinstance(x, torch.Tensor) else x for x in inputs)


def _batch_of(inputs: tuple) -> int:
    """The batch (first) dimension of fixed inputs' first tensor; 0 when it has none."""
    first = next((x for x in inputs if isinstance(x, torch.Tensor)), None)
    return int(first.shape[0]) if first is not None and first.dim() >= 1 else 0


def _token_seq_len(inputs: tuple) -> int:
    """The sequence length of fixed inputs: dimension 1 of the first input when it is token ids
    (b, s) or a sequence of vectors (b, s, d); `NO_SEQUENCE_SEQ_LEN` for other inputs (images,
    feature vectors), whose samples then count as one token each."""
    first = inputs[0]
    if isinstance(first, torch.Tensor) and (
            (first.dim() == 2 and not first.is_floating_point()) or (first.dim() == 3 and first.is_floating_point())):
        return first.shape[1]
    return NO_SEQUENCE_SEQ_LEN


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _describe_value(value: Any) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)} ({', '.join(type(v).__name__ for v in value)})"
    return f"{type(value).__name__}"
