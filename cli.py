"""paraplan command line: parses arguments, calls the planner API, renders the result.

Errors the user can fix print one line to stderr and exit 2 (bad input) or 3 (no feasible plan).
"""
from __future__ import annotations

import argparse
import json
import sys


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad arguments in one line (exit 2) instead of usage text."""

    def error(self, message: str):
        sys.stderr.write(f"paraplan: error: {message}\n")
        raise SystemExit(2)


def _positive(name: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--{name}={text!r}: expected a positive integer") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"--{name}={value}: must be a positive integer")
        return value

    return parse


def _add_model_args(parser: argparse.ArgumentParser, needs_batch: bool) -> None:
    parser.add_argument("--model", required=True, help="zoo name, spec file (.yaml/.json) or package.module:factory")
    parser.add_argument("--seq-len", type=_positive("seq-len"), help="tokens per sequence (default: the model's)")
    if needs_batch:
        parser.add_argument("--cluster", required=True, help="cluster name, cluster file, or DEVICE:NODESxGPUS")
        parser.add_argument("--global-batch", type=_positive("global-batch"), required=True, help="sequences per optimizer step")
        parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp8"])
        parser.add_argument("--attention", default="flash", choices=["flash", "unfused"],
                            help="attention kernel of the training code (unfused: scores materialised, pre-FlashAttention)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _add_config_args(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument("--tp", type=_positive("tp"), required=required)
    parser.add_argument("--pp", type=_positive("pp"), required=required)
    parser.add_argument("--dp", type=_positive("dp"))
    parser.add_argument("--cp", type=_positive("cp"))
    parser.add_argument("--ep", type=_positive("ep"))
    parser.add_argument("--vpp", type=_positive("vpp"))
    parser.add_argument("--micro-batch", type=_positive("micro-batch"))
    parser.add_argument("--zero", type=int, choices=[0, 1, 2, 3])
    parser.add_argument("--recompute", choices=["none", "selective", "full"])
    parser.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved", "zb"])


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="paraplan", description="Auto-parallelism planner for PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sub.add_parser("models", help="list built-in models")
    hardware = sub.add_parser("hardware", help="list built-in devices and clusters, or show one")
    hardware.add_argument("name", nargs="?")
    inspect = sub.add_parser("inspect", help="per-layer FLOPs, parameters and activation bytes")
    _add_model_args(inspect, needs_batch=False)
    inspect.add_argument("--micro-batch", type=_positive("micro-batch"), default=1)
    evaluate = sub.add_parser("evaluate", help="predict one parallel configuration")
    _add_model_args(evaluate, needs_batch=True)
    _add_config_args(evaluate, required=True)
    plan = sub.add_parser("plan", help="search the best plan")
    _add_model_args(plan, needs_batch=True)
    _add_config_args(plan, required=False)
    plan.add_argument("--out", help="write the plan to .json or .yaml")
    plan.add_argument("--explain", action="store_true", help="also list rejected options and why")
    plan.add_argument("--top", type=_positive("top"), default=5, help="alternatives to keep")
    plan.add_argument("--mem-headroom", type=float, default=0.0, help="fraction of device memory to keep free (0-0.9)")
    return parser


_CONFIG_KEYS = ("tp", "pp", "dp", "cp", "ep", "vpp", "micro_batch", "zero", "recompute", "schedule")


def _constraints(args) -> dict:
    return {key: getattr(args, key) for key in _CONFIG_KEYS if getattr(args, key, None) is not None}


def _print_json(data: dict) -> None:
    print(json.dumps(data, indent=2))


def _run(args) -> int:
    from rich.console import Console

    console = Console()
    if args.command == "models":
        from planner.models import list_models

        for name in list_models():
            print(name)
        return 0
    if args.command == "hardware":
        from planner.report.hardware import render_hardware, render_hardware_list

        console.print(render_hardware(args.name) if args.name else render_hardware_list())
        return 0
    if args.command == "inspect":
        from planner.api import model_graph
        from planner.report.inspect import inspect_json, render_inspect

        graph = model_graph(args.model, seq_len=args.seq_len, micro_batch=args.micro_batch)
        if args.json:
            _print_json(inspect_json(graph))
        else:
            console.print(render_inspect(graph))
        return 0
    if args.command == "evaluate":
        import planner
        from planner.report.estimate import estimate_json, render_estimate

        result = planner.evaluate(args.model, args.cluster, _constraints(args), global_batch=args.global_batch, seq_len=args.seq_len, dtype=args.dtype,
                                  attention=args.attention)
        if args.json:
            _print_json(estimate_json(result))
        else:
            console.print(render_estimate(result))
        return 0
    if args.command == "plan":
        import planner
        from planner.report.plan import render_plan

        result = planner.plan(
            args.model, args.cluster, global_batch=args.global_batch, seq_len=args.seq_len, dtype=args.dtype, attention=args.attention,
            mem_headroom=args.mem_headroom, top=args.top, **_constraints(args),
        )
        if args.out:
            result.save(args.out)
        if args.json:
            _print_json(result.to_dict())
        else:
            console.print(render_plan(result, explain=args.explain))
        return 0
    raise AssertionError(args.command)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from costmodel.errors import ProfileError
    from planner.errors import PlannerError

    try:
        return _run(args)
    except PlannerError as error:
        sys.stderr.write(f"paraplan: {error.message}\n")
        return error.exit_code
    except ProfileError as error:
        sys.stderr.write(f"paraplan: {error}\n")
        return 2
    except BrokenPipeError:
        # the reader (e.g. `| head`) closed the pipe: nothing left to say
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
