"""`memfit profile`: per-stage wall time, GPU memory and utilisation, and a retrieval scaling sweep (profile.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

# DIR/run cannot be resumed as asked: the same errors, said the same way, as `memfit run`
from memfit_gpu.cli.run import user_errors


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "profile",
        help="per-stage wall time, items/s, GPU memory/utilisation, and a retrieval scaling sweep",
        description=(
            "Run the pipeline on a benchmark (DIR/run, resumable) and report per stage (encode, index appends, summaries, "
            "query encoding, BM25, dense, fusion, summary search, expansion, PRF, rerank, pack, read) wall seconds, items/s "
            "and share of the total, with GPU memory and utilisation from NVML where a GPU is present; then a scaling sweep "
            "of batched retrieval over synthetic memories of growing size. Writes DIR/profile.json and DIR/profile.png."
        ),
    )
    parser.add_argument("--config", required=True, help="YAML config, e.g. configs/demo.yaml")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--sizes", default=None,
                        help="episodes per synthetic memory for the scaling sweep, comma-separated ('' = skip)")
    parser.add_argument("--scaling-questions", type=int, default=64, help="questions per scaling point (one batch)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dot-list overrides")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.set_defaults(func=command, user_errors=user_errors)


def command(args: argparse.Namespace) -> int:
    from memfit_gpu.config import load_config
    from memfit_gpu.render import console_table
    from memfit_gpu.run.profile import DEFAULT_SIZES, profile

    cfg = load_config(args.config, args.overrides)
    sizes = DEFAULT_SIZES if args.sizes is None else tuple(int(s) for s in args.sizes.split(",") if s.strip())
    result = profile(cfg, args.out, sizes, args.scaling_questions, progress=not args.quiet)
    print(console_table(["stage", "seconds", "share", "items/s"], [
        [name, f"{row['seconds']:.2f}", f"{100 * row['share']:.1f} %",
         f"{row['items_per_s']:.4g} {row['unit']}/s" if row["items_per_s"] else "-"]
        for name, row in result["stages"].items()], ["left", "right", "right", "right"]))
    for row in result["scaling"]:
        print(f"scaling: {row['episodes']:>9,d} episodes  search {row['search_s']:.3f} s  ({row['qps']:.0f} q/s)")
    print(f"gpu: {result['gpu']}")
    print(f"wrote {Path(args.out) / 'profile.json'} and {Path(args.out) / 'profile.png'}")
    return 0
