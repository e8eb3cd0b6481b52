"""Model spec files: the architecture of a built-in family as a small YAML/JSON mapping.

A spec names an architecture family (`arch`) and its dimensions; `planner.zoo.build_model` turns it
into a plain PyTorch module. Every built-in model is one file in `planner/zoo/specs/`, and users can
write their own.

Keys (`*` = required):

    arch*            gpt | llama | moe | bert | vit
    layers*          transformer blocks (at most MAX_LAYERS, 2048)
    hidden*          model width
    heads*           attention heads; must divide `hidden` unless `head_dim` is given
    kv_heads         key/value heads (grouped-query attention); must divide `heads`.
                     Default `heads`.
    head_dim         width of one attention head (llama, moe): the query projection is
                     heads x head_dim wide, the key and value projections kv_heads x head_dim,
                     whatever `hidden` is (Qwen3, Gemma). Default hidden / heads.
    ffn_hidden       MLP width. Default 4 x hidden for gpt, bert and vit; required for llama
                     (SwiGLU widths are not a fixed multiple). For moe it is the width of the
                     leading dense layers: required with dense_layers, else `moe_ffn_hidden`.
    vocab            vocabulary size; required for gpt, llama, moe and bert; not used by vit.
    tie_embeddings   share the token embedding with the output projection. Default true for gpt
                     and bert, false for llama and moe; not used by vit.
    max_seq_len      published context length: sizes the learned position table of gpt and bert
                     (the table grows when a longer sequence is traced) and is the default
                     sequence length. Defaults: gpt 2048, bert 512, llama and moe 4096.
    rope_theta       rotary embedding base (llama, moe). Default 10000.
    experts*         routed experts per MoE layer (moe only).
    top_k*           routed experts each token uses; at most `experts` (moe only).
    moe_ffn_hidden   width of one expert's SwiGLU MLP (moe only). Default `ffn_hidden`; one of
                     the two is required.
    shared_experts   always-on experts of width `moe_ffn_hidden` (DeepSeek-MoE style; moe only).
                     Default 0.
    dense_layers     leading layers with a dense MLP instead of experts; fewer than `layers`
                     (moe only). Default 0.
    image_size*      input image side in pixels (vit only); a multiple of `patch_size`.
    patch_size*      patch side in pixels (vit only).
    classes          classification classes (vit only). Default 1000.

Example::

    >>> spec = parse_spec({"arch": "llama", "layers": 2, "hidden": 64, "heads": 4,
    ...                    "kv_heads": 2, "ffn_hidden": 128, "vocab": 100}, "tiny.yaml")
    >>> spec.name, spec.head_dim
    ('tiny', 16)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import yaml

from costmodel.strict_parse import load_text
from planner.errors import invalid
from planner.graph import ModelDims
from planner.zoo.spec_errors import field_error, nearest_hint, one_line, show, unknown_key_error

# Published context lengths used when a spec gives no `max_seq_len`: GPT-3 (Brown et al. 2020,
# Sec. 2.1: n_ctx = 2048), BERT (Devlin et al. 2019, Sec. A.2: 512 positions), Llama 2 (Touvron
# et al. 2023, Table 1: 4096).
DEFAULT_GPT_MAX_SEQ_LEN = 2048
DEFAULT_BERT_MAX_SEQ_LEN = 512
DEFAULT_ROPE_MAX_SEQ_LEN = 4096
# RoPE base of Su et al. 2021 and Llama 1/2.
DEFAULT_ROPE_THETA = 10000.0
# ImageNet-1k classes (ViT fine-tuning head, Dosovitskiy et al. 2021).
DEFAULT_VIT_CLASSES = 1000
# Twice the deepest transformer trained (DeepNet, Wang et al. 2022, arXiv 2203.00555: 1,000 layers);
# the trace builds every block, so a deeper spec is taken for a typo rather than traced for minutes.
MAX_LAYERS = 2048
# Dense MLP width of GPT/BERT/ViT as a multiple of `hidden` (Vaswani et al. 2017).
DENSE_FFN_MULTIPLE = 4


class Arch(StrEnum):
    GPT = "gpt"
    LLAMA = "llama"
    MOE = "moe"
    BERT = "bert"
    VIT = "vit"


_LANGUAGE = frozenset({Arch.GPT, Arch.LLAMA, Arch.MOE, Arch.BERT})
_ROPE = frozenset({Arch.LLAMA, Arch.MOE})
# Architectures whose positions are a learned table of `max_seq_len` rows.
LEARNED_POSITION_ARCHS = frozenset({Arch.GPT, Arch.BERT})
_MOE_KEYS = ("experts", "top_k", "moe_ffn_hidden", "shared_experts", "dense_layers")
_VIT_KEYS = ("image_size", "patch_size", "classes")

# key -> (type, archs that accept it, archs that require it)
_ALL = frozenset(Arch)
_KEYS: dict[str, tuple[type, frozenset, frozenset]] = {
    "arch": (str, _ALL, _ALL),
    "layers": (int, _ALL, _ALL),
    "hidden": (int, _ALL, _ALL),
    "heads": (int, _ALL, _ALL),
    "kv_heads": (int, _ALL, frozenset()),
    "head_dim": (int, _ROPE, frozenset()),
    "ffn_hidden": (int, _ALL, frozenset({Arch.LLAMA})),  # moe: see _moe_widths
    "vocab": (int, _LANGUAGE, _LANGUAGE),
    "tie_embeddings": (bool, _LANGUAGE, frozenset()),
    "max_seq_len": (int, _LANGUAGE, frozenset()),
    "rope_theta": (float, _ROPE, frozenset()),
    "experts": (int, frozenset({Arch.MOE}), frozenset({Arch.MOE})),
    "top_k": (int, frozenset({Arch.MOE}), frozenset({Arch.MOE})),
    "moe_ffn_hidden": (int, frozenset({Arch.MOE}), frozenset()),
    "shared_experts": (int, frozenset({Arch.MOE}), frozenset()),
    "dense_layers": (int, frozenset({Arch.MOE}), frozenset()),
    "image_size": (int, frozenset({Arch.VIT}), frozenset({Arch.VIT})),
    "patch_size": (int, frozenset({Arch.VIT}), frozenset({Arch.VIT})),
    "classes": (int, frozenset({Arch.VIT}), frozenset()),
}
_MAY_BE_ZERO = frozenset({"shared_experts", "dense_layers"})


@dataclass(frozen=True)
class ModelSpec:
    """A validated model spec with every default filled in (see the module docstring for keys).

    Attributes:
        name: display name, the spec file's stem (e.g. "llama3-8b").
        Other attributes are the spec keys; those an arch does not use are 0.
    """

    name: str
    arch: Arch
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    head_dim: int = 0
    vocab: int = 0
    tie_embeddings: bool = False
    max_seq_len: int = 0
    rope_theta: float = DEFAULT_ROPE_THETA
    experts: int = 0
    top_k: int = 0
    moe_ffn_hidden: int = 0
    shared_experts: int = 0
    dense_layers: int = 0
    image_size: int = 0
    patch_size: int = 0
    classes: int = 0

    @property
    def num_patches(self) -> int:
        """Image patches per input (vit); 0 for other archs."""
        return (self.image_size // self.patch_size) ** 2 if self.arch == Arch.VIT else 0

    @property
    def default_seq_len(self) -> int:
        """Sequence length traced when none is given: the context, or patches + class token."""
        return self.num_patches + 1 if self.arch == Arch.VIT else self.max_seq_len

    def to_dict(self) -> dict[str, Any]:
        """The spec as file keys: every key its arch accepts, defaults written out.

        `parse_spec(spec.to_dict(), f"{spec.name}.yaml")` gives back an equal spec.
        """
        data = {key: getattr(self, key) for key, (_, accepted, _) in _KEYS.items()
                if self.arch in accepted}
        data["arch"] = str(self.arch)
        return data

    @property
    def dims(self) -> ModelDims:
        """Dims that decide legal parallel degrees; `ffn_hidden` is the expert width for moe."""
        return ModelDims(
            hidden=self.hidden,
            heads=self.heads,
            kv_heads=self.kv_heads,
            layers=self.layers,
            vocab=self.vocab,
            ffn_hidden=self.moe_ffn_hidden if self.arch == Arch.MOE else self.ffn_hidden,
            experts=self.experts,
            top_k=self.top_k,
        )


def load_spec(path: str | Path) -> ModelSpec:
    """Reads and validates a `.yaml`/`.yml`/`.json` spec file.

    Args:
        path: the spec file; its stem becomes the model name.

    Returns:
        The validated ModelSpec.

    Raises:
        PlannerError: INVALID_INPUT when the file is missing, unreadable or invalid.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise invalid(f"{path}: model spec file not found; fix: check the path, or use a "
                      f"built-in name (`paraplan models` lists them)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise invalid(f"{path}: cannot read the model spec ({one_line(exc)}); "
                      f"fix: pass a readable UTF-8 YAML or JSON file") from None
    return parse_spec_text(text, str(path))


def parse_spec_text(text: str, origin: str) -> ModelSpec:
    """Parses YAML spec text (JSON when `origin` ends in .json) and validates it; a key given twice is an error.

    Args:
        text: file contents.
        origin: file name used in error messages and as the model name (its stem).

    Returns:
        The validated ModelSpec.

    Raises:
        PlannerError: INVALID_INPUT when the text is not valid YAML or the spec is invalid.
    """
    is_json = str(origin).lower().endswith(".json")
    try:
        data = load_text(text, is_json)
    except (yaml.YAMLError, ValueError, OverflowError, RecursionError) as exc:
        # PyYAML raises ValueError/OverflowError for scalars it resolves but cannot construct
        # (e.g. the timestamp "2001-13-45"); json raises ValueError.
        shape = '{"key": value, ...}' if is_json else "one `key: value` per line"
        mark = getattr(exc, "problem_mark", None)
        where = f"{origin}:{mark.line + 1}" if mark is not None else origin
        problem = getattr(exc, "problem", None) or one_line(exc)
        raise invalid(f"{where}: not valid {'JSON' if is_json else 'YAML'} ({problem}); "
                      f"fix: write a mapping, {shape}, each key once") from None
    return parse_spec(data, origin)


def parse_spec(data: Any, origin: str) -> ModelSpec:
    """Validates a spec mapping and fills in defaults.

    Args:
        data: the parsed mapping (from YAML, JSON or Python).
        origin: file name (or other label) used in error messages; its stem is the model name.

    Returns:
        The validated ModelSpec.

    Raises:
        PlannerError: INVALID_INPUT naming the first bad field and its fix.
    """
    if not isinstance(data, dict):
        raise invalid(f"{origin}: a model spec must be a mapping of keys to values, got "
                      f"{type(data).__name__}; fix: write e.g. `arch: llama` and `layers: 32`, "
                      f"one per line")
    for key in data:
        if not isinstance(key, str) or key not in _KEYS:
            raise unknown_key_error(origin, key, data, list(_KEYS))
    arch = _parse_arch(data, origin)
    values = {key: _checked_value(origin, key, data[key]) for key in data}
    for key, (_, accepted, required) in _KEYS.items():
        if key in values and arch not in accepted:
            raise field_error(origin, key, f"not used by arch {arch}",
                               f"remove it (it applies to arch {_names(accepted)})")
        if key not in values and arch in required:
            raise field_error(origin, key, f"missing (required for arch {arch})",
                               f"add `{key}: <positive integer>`")
    if arch == Arch.MOE:
        values = _moe_widths(values, origin)
    spec = ModelSpec(name=Path(origin).stem, **_with_defaults(arch, values))
    _check_consistency(spec, origin, head_dim_given="head_dim" in values)
    return spec


def _parse_arch(data: dict, origin: str) -> Arch:
    if "arch" not in data:
        raise field_error(origin, "arch", "missing", f"add `arch: <{_names(_ALL)}>`")
    arch = data["arch"]
    if not isinstance(arch, str) or arch not in Arch.__members__.values():
        raise field_error(origin, "arch", f"unknown architecture {show(arch)}",
                           f"use one of {_names(_ALL)}{nearest_hint(arch, list(Arch))}")
    return Arch(arch)


def _checked_value(origin: str, key: str, value: Any) -> Any:
    expected = _KEYS[key][0]
    if expected is str:
        return value
    if expected is bool:
        if not isinstance(value, bool):
            raise field_error(origin, key, f"expected true or false, got {show(value)}",
                               f"write `{key}: true` or `{key}: false`")
        return value
    if expected is float:
        value = _number_text(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value) and value > 0):
            raise field_error(origin, key, f"expected a positive number, got {show(value)}",
                               f"write e.g. `{key}: 500000`")
        return float(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise field_error(origin, key, f"expected an integer, got {show(value)}",
                           f"write a whole number, e.g. `{key}: 8`")
    if value < 0 or (value == 0 and key not in _MAY_BE_ZERO):
        bound = "zero or more" if key in _MAY_BE_ZERO else "positive"
        raise field_error(origin, key, f"must be {bound}, got {value}",
                           f"use a {bound} integer")
    return value


def _number_text(value: Any) -> Any:
    """A number written as text (YAML 1.1 reads an exponent without a dot, "1e6", as a string) as
    that number; any other value unchanged."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _moe_widths(values: dict, origin: str) -> dict:
    """An MoE spec's MLP widths: each of `ffn_hidden` (the dense layers') and `moe_ffn_hidden` (the
    experts') defaults to the other; the dense width is required only when there are dense layers."""
    if "ffn_hidden" in values:
        return values
    if values.get("dense_layers", 0):
        raise field_error(origin, "ffn_hidden", "missing (required for the dense_layers of arch moe)",
                           "add `ffn_hidden: <positive integer>`, the dense layers' MLP width")
    if "moe_ffn_hidden" not in values:
        raise field_error(origin, "moe_ffn_hidden", "missing (arch moe needs an expert width)",
                           "add `moe_ffn_hidden: <positive integer>` (or `ffn_hidden`)")
    return {**values, "ffn_hidden": values["moe_ffn_hidden"]}


def _with_defaults(arch: Arch, values: dict) -> dict:
    filled = dict(values)
    filled["arch"] = arch
    filled.setdefault("kv_heads", filled["heads"])
    filled.setdefault("head_dim", filled["hidden"] // filled["heads"])
    filled.setdefault("ffn_hidden", DENSE_FFN_MULTIPLE * filled["hidden"])
    if arch in _LANGUAGE:
        filled.setdefault("tie_embeddings", arch in (Arch.GPT, Arch.BERT))
        filled.setdefault("max_seq_len", {
            Arch.GPT: DEFAULT_GPT_MAX_SEQ_LEN,
            Arch.BERT: DEFAULT_BERT_MAX_SEQ_LEN,
        }.get(arch, DEFAULT_ROPE_MAX_SEQ_LEN))
    if arch == Arch.MOE:
        filled.setdefault("moe_ffn_hidden", filled["ffn_hidden"])
    if arch == Arch.VIT:
        filled.setdefault("classes", DEFAULT_VIT_CLASSES)
    return filled


def _check_consistency(spec: ModelSpec, origin: str, head_dim_given: bool) -> None:
    if spec.layers > MAX_LAYERS:
        raise field_error(origin, "layers", f"{spec.layers} is more than {MAX_LAYERS}",
                          "check the count (the deepest trained transformers have about 1,000 layers)")
    if spec.hidden % spec.heads and not head_dim_given:
        raise field_error(origin, "heads", f"{spec.heads} does not divide hidden {spec.hidden}",
                           f"pick heads from the divisors of {spec.hidden}, or give `head_dim` (llama, moe)")
    if spec.heads % spec.kv_heads:
        raise field_error(origin, "kv_heads", f"{spec.kv_heads} does not divide heads "
                           f"{spec.heads}", f"pick kv_heads from the divisors of {spec.heads}")
    if spec.arch in _ROPE and spec.head_dim % 2:
        field = "head_dim" if head_dim_given else "heads"
        raise field_error(origin, field, f"head dimension {spec.head_dim} is odd, rotary embeddings need "
                           f"it even", "use an even head_dim, or heads that make hidden / heads even")
    if spec.arch == Arch.MOE:
        if spec.top_k > spec.experts:
            raise field_error(origin, "top_k", f"{spec.top_k} exceeds experts {spec.experts}",
                               f"use top_k <= {spec.experts}")
        if spec.dense_layers >= spec.layers:
            raise field_error(origin, "dense_layers", f"{spec.dense_layers} leaves no MoE layer "
                               f"out of {spec.layers}", f"use dense_layers < {spec.layers}")
    if spec.arch == Arch.VIT and spec.image_size % spec.patch_size:
        raise field_error(origin, "patch_size", f"{spec.patch_size} does not divide image_size "
                           f"{spec.image_size}", f"pick a divisor of {spec.image_size}")


def _names(archs: frozenset) -> str:
    return "|".join(a.value for a in Arch if a in archs)
