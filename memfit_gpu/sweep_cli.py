"""`memfit sweep` and `memfit aggregate`: the command-line side of memfit_gpu/sweep.py."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

log = logging.getLogger(__name__)


def cmd_sweep(args: argparse.Namespace) -> int:
    from memfit_gpu.sweep import SweepError, load_sweep, run_sweep

    try:
        spec = load_sweep(args.config, args.overrides)
    except SweepError as exc:
        print(f"memfit sweep: error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path("runs") / "sweeps" / spec.name
    if args.count:
        print(len(spec.points))
        return 0
    if args.sbatch_args:
        from memfit_gpu.sweep import check_slurm_gpus, sbatch_args

        try:
            check_slurm_gpus(spec)
        except SweepError as exc:
            print(f"memfit sweep: error: {exc}", file=sys.stderr)
            return 2
        print(" ".join(sbatch_args(spec)))
        return 0
    if args.point is not None:
        from memfit_gpu.sweep import run_point

        try:
            return run_point(spec, out, args.point)
        except SweepError as exc:
            print(f"memfit sweep: error: {exc}", file=sys.stderr)
            return 2
    if args.dry_run:
        from memfit_gpu.sweep import point_command

        for point in spec.points:
            print(" ".join(point_command(spec, point, out.resolve() / "points" / point.point_id)))
        return 0
    try:
        data = run_sweep(
            spec, out, launcher=args.launcher, jobs=args.jobs, wait=not args.no_wait,
            poll_s=args.poll_s, max_requeue=args.max_requeue,
        )
    except SweepError as exc:
        print(f"memfit sweep: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if args.launcher == "slurm":
            print(f"memfit sweep: interrupted; submitted tasks keep running. Run the same command again to wait "
                  f"for them (nothing is resubmitted while they run); state in {out / 'sweep.json'}", file=sys.stderr)
        else:
            print("memfit sweep: interrupted; running points were stopped and resume on the next run",
                  file=sys.stderr)
        return 130
    states = [p["state"] for p in data["points"]]
    done = states.count("done")
    print(f"sweep {spec.name}: {done}/{len(states)} points DONE; state in {out / 'sweep.json'}")
    if args.no_wait and args.launcher == "slurm":
        return 0
    return 0 if done == len(states) else 1


def cmd_aggregate(args: argparse.Namespace) -> int:
    from memfit_gpu.sweep import SweepError, aggregate, to_csv, to_markdown

    sweep_dir = Path(args.dir)
    try:
        columns, rows = aggregate(sweep_dir)
    except SweepError as exc:
        print(f"memfit aggregate: error: {exc}", file=sys.stderr)
        return 2
    markdown = to_markdown(columns, rows)
    md_path = Path(args.md) if args.md else sweep_dir / "aggregate.md"
    csv_path = Path(args.csv) if args.csv else sweep_dir / "aggregate.csv"
    md_path.write_text(markdown)
    csv_path.write_text(to_csv(columns, rows))
    print(markdown, end="")
    log.info("wrote %s and %s", md_path, csv_path)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    # cli.SUBCOMMANDS maps both `sweep` and `aggregate` to this module, so this runs twice: add each once
    if "sweep" not in subparsers.choices:
        p = subparsers.add_parser(
            "sweep",
            help="run a grid of `memfit run` points, locally or as one SLURM job array",
            description=(
                "Expand a sweep file into points (OUT/points/<id>/), skip points with DONE, and run the rest "
                "with `memfit run` (resumable). --launcher slurm submits one job array via submitit and "
                "resubmits unfinished points up to slurm.max_requeue times."
            ),
        )
        p.add_argument("--config", required=True, help="sweep YAML (configs/sweeps/*.yaml)")
        p.add_argument("--launcher", choices=("local", "slurm"), default="local")
        p.add_argument("overrides", nargs="*", metavar="key=value",
                       help="overrides every point gets (added to the sweep file's fixed:)")
        p.add_argument("--out", help="sweep directory (default runs/sweeps/<name>)")
        p.add_argument("--jobs", type=int, default=1, help="local launcher: points run at once")
        p.add_argument("--no-wait", action="store_true", help="slurm: submit and return; re-run to wait/resume")
        p.add_argument("--poll-s", type=float, default=5.0, help="seconds between queue polls")
        p.add_argument("--max-requeue", type=int, default=None,
                       help="resubmission rounds for unfinished points (default: slurm.max_requeue; local: 0)")
        p.add_argument("--dry-run", action="store_true", help="print each point's command and exit")
        p.add_argument("--count", action="store_true", help="print the number of points and exit (for --array)")
        p.add_argument("--sbatch-args", action="store_true",
                       help="print sbatch options for slurm/memfit-array.sbatch from the sweep's slurm: block "
                            "(--array, GPUs, CPUs, memory, time, partition) and exit")
        p.add_argument("--point", help="run only this point (index, e.g. $SLURM_ARRAY_TASK_ID, or id) here")
        p.set_defaults(func=cmd_sweep)
    if "aggregate" not in subparsers.choices:
        p = subparsers.add_parser(
            "aggregate",
            help="one table of a sweep's points: sweep keys and main metrics",
            description="Read every point's metrics.json; print a markdown table; write aggregate.md/.csv.",
        )
        p.add_argument("dir", help="sweep directory (has sweep.json)")
        p.add_argument("--csv", help="CSV path (default DIR/aggregate.csv)")
        p.add_argument("--md", help="markdown path (default DIR/aggregate.md)")
        p.set_defaults(func=cmd_aggregate)
