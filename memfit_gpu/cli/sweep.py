"""`memfit sweep`: run a sweep file's points (memfit_gpu/sweep/), locally or as one SLURM job array."""

from __future__ import annotations

import argparse
import math
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from memfit_gpu.cli.errors import Interrupted

if TYPE_CHECKING:
    from memfit_gpu.config import MemFitConfig


def user_errors() -> tuple[type[Exception], ...]:
    from memfit_gpu.sweep.spec import SweepError

    return (SweepError,)


def cmd_sweep(args: argparse.Namespace) -> int:
    from memfit_gpu.sweep.driver import run_point, run_sweep
    from memfit_gpu.sweep.slurm import check_slurm_gpus, sbatch_args
    from memfit_gpu.sweep.spec import load_sweep, point_command
    from memfit_gpu.sweep.state import PointState

    spec = load_sweep(args.config, args.overrides)
    out = Path(args.out) if args.out else Path("runs") / "sweeps" / spec.name
    try:
        if args.count:
            print(len(spec.points))
            return 0
        if args.sbatch_args:
            check_slurm_gpus(spec)
            print(" ".join(sbatch_args(spec)))
            return 0
        if args.point is not None:
            return run_point(spec, out, args.point, same_config=same_config)
        if args.dry_run:
            for point in spec.points:
                # quoted as a shell reads it back: a value with spaces or quotes pastes as one argument
                print(shlex.join(point_command(spec, point, out.resolve() / "points" / point.point_id)))
            return 0
        state = run_sweep(spec, out, launcher=args.launcher, jobs=args.jobs, wait=not args.no_wait,
                          poll_s=args.poll_s, max_requeue=args.max_requeue, same_config=same_config)
    except KeyboardInterrupt:
        if args.launcher == "slurm":
            raise Interrupted(f"interrupted; submitted tasks keep running. Run the same command again to wait for "
                              f"them (nothing is resubmitted while they run); state in {out / 'sweep.json'}") from None
        raise Interrupted("interrupted; running points were stopped and resume on the next run") from None
    done = len(state.in_state(PointState.DONE))
    print(f"sweep {spec.name}: {done}/{len(spec.points)} points DONE; state in {out / 'sweep.json'}")
    if args.no_wait and args.launcher == "slurm":
        return 0
    return 0 if done == len(spec.points) else 1


def same_config(cfg: MemFitConfig, point_dir: Path) -> None:
    """A finished point's run directory holds `cfg` (as `memfit run` compares a resume): SweepError otherwise."""
    from memfit_gpu.data.schema import DataError
    from memfit_gpu.run.directory import RunError, record_config
    from memfit_gpu.sweep.spec import SweepError

    try:
        record_config(cfg, point_dir)  # writes nothing where config.yaml exists: compares, or raises
    except (RunError, DataError) as exc:
        raise SweepError(str(exc)) from None


def positive_seconds(text: str) -> float:
    """--poll-s: a positive, finite number of seconds (time.sleep refuses the rest, after points started)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a positive, finite number of seconds")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
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
    p.add_argument("--poll-s", type=positive_seconds, default=5.0,
                   help="seconds between queue polls (> 0)")
    p.add_argument("--max-requeue", type=int, default=None,
                   help="resubmission rounds for unfinished points (default: slurm.max_requeue; local: 0)")
    p.add_argument("--dry-run", action="store_true", help="print each point's command and exit")
    p.add_argument("--count", action="store_true", help="print the number of points and exit (for --array)")
    p.add_argument("--sbatch-args", action="store_true",
                   help="print sbatch options for slurm/memfit-array.sbatch from the sweep's slurm: block "
                        "(--array, GPUs, CPUs, memory, time, partition) and exit")
    p.add_argument("--point", help="run only this point (index, e.g. $SLURM_ARRAY_TASK_ID, or id) here")
    p.set_defaults(func=cmd_sweep, user_errors=user_errors)
