"""paraplan command line: parses arguments (`planner.cli_args`), calls the planner API, renders the result.

Errors the user can fix print one line to stderr and exit 2 (bad input) or 3 (no feasible plan). A
sweep whose points failed with an unexpected error (kept as `error` rows, planned again by a re-run)
exits `SWEEP_ERRORS_EXIT`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
from typing import TextIO

from planner.cli_args import ArgumentsError, parse_arguments
from planner.config import CONFIG_KEYS
from planner.errors import PlannerError, PlannerErrorKind, invalid
from planner.output_paths import check_writable_dir, check_writable_file


# Exit status of a sweep that finished with `error` rows (neither bad input nor no feasible plan).
SWEEP_ERRORS_EXIT = 1

def _constraints(args) -> dict:
    return {key: getattr(args, key) for key in CONFIG_KEYS if getattr(args, key, None) is not None}


def _training_code(args) -> dict:
    """The training-code flags given to evaluate or plan, as `planner.evaluate`/`planner.plan` take them
    (a flag not given keeps the default, or a saved plan's choice)."""
    given = {"attention": args.attention, "tp_overlap": args.tp_comm_overlap, "loss": args.loss, "zero3_fetch": args.zero3_fetch,
             "dp_sync": args.dp_sync, "elementwise": args.elementwise, "pp_buffers": args.pp_buffers, "cp_comm": args.cp_comm,
             "sp_gather": args.sp_gather, "pp_outputs": args.pp_outputs}
    return {key: value for key, value in given.items() if value is not None}


def _evaluated_config(args):
    """The configuration `evaluate` prices: the degrees given, or a saved plan (`--plan`)."""
    degrees = _constraints(args)
    if args.plan is None:
        missing = [f"--{key.replace('_', '-')}" for key in ("model", "cluster", "global_batch") if getattr(args, key) is None]
        missing += [f"--{key}" for key in ("tp", "pp") if key not in degrees]
        if missing:
            raise invalid(f"evaluate: {', '.join(missing)} required; give {'them' if len(missing) > 1 else 'it'}, "
                          f"or --plan FILE to price a saved plan")
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


def _run(args, json_out: TextIO) -> int:
    """Runs the command; `--json` output goes to `json_out`, the real standard output, while what
    user code prints (a factory's own messages) goes to standard error, so the JSON stays whole."""
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
            print(json.dumps(inspect_json(graph), indent=2), file=json_out)
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
            given = lambda key: getattr(saved, key) if getattr(args, key) is None else getattr(args, key)  # noqa: E731
            result = planner.evaluate(given("model"), given("cluster"), config, global_batch=given("global_batch"), seq_len=args.seq_len,
                                      dtype=args.dtype, **_training_code(args))
        except PlannerError as error:
            if args.model is not None or not error.message.startswith(f"model `{saved.model}`: not a built-in model"):
                raise
            raise invalid(f"--model: the plan names model `{saved.model}`, which is not a built-in name, a spec file or "
                          "a factory (a plan made from a module in Python); pass --model") from None
        if args.json:
            print(json.dumps(estimate_json(result), indent=2), file=json_out)
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
            print(json.dumps(result.to_dict(), indent=2), file=json_out)
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
    from planner.sweeps.results import read_results, rows_without_plan
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
    unsaved = rows_without_plan(read_results(args.out), args.plan_dir) if args.plan_dir else 0
    if unsaved:
        console.print(f"--plan-dir: {unsaved} points in {args.out} were planned by an earlier run that saved no plan in "
                      f"{args.plan_dir}, and were not planned again; write to a new --out file to save every plan")
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


def _fail(kind: PlannerErrorKind, message: str, exit_code: int, json_out) -> int:
    """Writes the one-line error to standard error and, under --json, as the JSON object
    {"error": {"kind", "message", "exit_code"}} to `json_out`; returns the exit code."""
    sys.stderr.write(f"paraplan: {message}\n")
    if json_out is not None:
        json.dump({"error": {"kind": str(kind), "message": message, "exit_code": exit_code}}, json_out)
        json_out.write("\n")
    return exit_code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_arguments(argv)
    except ArgumentsError as error:
        return _fail(PlannerErrorKind.INVALID_INPUT, str(error), 2, sys.stdout if "--json" in argv else None)
    from costmodel.errors import ProfileError

    signal.signal(signal.SIGTERM, _terminate)  # a sweep installs its own while it runs
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # `--model mymodel:build` imports mymodel.py from here, as `python -m` would
    json_out = sys.stdout
    wants_json = getattr(args, "json", False)
    try:
        with contextlib.redirect_stdout(sys.stderr) if wants_json else contextlib.nullcontext():
            return _run(args, json_out)
    except PlannerError as error:
        return _fail(error.kind, error.message, error.exit_code, json_out if wants_json else None)
    except ProfileError as error:
        return _fail(PlannerErrorKind.INVALID_INPUT, str(error), 2, json_out if wants_json else None)
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
