"""The loss a training step adds to a model that returns language-model logits.

A model that computes its loss (the zoo's, a factory's returning it) is measured with it. One that
returns logits over its input vocabulary leaves the loss to the training code, which still runs it
on the last stage: cross-entropy over the logits cast to fp32 holds an fp32 copy, its softmax and a
gradient of each, gigabytes at large vocabularies and long sequences. Such a model is measured with
that loss added at its root (targets: the input tokens, as the zoo's models take them), so the
head's layer prices it as a zoo model's (`--loss` picks the kernel); its modules and their names
stay as they are, and `Plan.apply` runs the user's `loss_fn` in its place.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

# Rank of language-model logits: (batch, sequence, vocabulary).
LOGITS_RANK = 3


def with_language_model_loss(model: nn.Module, inputs: tuple, notes: list[str]) -> nn.Module:
    """`model`, or a shallow copy of it whose forward ends in the loss over its logits when it takes
    token ids alone and returns logits over the vocabulary of one of its embeddings and no scalar (a
    loss of its own); appends a note when it adds the loss."""
    tokens = inputs[0] if len(inputs) == 1 else None
    if not isinstance(tokens, torch.Tensor) or tokens.is_floating_point() or tokens.dim() != 2:
        return model
    if any(isinstance(module, nn.modules.loss._Loss) for module in model.modules()):
        return model  # computes its loss (the zoo's models): no forward run needed to tell
    vocabularies = {module.num_embeddings for module in model.modules() if isinstance(module, nn.Embedding)}
    try:
        with torch.no_grad():
            output = model(*inputs)
    except Exception as exc:  # noqa: BLE001 - a model fx or export can still capture; it is measured as written
        notes.append(f"the model's forward does not run on meta tensors ({type(exc).__name__}), so whether it returns "
                     f"logits is unknown: priced as it returns, without a loss after it")
        return model
    if any(isinstance(leaf, torch.Tensor) and leaf.dim() == 0 for leaf in pytree.tree_leaves(output)):
        return model
    path = _logits_path(output)
    logits = _follow(output, path) if path is not None else None
    if (not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() != LOGITS_RANK
            or tuple(logits.shape[:2]) != tuple(tokens.shape) or logits.shape[-1] not in vocabularies):
        return model
    base = type(model)

    def forward(self, tokens):
        logits = _follow(base.forward(self, tokens), path)
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())

    wrapped = copy.copy(model)
    wrapped.__class__ = type(base.__name__, (base,), {"forward": forward})
    notes.append(f"the model returns logits over its {logits.shape[-1]:,}-token vocabulary: priced with the loss the "
                 f"training step adds on the last stage (cross-entropy over the logits cast to fp32, targets the input "
                 f"tokens; --loss picks the kernel)")
    return wrapped


def _logits_path(output) -> str | int | None:
    """Where the logits sit in a model's output: "" (the output itself), a dict key, a tuple index,
    or an attribute name (a dataclass output); None when nowhere."""
    if isinstance(output, torch.Tensor):
        return ""
    if isinstance(output, dict):
        return "logits" if "logits" in output else None
    if isinstance(output, (tuple, list)):
        return 0 if output else None
    return ".logits" if isinstance(getattr(output, "logits", None), torch.Tensor) else None


def _follow(output, path: str | int):
    if path == "":
        return output
    if isinstance(path, str) and path.startswith("."):
        return getattr(output, path[1:])
    return output[path]
