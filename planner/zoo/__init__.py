"""Built-in model families as plain PyTorch modules, registered from the spec files in `specs/`.

Every built-in model is one `specs/<name>.yaml` file (the single source of truth);
`build_model` turns a ModelSpec into a module on the ambient default device and dtype, without
loading or expensively initialising weights (build under `torch.device("meta")` for
planning).

Module layout, relied on by tracing, pipeline cuts and tensor parallelism:

- top-level children in pipeline order: `embed`, `layers` (nn.ModuleList of blocks), `norm`
  (absent for BERT), `head`, `loss`;
- each block has `attn` (`q_proj`, `k_proj`, `v_proj`, `o_proj`) and `mlp` (`fc1`/`fc2` for
  GPT, BERT and ViT; `gate_proj`/`up_proj`/`down_proj` for Llama; for MoE layers `router`,
  `experts` (`gate_proj`/`up_proj`/`down_proj`, each a `GroupedLinear` with weights stacked
  (experts, in, out)), and optional `shared`);
- `forward` returns a scalar loss: language models take token ids (b, s), ViT takes images
  (b, 3, H, W) and scores the class token against class 0.

Example::

    >>> import torch
    >>> with torch.device("meta"):
    ...     model = build_model(zoo_specs()["llama3-8b"])
    >>> round(sum(p.numel() for p in model.parameters()) / 1e9, 2)
    8.03
"""
from __future__ import annotations

import functools
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

import torch
from torch import nn

from planner.zoo.bert import build_bert
from planner.zoo.gpt import build_gpt
from planner.zoo.llama import build_llama
from planner.zoo.moe import build_moe
from planner.zoo.spec import Arch, ModelSpec, load_spec
from planner.zoo.vit import IMAGE_CHANNELS, VisionTransformer

SPECS_DIR = Path(__file__).parent / "specs"
_FAMILY_ORDER = tuple(Arch)


@functools.cache
def zoo_specs() -> Mapping[str, ModelSpec]:
    """Loads every built-in spec file once.

    Returns:
        Name -> ModelSpec, ordered by family (gpt, llama, moe, bert, vit), then by name series
        (e.g. gpt2 before gpt3), then by depth and width.
    """
    specs = [load_spec(path) for path in SPECS_DIR.glob("*.yaml")]
    specs.sort(key=lambda s: (_FAMILY_ORDER.index(s.arch), s.name.split("-")[0], s.layers,
                              s.hidden))
    return MappingProxyType({spec.name: spec for spec in specs})


def build_model(spec: ModelSpec, seq_len: int | None = None) -> nn.Module:
    """Builds the module a spec describes on the ambient default device and dtype.

    Args:
        spec: a validated ModelSpec.
        seq_len: sequence length to be traced; learned position tables (gpt, bert) get
            max(seq_len, spec.max_seq_len) rows. Ignored by rotary-embedding models and ViT.

    Returns:
        The module; its forward returns a scalar loss.
    """
    max_positions = max(seq_len or 0, spec.max_seq_len)
    match spec.arch:
        case Arch.GPT:
            return build_gpt(spec, max_positions)
        case Arch.LLAMA:
            return build_llama(spec)
        case Arch.MOE:
            return build_moe(spec)
        case Arch.BERT:
            return build_bert(spec, max_positions)
        case Arch.VIT:
            return VisionTransformer(spec)


def example_inputs(spec: ModelSpec, micro_batch: int, seq_len: int,
                   device: torch.device | str) -> tuple[torch.Tensor]:
    """Inputs for one forward of a zoo model.

    Args:
        spec: the model's spec.
        micro_batch: sequences (or images) per forward.
        seq_len: tokens per sequence; ignored by ViT, whose length is fixed by the image size.
        device: where to create the tensors (e.g. "meta").

    Returns:
        (token ids (micro_batch, seq_len) drawn uniformly from the vocabulary,) or
        (images (micro_batch, 3, image_size, image_size) in the default dtype,) for ViT.
    """
    if spec.arch == Arch.VIT:
        return (torch.randn(micro_batch, IMAGE_CHANNELS, spec.image_size, spec.image_size,
                            device=device),)
    return (torch.randint(0, spec.vocab, (micro_batch, seq_len), device=device),)
