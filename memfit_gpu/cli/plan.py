"""`memfit plan`: where each part of a run would live and the memory it would take, before anything loads (memfit_gpu/plan/)."""

from __future__ import annotations

import argparse
import json
import sys

DESCRIPTION = """\
Print the device plan of a configuration: for every part of the run (vLLM engines and their claims,
the loaded benchmark and store, bi-encoder and cross-encoder replicas, the write path, BM25 and dense
indexes of episodes and summaries, transformers readers, CUDA contexts) where it lives and its predicted
host and GPU memory, then each GPU's total against its memory, the host's against RAM, and the verdict.
Nothing is loaded: the workload is counted from the benchmark file when it is there (else the benchmark's
published shape) and model sizes come from the weights on disk (else a table of known models).

The node is this machine (the GPUs torch sees, CUDA_VISIBLE_DEVICES applies; host RAM or the cgroup
limit), or the one described with --gpus / --gpu-mem-gib / --host-mem-gib. A node described with --gpus
is assumed to have GPU FAISS (the [gpu] install) unless --faiss cpu.

Exit code 0: it fits; 2: it does not, with the key to change (the same check `memfit run` makes before
it starts)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan", help="predicted host and GPU memory of each part of a run, per GPU, and whether it fits",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--config", required=True, help="YAML config, e.g. configs/experiments/longmemeval_s_qwen3_8b.yaml")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs on the node (default: this machine's)")
    parser.add_argument("--gpu-mem-gib", type=float, default=None, help="memory of each GPU in GiB (default: this machine's)")
    parser.add_argument("--host-mem-gib", type=float, default=None, help="host RAM in GiB (default: this machine's)")
    parser.add_argument("--faiss", choices=("auto", "gpu", "cpu"), default="auto",
                        help="FAISS build of the node: auto = this machine's, or GPU when --gpus describes the node")
    parser.add_argument("--retrieval-only", action="store_true", help="plan retrieval alone (`memfit retrieve`)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dot-list overrides")
    parser.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    from memfit_gpu.cli.errors import EXIT_USER_ERROR, UsageError
    from memfit_gpu.config import load_config
    from memfit_gpu.plan import described_node, make_plan, render

    for flag, value in (("--gpus", args.gpus), ("--gpu-mem-gib", args.gpu_mem_gib), ("--host-mem-gib", args.host_mem_gib)):
        if value is not None and (value < 0 if flag == "--gpus" else value <= 0):
            raise UsageError(f"{flag} {value:g}: must be {'>= 0' if flag == '--gpus' else '> 0'}")
    cfg = load_config(args.config, args.overrides)
    faiss_gpu = None if args.faiss == "auto" else args.faiss == "gpu"
    node = described_node(args.gpus, args.gpu_mem_gib, args.host_mem_gib, faiss_gpu)
    plan = make_plan(cfg, node, readers=not args.retrieval_only, config_name=str(args.config))
    print(json.dumps(plan.to_dict(), indent=2) if args.json else render(plan))
    if plan.fits:
        return 0
    # the reason on stderr in the shape of every other refusal (`memfit plan: error: ...`), exit 2
    print(f"memfit plan: error: {plan.problems[0].message}", file=sys.stderr)
    return EXIT_USER_ERROR
