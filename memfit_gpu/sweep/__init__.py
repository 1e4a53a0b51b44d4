"""Sweeps: one resumable `memfit run` per point of a grid, locally or as one SLURM job array.

spec.py       sweep files -> SweepSpec (typed points, SLURM settings); point ids, overrides, commands
state.py      OUT/sweep.json: PointRecord / JobRecord / Submission, PointState, what follows a stop
local.py      the local launcher (child processes, `jobs` at a time)
slurm.py      the SLURM launcher: PointTask, resources (sbatch args, GPU check), submit, wait, attach
watch.py      which SLURM tasks may still work: squeue, and submitit's result files
driver.py     run_sweep (every unfinished point), run_point (one point, for slurm/memfit-array.sbatch)
aggregate.py  one Markdown/CSV table of a sweep's points (`memfit aggregate`)
progress.py   the progress bar

The commands `memfit sweep` and `memfit aggregate` are memfit_gpu/cli/sweep.py and cli/aggregate.py.
"""
