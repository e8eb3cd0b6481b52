"""paraplan: an auto-parallelism planner for PyTorch training.

Example::

    >>> import planner
    >>> plan = planner.plan("gpt3-1.3b", "a100-80g:2x8", global_batch=256, seq_len=2048)
    >>> plan.config.devices, plan.estimate.fits
    (16, True)
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "plan": "planner.api",
    "evaluate": "planner.api",
    "trace": "planner.tracing",
    "make_config": "planner.api",
    "Plan": "planner.result",
    "Estimate": "planner.result",
    "ParallelConfig": "planner.config",
    "PlannerError": "planner.errors",
    "ModelGraph": "planner.graph",
    "sweep": "planner.sweeps.runner",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'planner' has no attribute {name!r}")
