"""paraplan command line: parses arguments, calls the planner API, renders the result.

Errors the user can fix print one line to stderr and exit 2 (bad input) or 3 (no feasible plan). A
sweep whose points failed with an unexpected error (kept as `error` rows, planned again by a re-run)
exits `SWEEP_ERRORS_EXIT`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys

from planner.config import TRAINING_DTYPES
from planner.errors import PlannerError, invalid
from planner.output_paths import check_writable_dir, check_writable_file


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


def _listed(name: str, positive: bool = False):
    """A comma-separated list flag, e.g. `--devices h100-sxm,a100-80g` or `--cluster-sizes 8,16`."""
    def parse(text: str) -> list:
        items = [part.strip() for part in text.split(",")]
        return [_positive(name)(item) for item in items] if positive else items

    return parse


def _add_sweep_args(sub) -> None:
    sweep = sub.add_parser("sweep", help="plan many (model, cluster, batch, sequence length) points; resumable results file")
    sweep.add_argument("file", nargs="?", help="sweep file (YAML, see examples/sweep.yaml); flags override its keys")
    sweep.add_argument("--models", type=_listed("models"), help="comma-separated models")
    sweep.add_argument("--devices", type=_listed("devices"), help="comma-separated devices, each crossed with --cluster-sizes")
    sweep.add_argument("--cluster-sizes", type=_listed("cluster-sizes", positive=True),
                       help="comma-separated device counts (one node up to the device's node size, whole nodes beyond)")
    sweep.add_argument("--clusters", type=_listed("clusters"), help="comma-separated clusters (names, files, DEVICE:NODESxGPUS)")
    sweep.add_argument("--global-batches", type=_listed("global-batches", positive=True), help="comma-separated global batches")
    sweep.add_argument("--seq-lens", type=_listed("seq-lens", positive=True), help="comma-separated sequence lengths")
    sweep.add_argument("--dtype", choices=TRAINING_DTYPES)
    sweep.add_argument("--attention", choices=["flash", "flash2", "unfused"])
    sweep.add_argument("--loss", choices=["torch", "inplace", "fused"])
    sweep.add_argument("--tp-comm-overlap", dest="tp_overlap", action="store_const", const=True,
                       help="TP collectives overlapped with GEMMs (Megatron-Core --tp-comm-overlap, async TP)")
    sweep.add_argument("--zero3-fetch", dest="zero3_fetch", choices=["prefetch", "blocking"],
                       help="how the training code fetches ZeRO-3 parameters (as for plan)")
    sweep.add_argument("--dp-sync", dest="dp_sync", choices=["overlapped", "blocking"],
                       help="how the training code synchronises data-parallel states below ZeRO-3 (as for plan)")
    sweep.add_argument("--elementwise", choices=["eager", "fused"], help="how the training code runs memory-bound ops (as for plan)")
    sweep.add_argument("--pp-buffers", dest="pp_buffers", choices=["preallocated", "transient"],
                       help="how the training code's pipeline holds received tensors (as for plan)")
    sweep.add_argument("--cp-comm", dest="cp_comm", choices=["all_gather", "a2a"],
                       help="how context parallelism exchanges keys and values (as for plan)")
    sweep.add_argument("--out", required=True, help="results file, .csv or .jsonl; re-running resumes it")
    sweep.add_argument("--workers", type=_positive("workers"), help="local worker processes (default: one per CPU)")
    sweep.add_argument("--executor", choices=["local", "ray"], default="local", help="ray: run points as Ray tasks")
    sweep.add_argument("--address", help="Ray cluster address for --executor ray (default: start a local Ray)")
    sweep.add_argument("--plan-dir", help="also save each plan as JSON in this folder")
    sweep.add_argument("--charts", metavar="DIR", help="write throughput, MFU and cost charts (PNG) to this folder")
    report = sub.add_parser("report", help="an HTML or Markdown report (tables and charts) of a sweep's results file")
    report.add_argument("results", help="results file of `paraplan sweep` (.csv or .jsonl)")
    report.add_argument("--out", required=True, help="report file, .html or .md")


def _add_model_args(parser: argparse.ArgumentParser, needs_batch: bool, from_plan: bool = False) -> None:
    """The workload flags; with `from_plan`, a saved plan (`--plan`) may give the model, cluster,
    global batch and sequence length instead (`_evaluated_config` asks for them without one)."""
    parser.add_argument("--model", required=not from_plan, help="zoo name, spec file (.yaml/.json) or package.module:factory"
                        + (" (default: a saved plan's)" if from_plan else ""))
    parser.add_argument("--seq-len", type=_positive("seq-len"), help="tokens per sequence (default: the model's"
                        + (", or a saved plan's)" if from_plan else ")"))
    if needs_batch:
        parser.add_argument("--cluster", required=not from_plan, help="cluster name, cluster file, or DEVICE:NODESxGPUS"
                            + (" (default: a saved plan's)" if from_plan else ""))
        parser.add_argument("--global-batch", type=_positive("global-batch"), required=not from_plan,
                            help="sequences per optimizer step" + (" (default: a saved plan's)" if from_plan else ""))
        parser.add_argument("--dtype", choices=TRAINING_DTYPES, help="training dtype (default: bf16, or a saved plan's)")
        parser.add_argument("--attention", choices=["flash", "flash2", "unfused"],
                            help="attention kernel of the training code (flash: the device's own, e.g. cuDNN or FlashAttention-3 "
                                 "on Hopper; flash2: FlashAttention-2's; unfused: scores materialised, pre-FlashAttention)")
        parser.add_argument("--loss", choices=["torch", "inplace", "fused"],
                            help="cross-entropy kernel of the training code (torch: fp32 logits and F.cross_entropy; "
                                 "inplace: fp32 logits worked in place, Megatron's vocab-parallel cross-entropy; "
                                 "fused: one kernel over the half-precision logits, e.g. flash-attn's xentropy)")
        parser.add_argument("--tp-comm-overlap", action="store_const", const=True,
                            help="the training code overlaps tensor-parallel collectives with GEMMs (Megatron-Core --tp-comm-overlap, async TP)")
        parser.add_argument("--zero3-fetch", choices=["prefetch", "blocking"],
                            help="how the training code fetches ZeRO-3 parameters (prefetch: FSDP, overlapped with compute; "
                                 "blocking: DeepSpeed ZeRO-3 of spring 2021, each fetch stalls compute)")
        parser.add_argument("--dp-sync", choices=["overlapped", "blocking"],
                            help="how the training code synchronises data-parallel states below ZeRO-3 (overlapped: "
                                 "FSDP, DDP, Megatron-Core, behind the backward; blocking: DeepSpeed's pipeline engine "
                                 "with BF16_Optimizer, an fp32 all-reduce after the last backward and the ZeRO-1 "
                                 "gather after the step)")
        parser.add_argument("--elementwise", choices=["eager", "fused"],
                            help="how the training code runs elementwise ops and norms (eager: one kernel per op; "
                                 "fused: each chain between GEMMs in one kernel, as torch.compile and Transformer Engine do)")
        parser.add_argument("--pp-buffers", choices=["preallocated", "transient"],
                            help="how the training code's pipeline holds received tensors (preallocated: a buffer per "
                                 "micro-batch, torch.distributed.pipelining and Plan.apply; transient: Megatron-LM, DeepSpeed)")
        parser.add_argument("--cp-comm", choices=["all_gather", "a2a"],
                            help="how context parallelism exchanges attention's inputs (all_gather: every rank gathers the "
                                 "keys and values, ring attention, Megatron-Core p2p; a2a: DeepSpeed-Ulysses all-to-all "
                                 "of heads, Megatron-Core a2a)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _add_config_args(parser: argparse.ArgumentParser, recompute_default: str) -> None:
    parser.add_argument("--tp", type=_positive("tp"))
    parser.add_argument("--pp", type=_positive("pp"))
    parser.add_argument("--dp", type=_positive("dp"))
    parser.add_argument("--cp", type=_positive("cp"))
    parser.add_argument("--ep", type=_positive("ep"))
    parser.add_argument("--vpp", type=_positive("vpp"))
    parser.add_argument("--micro-batch", type=_positive("micro-batch"))
    parser.add_argument("--zero", type=int, choices=[0, 1, 2, 3])
    parser.add_argument("--recompute", choices=["none", "selective", "full", "selective_op"],
                        help=f"selective_op: torchtitan's op-level selective checkpointing (default: {recompute_default})")
    parser.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved", "zb"])
    parser.add_argument("--offload-optimizer", action="store_const", const=True,
                        help="keep Adam states in host memory and update on the CPU (ZeRO-Offload)")
    parser.add_argument("--dp-replicate", type=_positive("dp-replicate"),
                        help="hybrid sharding (HSDP): replicas of the ZeRO shards, each over dp/R ranks; needs --zero 1-3")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="paraplan", description="Auto-parallelism planner for PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sub.add_parser("models", help="list built-in models")
    hardware = sub.add_parser("hardware", help="list built-in devices and clusters, or show one")
    hardware.add_argument("name", nargs="?")
    inspect = sub.add_parser("inspect", help="per-layer FLOPs, parameters and activation bytes")
    _add_model_args(inspect, needs_batch=False)
    inspect.add_argument("--micro-batch", type=_positive("micro-batch"), help="sequences per forward (default: 1, or the "
                         "batch of the example inputs a model fixes)")
    inspect.add_argument("--dtype", default="bf16", choices=TRAINING_DTYPES,
                         help="training dtype the model is traced in (activation bytes follow it)")
    evaluate = sub.add_parser("evaluate", help="predict one parallel configuration")
    _add_model_args(evaluate, needs_batch=True, from_plan=True)
    _add_config_args(evaluate, recompute_default="none")
    evaluate.add_argument("--plan", metavar="FILE", help="price a saved plan (.json/.yaml from `plan --out`) as planned: its degrees, "
                                                      "stage split, per-layer recompute and training code; instead of --tp/--pp/...")
    plan = sub.add_parser("plan", help="search the best plan")
    _add_model_args(plan, needs_batch=True)
    _add_config_args(plan, recompute_default="search every policy the trace measured")
    plan.add_argument("--out", help="write the plan to .json or .yaml")
    plan.add_argument("--explain", action="store_true", help="also list rejected options and why")
    plan.add_argument("--no-offload", dest="allow_offload", action="store_false",
                      help="never offload optimizer states, even when nothing fits without")
    plan.add_argument("--top", type=_positive("top"), default=5, help="alternatives to keep")
    plan.add_argument("--mem-headroom", type=float, default=0.0, help="fraction of device memory to keep free (0-0.9)")
    plan.add_argument("--timeline", metavar="PATH", help="draw the pipeline timeline of one step (.png or .svg)")
    plan.add_argument("--memory-chart", metavar="PATH", help="draw memory per stage against capacity (.png or .svg)")
    _add_sweep_args(sub)
    profile = sub.add_parser("profile", help="measure this machine (under torchrun: also collectives) and write a cluster profile")
    profile.add_argument("--out", required=True, help="cluster file to write (.yaml); its device file and op tables go beside it")
    profile.add_argument("--like", help="device profile whose unmeasured fields (NIC; the link when run alone) are kept")
    profile.add_argument("--quick", action="store_true", help="small sizes and short timings (seconds)")
    return parser


# Exit status of a sweep that finished with `error` rows (neither bad input nor no feasible plan).
SWEEP_ERRORS_EXIT = 1

_CONFIG_KEYS = ("tp", "pp", "dp", "cp", "ep", "vpp", "micro_batch", "zero", "recompute", "schedule", "offload_optimizer",
               "dp_replicate")


def _constraints(args) -> dict:
    return {key: getattr(args, key) for key in _CONFIG_KEYS if getattr(args, key, None) is not None}


def _training_code(args) -> dict:
    """The training-code flags given to evaluate or plan, as `planner.evaluate`/`planner.plan` take them
    (a flag not given keeps the default, or a saved plan's choice)."""
    given = {"attention": args.attention, "tp_overlap": args.tp_comm_overlap, "loss": args.loss, "zero3_fetch": args.zero3_fetch,
             "dp_sync": args.dp_sync, "elementwise": args.elementwise, "pp_buffers": args.pp_buffers, "cp_comm": args.cp_comm}
    return {key: value for key, value in given.items() if value is not None}


def _evaluated_config(args):
    """The configuration `evaluate` prices: the degrees given, or a saved plan (`--plan`)."""
    degrees = _constraints(args)
    if args.plan is None:
        missing = [f"--{key.replace('_', '-')}" for key in ("model", "cluster", "global_batch") if getattr(args, key) is None]
        missing += [f"--{key}" for key in ("tp", "pp") if key not in degrees]
        if missing:
            raise invalid(f"evaluate: {', '.join(missing)} required; give them, or --plan FILE to price a saved plan")
        return degrees
    if degrees:
        flags = ", ".join(f"--{key.replace('_', '-')}" for key in degrees)
        raise invalid(f"evaluate --plan: {flags} also given; a plan fixes its own degrees, so drop them (or drop --plan)")
    from planner.result import Plan

    return Plan.load(args.plan)


def _with_apply_note(plan, model: str):
    """`plan` with a note when `Plan.apply` would refuse it for `model` (checked for tensor, pipeline,
    context and expert parallelism and selective recompute, which depend on the model's module
    structure; importing the apply costs a second otherwise spared)."""
    config = plan.config
    if config.tp == config.pp == config.cp == config.ep == 1 and not plan.memory_plan.get("recompute", {}).get("selective"):
        return plan
    from planner.apply import apply_note

    note = apply_note(plan, model)
    if not note:
        return plan
    return dataclasses.replace(plan, estimate=dataclasses.replace(plan.estimate, notes=(*plan.estimate.notes, note)))


# Characters the inspect table needs to show its numbers whole (layer name and nine numeric columns).
INSPECT_MIN_WIDTH = 120


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

        graph = model_graph(args.model, seq_len=args.seq_len, micro_batch=args.micro_batch or 1, dtype=args.dtype)
        if args.micro_batch not in (None, graph.micro_batch):
            raise invalid(f"micro-batch={args.micro_batch}: model `{graph.name}` has fixed example inputs of "
                          f"{graph.micro_batch} samples; leave --micro-batch out or give {graph.micro_batch}")
        if args.json:
            _print_json(inspect_json(graph))
        else:
            # Nine columns of numbers: below this width rich would cut them short; wider lines wrap, whole.
            Console(width=max(console.width, INSPECT_MIN_WIDTH)).print(render_inspect(graph))
        return 0
    if args.command == "evaluate":
        import planner
        from planner.report.estimate import estimate_json, render_estimate

        config = _evaluated_config(args)
        saved = config if isinstance(config, planner.Plan) else None
        try:
            result = planner.evaluate(args.model or saved.model, args.cluster or saved.cluster, config,
                                      global_batch=args.global_batch or saved.global_batch, seq_len=args.seq_len,
                                      dtype=args.dtype, **_training_code(args))
        except PlannerError as error:
            if args.model or not error.message.startswith(f"model `{saved.model}`: not a built-in model"):
                raise
            raise invalid(f"--model: the plan names model `{saved.model}`, which is not a built-in name, a spec file or "
                          "a factory (a plan made from a module in Python); pass --model") from None
        if args.json:
            _print_json(estimate_json(result))
        else:
            console.print(render_estimate(result))
        return 0
    if args.command == "plan":
        import planner
        from planner.report.plan import render_plan
        from planner.report.plan_charts import check_plan_chart_paths, save_plan_charts
        from planner.result import check_plan_path

        check_plan_chart_paths(args.timeline, args.memory_chart)
        if args.out:
            check_plan_path(args.out)
        for option, path in (("--out", args.out), ("--timeline", args.timeline), ("--memory-chart", args.memory_chart)):
            if path:
                check_writable_file(path, option)
        result = planner.plan(
            args.model, args.cluster, global_batch=args.global_batch, seq_len=args.seq_len, dtype=args.dtype or "bf16", **_training_code(args),
            mem_headroom=args.mem_headroom, top=args.top, allow_offload=args.allow_offload, **_constraints(args),
        )
        result = _with_apply_note(result, args.model)
        if args.out:
            result.save(args.out)
        save_plan_charts(result, args.timeline, args.memory_chart)
        if args.json:
            _print_json(result.to_dict())
        else:
            console.print(render_plan(result, explain=args.explain))
        return 0
    if args.command == "sweep":
        return _sweep(args, console)
    if args.command == "profile":
        from costmodel.profile import run_profile

        for path in run_profile(args.out, like=args.like, quick=args.quick, show_progress=sys.stderr.isatty()):
            console.print(f"wrote {path}")
        return 0
    if args.command == "report":
        from planner.report.sweep_report import write_sweep_report

        check_writable_file(args.out, "--out")
        console.print(f"wrote {write_sweep_report(args.results, args.out)}")
        return 0
    raise AssertionError(args.command)


def _sweep(args, console) -> int:
    from planner.report.sweep_charts import save_sweep_charts
    from planner.report.sweep_report import render_sweep_summary
    from planner.sweeps.results import read_results
    from planner.sweeps.runner import SweepInterrupted, sweep
    from planner.sweeps.spec import CODE_KEYS, GRID_LIST_KEYS, load_sweep_spec

    keys = (*GRID_LIST_KEYS, "dtype", *CODE_KEYS)  # the flags that override the sweep file's keys
    spec = load_sweep_spec(args.file, {key: getattr(args, key) for key in keys})
    check_writable_file(args.out, "--out")
    for option, folder in (("--plan-dir", args.plan_dir), ("--charts", args.charts)):
        if folder:
            check_writable_dir(folder, option)
    try:
        summary = sweep(spec, args.out, workers=args.workers, executor=args.executor, address=args.address,
                        plan_dir=args.plan_dir, progress=sys.stderr.isatty())
    except SweepInterrupted as stopped:
        sys.stderr.write(f"paraplan: {stopped}\n")
        return stopped.exit_code
    console.print(render_sweep_summary(summary))
    earlier = summary.points - summary.planned
    if args.plan_dir and earlier:
        console.print(f"--plan-dir: the {earlier} points already in {args.out} were not planned again, so no plans were "
                      f"saved for them; write to a new --out file to save every plan")
    for path in save_sweep_charts(read_results(args.out), args.charts) if args.charts else ():
        console.print(f"wrote {path}")
    errors = summary.status_counts.get("error", 0)
    if errors:
        sys.stderr.write(f"paraplan: {errors} of {summary.points} points failed with an unexpected error (status error "
                         f"in {args.out}); re-run the same command to plan them again\n")
        return SWEEP_ERRORS_EXIT
    return 0


class _Terminated(BaseException):
    """SIGTERM (`timeout`, a batch scheduler) reached the command. A BaseException, as KeyboardInterrupt
    is, so that no `except Exception` on the way (a tracer trying its next method) swallows it."""


def _terminate(signum, frame):
    raise _Terminated


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from costmodel.errors import ProfileError

    signal.signal(signal.SIGTERM, _terminate)  # a sweep installs its own while it runs
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # `--model mymodel:build` imports mymodel.py from here, as `python -m` would
    try:
        return _run(args)
    except PlannerError as error:
        sys.stderr.write(f"paraplan: {error.message}\n")
        return error.exit_code
    except ProfileError as error:
        sys.stderr.write(f"paraplan: {error}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("paraplan: interrupted\n")
        return 130
    except _Terminated:
        sys.stderr.write("paraplan: terminated\n")
        return 128 + signal.SIGTERM
    except BrokenPipeError:
        # the reader (e.g. `| head`) closed the pipe: nothing left to say
        sys.stderr.close()
        return 0
    except OSError as error:  # a path the command reads or writes: a folder, a missing folder, no permission
        sys.stderr.write(f"paraplan: {error.filename or error}: {error.strerror or 'cannot be used'}; give another path\n")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
