"""The arguments of the `paraplan` command line (`cli.py` runs the commands): each subcommand's
options, parsed so that a bad one is reported in one line with exit 2."""
from __future__ import annotations

import argparse
import difflib

from planner.config import TRAINING_DTYPES


class ArgumentsError(Exception):
    """A bad command-line argument, as one line (`cli.main` reports it with exit 2, and under
    --json as the error object too)."""


# How close an unknown option must be to a known one to be named as what was meant (difflib ratio).
OPTION_GUESS_CUTOFF = 0.75


class _Parser(argparse.ArgumentParser):
    """argparse that raises ArgumentsError for bad arguments instead of printing usage text."""

    def error(self, message: str):
        raise ArgumentsError(message)


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    """`argv` parsed (`build_parser`); ArgumentsError for a bad one, naming the subcommands where none
    is given and the subcommand's nearest option for one it does not know (`--global_batch`: did you
    mean `--global-batch`?)."""
    parser = build_parser()
    try:
        return parser.parse_args(argv)
    except ArgumentsError as error:
        message = str(error)
        subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
        command = subcommands.get(argv[0]) if argv else None
        if command is None and message.endswith("required: command"):
            raise ArgumentsError(f"{message}; give one of {', '.join(subcommands)} first (paraplan -h)") from None
        if command is None or not message.startswith("unrecognized arguments:"):
            raise
        known = [option for action in command._actions for option in action.option_strings if option.startswith("--")]
        guesses = [difflib.get_close_matches(token.split("=")[0].replace("_", "-"), known, n=1, cutoff=OPTION_GUESS_CUTOFF)
                   for token in message.split(":", 1)[1].split() if token.startswith("-")]
        if named := [guess[0] for guess in guesses if guess]:
            message += f"; did you mean {', '.join(named)}?"
        raise ArgumentsError(message) from None


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
    sweep.add_argument("--attention", choices=["flash", "flash2", "flash1", "unfused"])
    sweep.add_argument("--loss", choices=["torch", "inplace", "fused"])
    sweep.add_argument("--tp-comm-overlap", dest="tp_overlap", nargs="?", const="full", choices=["none", "full", "forward"],
                       help="TP collectives overlapped with GEMMs (as for plan)")
    sweep.add_argument("--zero3-fetch", dest="zero3_fetch", choices=["prefetch", "blocking"],
                       help="how the training code fetches ZeRO-3 parameters (as for plan)")
    sweep.add_argument("--dp-sync", dest="dp_sync", choices=["overlapped", "blocking"],
                       help="how the training code synchronises data-parallel states below ZeRO-3 (as for plan)")
    sweep.add_argument("--elementwise", choices=["eager", "fused"], help="how the training code runs memory-bound ops (as for plan)")
    sweep.add_argument("--pp-buffers", dest="pp_buffers", choices=["preallocated", "transient"],
                       help="how the training code's pipeline holds received tensors (as for plan)")
    sweep.add_argument("--pp-outputs", dest="pp_outputs", choices=["dropped", "kept"],
                       help="what the training code's pipeline keeps of the last stage's outputs (as for plan)")
    sweep.add_argument("--cp-comm", dest="cp_comm", choices=["all_gather", "a2a"],
                       help="how context parallelism exchanges keys and values (as for plan)")
    sweep.add_argument("--sp-gather", dest="sp_gather", choices=["kept", "regathered"],
                       help="what sequence parallelism keeps of its all-gathered matmul inputs (as for plan)")
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
        parser.add_argument("--attention", choices=["flash", "flash2", "flash1", "unfused"],
                            help="attention kernel of the training code (flash: the device's own, e.g. cuDNN or FlashAttention-3 "
                                 "on Hopper; flash2: FlashAttention-2's; flash1: the first FlashAttention's or its Triton "
                                 "port; unfused: scores materialised, pre-FlashAttention)")
        parser.add_argument("--loss", choices=["torch", "inplace", "fused"],
                            help="cross-entropy kernel of the training code (torch: fp32 logits and F.cross_entropy; "
                                 "inplace: fp32 logits worked in place, Megatron's vocab-parallel cross-entropy; "
                                 "fused: one kernel over the half-precision logits, e.g. flash-attn's xentropy, or a torch.compile'd loss)")
        parser.add_argument("--tp-comm-overlap", nargs="?", const="full", choices=["none", "full", "forward"],
                            help="which tensor-parallel collectives the training code overlaps with GEMMs (full, the "
                                 "value when none is given: forward, recomputed forward and backward, Megatron-Core "
                                 "--tp-comm-overlap; forward: the forward pass's only, PyTorch's async TP of 2024; "
                                 "none: exposed, the default)")
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
        parser.add_argument("--pp-outputs", choices=["dropped", "kept"],
                            help="what the training code's pipeline keeps of the last stage's outputs (dropped: each "
                                 "lives while its loss does, Plan.apply, Megatron-LM, DeepSpeed; kept: every micro-batch's "
                                 "logits until the step ends, torch.distributed.pipelining's step() default, torchtitan)")
        parser.add_argument("--cp-comm", choices=["all_gather", "a2a"],
                            help="how context parallelism exchanges attention's inputs (all_gather: every rank gathers the "
                                 "keys and values, ring attention, Megatron-Core p2p; a2a: DeepSpeed-Ulysses all-to-all "
                                 "of heads, Megatron-Core a2a)")
        parser.add_argument("--sp-gather", choices=["kept", "regathered"],
                            help="what sequence parallelism keeps of the inputs it all-gathers for column-parallel "
                                 "matmuls (kept: the gathered tensor, saved by autograd: DTensor, torchtitan, Plan.apply; "
                                 "regathered: the split input, gathered again in backward: Megatron-LM)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _add_config_args(parser: argparse.ArgumentParser, searched: bool) -> None:
    """The configuration flags: `evaluate` prices them (defaults after each help), `plan` fixes each one given
    and searches the rest."""
    def unset(default: str) -> str:
        return " (searched when not given)" if searched else f" ({default})" if default == "required" else f" (default: {default})"

    parser.add_argument("--tp", type=_positive("tp"), help="tensor-parallel degree: ranks splitting each layer's matmuls"
                        + unset("required"))
    parser.add_argument("--pp", type=_positive("pp"), help="pipeline-parallel degree: stages" + unset("required"))
    parser.add_argument("--dp", type=_positive("dp"), help="data-parallel degree: replicas" + unset("what fills the devices"))
    parser.add_argument("--cp", type=_positive("cp"), help="context-parallel degree: ranks splitting each sequence" + unset("1"))
    parser.add_argument("--ep", type=_positive("ep"), help="expert-parallel degree of an MoE, inside dp x cp" + unset("1"))
    parser.add_argument("--vpp", type=_positive("vpp"), help="pipeline chunks per stage (interleaved schedule)" + unset("1"))
    parser.add_argument("--micro-batch", type=_positive("micro-batch"), help="sequences per micro-batch" + unset("1"))
    parser.add_argument("--zero", type=int, choices=[0, 1, 2, 3],
                        help="ZeRO stage: 1 shards the optimizer states, 2 also the gradients, 3 also the weights (FSDP)"
                             + unset("0 where it fits, else the fastest stage that fits"))
    parser.add_argument("--recompute", choices=["none", "selective", "full", "selective_op"],
                        help="activation recompute; selective_op: torchtitan's op-level selective checkpointing"
                             + unset("none"))
    parser.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved", "zb"],
                        help="pipeline schedule" + unset("interleaved with --vpp above 1, else 1f1b"))
    parser.add_argument("--offload-optimizer", action="store_const", const=True,
                        help="keep Adam states in host memory and update on the CPU (ZeRO-Offload)")
    parser.add_argument("--dp-replicate", type=_positive("dp-replicate"),
                        help="hybrid sharding (HSDP): replicas of the ZeRO shards, each over dp/R ranks; needs --zero 1-3")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="paraplan", description="Auto-parallelism planner for PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sub.add_parser("models", help="list built-in models")
    hardware = sub.add_parser("hardware", help="list built-in devices and clusters, or show one")
    hardware.add_argument("name", nargs="?", help="a device, link or cluster name, or a profile file, to show in detail")
    inspect = sub.add_parser("inspect", help="per-layer FLOPs, parameters and activation bytes")
    _add_model_args(inspect, needs_batch=False)
    inspect.add_argument("--micro-batch", type=_positive("micro-batch"), help="sequences per forward (default: 1, or the "
                         "batch of the example inputs a model fixes)")
    inspect.add_argument("--dtype", default="bf16", choices=TRAINING_DTYPES,
                         help="training dtype the model is traced in (activation bytes follow it)")
    evaluate = sub.add_parser("evaluate", help="predict one parallel configuration")
    _add_model_args(evaluate, needs_batch=True, from_plan=True)
    _add_config_args(evaluate, searched=False)
    evaluate.add_argument("--plan", metavar="FILE", help="price a saved plan (.json/.yaml from `plan --out`) as planned: its degrees, "
                                                      "stage split, per-layer recompute and training code; instead of --tp/--pp/...")
    plan = sub.add_parser("plan", help="search the best plan")
    _add_model_args(plan, needs_batch=True)
    _add_config_args(plan, searched=True)
    plan.add_argument("--out", help="write the plan to .json or .yaml (missing folders are created)")
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
