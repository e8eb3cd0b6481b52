"""OpTable: op times measured on one device and dtype (`paraplan profile`), which the compute model
(`costmodel.compute.layer_time_s`) uses instead of the roofline for the ops they cover."""
from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from costmodel.compute import ATTENTION_BWD_WORK_RATIO, FLASH_MEASURED_AS, OpWork, WorkKind
from costmodel.curves import interp_log_log, log_curve
from costmodel.errors import ProfileError


# Rates (FLOP/s, bytes/s) a measured op table may hold: from a byte per second to an exaFLOP per
# second, beyond any device in either direction; outside it a value is damaged (and would price ops
# at infinite or zero time).
MEASURED_RATE_RANGE = (1.0, 1e18)


@dataclass(frozen=True)
class OpTable:
    """Measured op times for one device and dtype, overriding the roofline where they apply.

    Attributes:
        device: DeviceSpec.name the times were measured on.
        dtype: dtype they were measured in.
        times_s_by_key: measured time of an op, by `OpWork.key`.
        matmul_times_s: (FLOPs, measured time) of GEMMs, strictly ascending in FLOPs; a matmul
            without a key match is priced at the achieved FLOP/s interpolated as a power law of
            FLOPs between its nearest measured sizes (clamped outside them).
        attention_times_s: (forward FLOPs, forward time, backward time) of causal fused attention
            over one head of one sequence (the work of the causal kernel: CAUSAL_WORK_FRACTION of the
            full score matrix's 4·s²·d), strictly ascending in FLOPs. An attention work is priced at
            the achieved FLOP/s interpolated at its `unit_flops` the same way: the kernel's efficiency
            follows the size of one head's problem (sequence length and head size), not the batch
            times heads it loops over (the backward's work is ATTENTION_BWD_WORK_RATIO times the
            forward's).
        elementwise_bytes_per_s: bytes per second of an elementwise op by its name ("gelu_tanh"),
            and of its backward ("gelu_tanh:bwd"), with bytes counted as the cost model counts them
            (forward: inputs plus output; backward: MEMORY_BWD_TRAFFIC_RATIO times that). On CPUs
            transcendental ops (tanh-GELU, SiLU, softmax) run far below the copy bandwidth.
        loss_bytes_per_s: bytes of loss works (`WorkKind.LOSS`) per second, measured on
            cross-entropy's forward and backward over fp32 logits; 0 when not measured.
        tp_linear_host_s: (forward, backward) host seconds one tensor-parallel linear adds to its
            local GEMMs per call: DTensor dispatch (sharding propagation, wrapping and unwrapping)
            and the parallel styles' input and output hooks, measured on a one-rank mesh, so no
            communication is in it; () when not measured.
        sync_wait_fraction: seconds ranks wait for each other at a blocking collective per second of
            compute since their previous one (ranks sharing a host drift apart), measured on pairs
            of ranks at a tensor-parallel linear's collectives; 0 when not measured.
    """

    device: str
    dtype: str
    times_s_by_key: Mapping[str, float] = field(default_factory=dict, hash=False)
    matmul_times_s: tuple[tuple[float, float], ...] = ()
    attention_times_s: tuple[tuple[float, float, float], ...] = ()
    loss_bytes_per_s: float = 0.0
    elementwise_bytes_per_s: Mapping[str, float] = field(default_factory=dict, hash=False)
    tp_linear_host_s: tuple[float, float] | tuple[()] = ()
    sync_wait_fraction: float = 0.0

    def __post_init__(self) -> None:
        measured = (list(self.times_s_by_key.values()) + [t for point in self.matmul_times_s for t in point]
                    + [t for point in self.attention_times_s for t in point]
                    + list(self.elementwise_bytes_per_s.values()))
        if not all(0 < t < math.inf for t in measured) or not 0 <= self.loss_bytes_per_s < math.inf:
            raise ProfileError(f"op table for {self.device}: every measured size, time and rate must be finite and > 0")
        rates = ([flops / t for flops, t in self.matmul_times_s]
                 + [flops / t for flops, *times in self.attention_times_s for t in times]
                 + list(self.elementwise_bytes_per_s.values()) + ([self.loss_bytes_per_s] if self.loss_bytes_per_s else []))
        if not all(MEASURED_RATE_RANGE[0] <= rate <= MEASURED_RATE_RANGE[1] for rate in rates):
            raise ProfileError(f"op table for {self.device}: a FLOP or byte rate outside {MEASURED_RATE_RANGE[0]:g}-"
                               f"{MEASURED_RATE_RANGE[1]:g} per second, which no device runs at")
        if len(self.tp_linear_host_s) not in (0, 2) or not all(0 <= t < math.inf for t in self.tp_linear_host_s):
            raise ProfileError(f"op table for {self.device}: tp_linear_host_s must be [forward s, backward s], each >= 0")
        if not 0 <= self.sync_wait_fraction < math.inf:
            raise ProfileError(f"op table for {self.device}: sync_wait_fraction must be >= 0, got {self.sync_wait_fraction}; "
                               f"re-run `paraplan profile`")
        for kind, rates in self._curves.items():
            log_curve(rates, f"op table for {self.device} {kind}")

    @functools.cached_property
    def _curves(self) -> dict[WorkKind, tuple[tuple[float, float], ...]]:
        """(FLOPs, achieved FLOP/s) of each measured kind of work."""
        rates = {}
        if self.matmul_times_s:
            rates[WorkKind.MATMUL] = tuple((flops, flops / time_s) for flops, time_s in self.matmul_times_s)
        if self.attention_times_s:
            rates[WorkKind.ATTENTION] = tuple((flops, flops / fwd_s) for flops, fwd_s, _ in self.attention_times_s)
            rates[WorkKind.ATTENTION_BWD] = tuple((ATTENTION_BWD_WORK_RATIO * flops, ATTENTION_BWD_WORK_RATIO * flops / bwd_s)
                                                  for flops, _, bwd_s in self.attention_times_s)
        return rates

    def lookup(self, work: OpWork) -> float | None:
        """Measured time of `work` in seconds, or None when the table does not cover it."""
        if work.key in self.times_s_by_key:
            return self.times_s_by_key[work.key]
        if work.kind is WorkKind.MEMORY and work.key in self.elementwise_bytes_per_s:
            return work.bytes / self.elementwise_bytes_per_s[work.key]
        if work.kind is WorkKind.LOSS and self.loss_bytes_per_s > 0:
            return work.bytes / self.loss_bytes_per_s
        rates = self._curves.get(FLASH_MEASURED_AS.get(work.kind, work.kind))
        if rates and work.flops > 0:
            size = work.unit_flops or work.flops
            return work.flops / interp_log_log(size, rates, f"op table for {self.device} {work.kind}")
        return None

    def to_dict(self) -> dict:
        """Plain-data form for JSON or YAML."""
        return {
            "device": self.device,
            "dtype": self.dtype,
            "times_s_by_key": dict(self.times_s_by_key),
            "matmul_times_s": [{"flops": flops, "time_s": time_s} for flops, time_s in self.matmul_times_s],
            "attention_head_times_s": [{"flops": flops, "fwd_s": fwd_s, "bwd_s": bwd_s}
                                       for flops, fwd_s, bwd_s in self.attention_times_s],
            "loss_bytes_per_s": self.loss_bytes_per_s,
            "elementwise_bytes_per_s": dict(self.elementwise_bytes_per_s),
            "tp_linear_host_s": list(self.tp_linear_host_s),
            "sync_wait_fraction": self.sync_wait_fraction,
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> OpTable:
        """Inverse of `to_dict`.

        Raises:
            ProfileError: a field is missing or of the wrong type.
        """
        if "attention_times_s" in data:
            raise ProfileError("op table: `attention_times_s` holds whole-call attention times, the format of an older "
                               "`paraplan profile`; re-run `paraplan profile` (attention is now timed per head of one "
                               "sequence, `attention_head_times_s`)")
        try:
            return cls(
                device=str(data["device"]),
                dtype=str(data["dtype"]),
                times_s_by_key={str(k): float(v) for k, v in data.get("times_s_by_key", {}).items()},
                matmul_times_s=tuple((float(p["flops"]), float(p["time_s"]))
                                     for p in data.get("matmul_times_s", ())),
                attention_times_s=tuple((float(p["flops"]), float(p["fwd_s"]), float(p["bwd_s"]))
                                        for p in data.get("attention_head_times_s", ())),
                loss_bytes_per_s=float(data.get("loss_bytes_per_s", 0.0)),
                elementwise_bytes_per_s={str(k): float(v) for k, v in data.get("elementwise_bytes_per_s", {}).items()},
                tp_linear_host_s=tuple(float(t) for t in data.get("tp_linear_host_s", ())),
                sync_wait_fraction=float(data.get("sync_wait_fraction", 0.0)),
            )
        except ProfileError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise ProfileError(f"op table: bad or missing field ({type(exc).__name__}: {exc}); expected keys device, dtype, "
                               f"times_s_by_key {{key: seconds}}, matmul_times_s [{{flops, time_s}}], "
                               f"attention_head_times_s [{{flops, fwd_s, bwd_s}}], loss_bytes_per_s, "
                               f"elementwise_bytes_per_s {{op: bytes per second}}, tp_linear_host_s [forward s, backward s], "
                               f"sync_wait_fraction") from None
