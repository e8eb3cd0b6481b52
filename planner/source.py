"""ModelSource: how to build a model and its example inputs, without building it yet.

Tracing builds the model several times under different contexts (meta device for the fx graph
and FLOP counting, FakeTensorMode on the CPU device for saved-activation bytes), so a model is
passed around as a recipe rather than an instance.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from planner.graph import ModelDims


@dataclass(frozen=True)
class ModelSource:
    """A buildable model.

    Attributes:
        name: display name (zoo name, spec file stem, or "package.module:factory").
        build: returns a fresh nn.Module built on the current default device and dtype
            (the tracer sets both). Called with `seq_len=` so models with learned position
            tables can size them.
        example_inputs: (micro_batch, seq_len, device) -> tuple of input tensors for forward.
        dims: architecture facts when known (zoo and spec models); zeros when unknown.
        default_seq_len: sequence length used when the user gives none.
        fixed_by: what fixes the inputs' sequence length at `default_seq_len` whatever is asked
            (a ViT's image size, a factory's own example inputs); "" when the inputs follow it.
        fixed_micro_batch: sequences in the fixed inputs, whatever is asked; 0 when the inputs
            follow the requested micro-batch.
        learned_positions: rows of the published model's learned position table, which `build`
            extends for a longer sequence; 0 when it has none (rotary, or unknown).
    """

    name: str
    build: Callable[..., nn.Module]
    example_inputs: Callable[[int, int, torch.device], tuple]
    dims: ModelDims = ModelDims()
    default_seq_len: int = 2048
    fixed_by: str = ""
    fixed_micro_batch: int = 0
    learned_positions: int = 0
