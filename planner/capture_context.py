"""Contexts the model capture runs in (`planner.tracing`): what torch.export prints when it fails is
kept out of the user's terminal, and model code may open autocast on the meta device."""
from __future__ import annotations

import contextlib
import functools
import io
import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch

EXPORT_LOGGERS = ("torch.export", "torch._export", "torch.fx.experimental.symbolic_shapes", "torch._subclasses.fake_tensor")


@contextmanager
def autocast_meta_as_cpu() -> Iterator[None]:
    """Lets model code open `torch.autocast(device_type=x.device.type)` on the meta tensors it is
    captured with (Hugging Face's rotary embeddings do, with enabled=False): torch has no autocast for
    meta and raises. Autocast of the CPU device, which "meta" becomes here, leaves meta tensors alone."""
    original = torch.amp.autocast_mode.autocast.__init__

    @functools.wraps(original)
    def init(self, device_type, *args, **kwargs):
        original(self, "cpu" if device_type == "meta" else device_type, *args, **kwargs)

    torch.amp.autocast_mode.autocast.__init__ = init
    try:
        yield
    finally:
        torch.amp.autocast_mode.autocast.__init__ = original


@contextmanager
def quiet_export() -> Iterator[None]:
    """Silences what a failing torch.export prints: the partial graph (written to stderr) and
    logged guard warnings; the reason is kept in the notes instead."""
    loggers = [logging.getLogger(name) for name in EXPORT_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
