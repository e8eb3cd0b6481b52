"""Rendering of a ModelGraph: what `paraplan inspect` prints (a table, or the JSON contract)."""
from __future__ import annotations

import dataclasses
import itertools
import os

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from planner.graph import Layer, LayerKind, ModelGraph, Recompute
from planner.report.units import fmt_bytes, fmt_count, fmt_flops


def inspect_json(graph: ModelGraph) -> dict:
    """The `inspect --json` object (DESIGN.md contract), plus `dtype`, `dims`, `notes` and, per
    layer, `fqns`, `param_bytes`, `expert_params`, `frozen_params`, `buffer_bytes` and `signature`.

    Args:
        graph: a traced ModelGraph.

    Returns:
        A JSON-serialisable dict; FLOPs and bytes are for one micro-batch.
    """
    return {
        "model": graph.name,
        "seq_len": graph.seq_len,
        "micro_batch": graph.micro_batch,
        "dtype": graph.dtype,
        "trace_method": graph.trace_method,
        "params": graph.params,
        "fwd_flops": graph.fwd_flops,
        "bwd_flops": graph.bwd_flops,
        "dims": dataclasses.asdict(graph.dims),
        "notes": list(graph.notes),
        "layers": [_layer_json(layer) for layer in graph.layers],
    }


def _layer_json(layer: Layer) -> dict:
    return {
        "name": layer.name,
        "kind": layer.kind.value,
        "params": layer.params,
        "fwd_flops": layer.fwd_flops,
        "bwd_flops": layer.bwd_flops,
        "saved_bytes": {policy.value: layer.saved_bytes[policy] for policy in Recompute if policy in layer.saved_bytes},
        "out_bytes": layer.out_bytes,
        "fqns": list(layer.fqns),
        "param_bytes": layer.param_bytes,
        "expert_params": layer.expert_params,
        "frozen_params": layer.frozen_params,
        "buffer_bytes": layer.buffer_bytes,
        "signature": layer.signature,
    }


def render_inspect(graph: ModelGraph) -> RenderableType:
    """A per-layer table with a totals row, followed by the trace notes.

    Consecutive blocks with the same signature are collapsed into one row (e.g.
    "layers.0-125 (x126)") that shows the numbers of one block; the totals row counts all.

    Args:
        graph: a traced ModelGraph.

    Returns:
        A rich renderable.
    """
    table = Table(
        title=(f"{graph.name}: {graph.micro_batch} x {graph.seq_len} tokens, {graph.dtype}, "
               f"traced with {graph.trace_method}"),
        caption="Collapsed rows (xN) show one of N identical blocks; the total counts all. "
                "Saved = activation bytes kept for backward per recompute policy.",
        title_justify="left", caption_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
        collapse_padding=True)
    table.add_column("layer", no_wrap=True)
    for header in ("params", "fwd", "bwd", *(f"saved\n{p.value}" for p in Recompute), "out"):
        table.add_column(header, justify="right", no_wrap=True)
    for label, layer in _rows(graph.layers):
        table.add_row(label, *_numbers(layer), fmt_bytes(layer.out_bytes))
    table.add_section()
    table.add_row("total", fmt_count(graph.params), fmt_flops(graph.fwd_flops),
                  fmt_flops(graph.bwd_flops),
                  *(_total_saved(graph, p) for p in Recompute), "", style="bold")
    notes = [Text(f"note: {note}", style="dim") for note in graph.notes]
    return Group(table, *notes)


def _rows(layers: tuple[Layer, ...]) -> list[tuple[str, Layer]]:
    """(label, representative layer) per table row, runs of identical blocks collapsed."""
    rows = []
    for (kind, _), run in itertools.groupby(layers, key=lambda layer: (layer.kind,
                                                                        layer.signature)):
        run = list(run)
        if kind == LayerKind.BLOCK and len(run) > 1:
            rows.append((f"{_span(run[0].name, run[-1].name)} (x{len(run)})", run[0]))
        else:
            rows += [(layer.name, layer) for layer in run]
    return rows


def _span(first: str, last: str) -> str:
    """"layers.0", "layers.125" -> "layers.0-125"; names without a shared prefix -> "a..b"."""
    prefix = os.path.commonprefix([first, last]).rpartition(".")[0]
    if prefix:
        return f"{prefix}.{first[len(prefix) + 1:]}-{last[len(prefix) + 1:]}"
    return f"{first}..{last}"


def _numbers(layer: Layer) -> list[str]:
    return [fmt_count(layer.params), fmt_flops(layer.fwd_flops), fmt_flops(layer.bwd_flops),
            *(fmt_bytes(layer.saved_bytes[p]) if p in layer.saved_bytes else "-" for p in Recompute)]


def _total_saved(graph, policy: Recompute) -> str:
    """Saved bytes of every layer under `policy`; "-" when some layer was not measured under it
    (op-level checkpointing needs an op graph)."""
    if any(policy not in layer.saved_bytes for layer in graph.layers):
        return "-"
    return fmt_bytes(sum(layer.saved_bytes[policy] for layer in graph.layers))
