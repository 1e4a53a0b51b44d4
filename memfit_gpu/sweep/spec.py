"""Sweep files: a base config, a grid and/or explicit points, and the SLURM resources of one point.

```yaml
name: smoke
config: ../smoke.yaml            # base config, relative to this file
fixed: {eval.bootstrap_samples: 100}   # overrides every point gets (optional)
grid: {pack.k: [5, 10]}          # cartesian product of the lists
points: [{retrieve.alpha: 0.5}]  # explicit points, added after the grid (optional; `name:` names one)
slurm: {partition: debug, gpus_per_task: 1, cpus_per_task: 8, mem_gb: 32, timeout_min: 240,
        array_parallelism: 64, max_requeue: 2}
```

`load_sweep` expands the file into `SweepPoint`s with readable ids (`k=5,alpha=0.5`) and validates every
point's config before anything runs; `point_command` is the `memfit run` each point runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import math
import os
import re
import string
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from memfit_gpu.config import ConfigError, DuplicateKeyError, MemFitConfig, UniqueKeyLoader, load_config
from memfit_gpu.data import DataNotFoundError, data_location, resolve_data_path
from memfit_gpu.mappings import flatten

log = logging.getLogger(__name__)

SWEEP_KEYS = ("name", "config", "fixed", "grid", "points", "slurm", "command")
# the program each point runs; {python} is the interpreter running the sweep (same venv on the node)
DEFAULT_COMMAND = ["{python}", "-m", "memfit_gpu.cli", "run", "--config", "{config}", "--out", "{out}"]
# the placeholders point_command fills in a `command:` part ({{ and }} are literal braces)
COMMAND_PLACEHOLDERS = ("python", "config", "out")
# The most points one sweep file expands to. Every point's config is validated before anything runs (tens of
# ms each), every point gets a run directory, a sweep.json record and a SLURM array index (clusters cap
# MaxArraySize, often at 1001 to 10001): a grid past this is a mistake (a list too many), not an experiment.
MAX_POINTS = 10_000


class SweepError(ValueError):
    """A sweep file or sweep directory that cannot be used as asked."""


@dataclass
class SlurmSettings:
    partition: str | None = None  # None = the cluster's default partition
    gpus_per_task: int = 1  # one array task = one point = one node share
    cpus_per_task: int = 8
    mem_gb: float = 32.0
    timeout_min: int = 240
    array_parallelism: int = 64  # array tasks running at once (sbatch --array=0-N%P)
    max_requeue: int = 2  # resubmissions of unfinished points, and requeues on timeout/preemption
    setup: list[str] = field(default_factory=list)  # shell lines run before each task (module load ...)
    additional: dict[str, Any] = field(default_factory=dict)  # extra sbatch options: account, qos, ...


# The least each whole-number slurm setting takes (gpus_per_task 0: a CPU-only point).
_SLURM_AT_LEAST = {"gpus_per_task": 0, "cpus_per_task": 1, "timeout_min": 1, "array_parallelism": 1, "max_requeue": 0}


def _slurm_value_problem(key: str, value: Any) -> str | None:
    """What is wrong with a sweep file's `slurm.<key>` value (None: nothing), by SlurmSettings' field types."""
    if key == "partition":
        ok = value is None or value == "" or (isinstance(value, str) and _single_word(value))
        return None if ok else "must be a partition name (one word)"
    if key in _SLURM_AT_LEAST:
        if isinstance(value, bool) or not isinstance(value, int):
            return "must be a whole number"
        return None if value >= _SLURM_AT_LEAST[key] else f"must be >= {_SLURM_AT_LEAST[key]}"
    if key == "mem_gb":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return "must be a number of GB"
        if not math.isfinite(value):
            return "must be a finite number of GB"
        return None if value > 0 else "must be > 0"
    if key == "setup":
        ok = isinstance(value, list) and all(isinstance(line, str) for line in value)
        return None if ok else "must be a list of shell lines (setup: [module load cuda])"
    if key == "additional":
        if not isinstance(value, dict):
            return "must be a mapping of sbatch options (additional: {account: x})"
        for option, setting in value.items():
            # each becomes one `--option=value` word of `memfit sweep --sbatch-args` (split by the shell)
            if not isinstance(option, str) or not _single_word(option):
                return f"option {option!r}: must be one word (an sbatch option name)"
            if not _single_word_scalar(setting):
                return f"{option}={setting!r}: must be one word (a string without spaces, or a number)"
    return None


def _single_word(text: str) -> bool:
    return bool(text) and not any(c.isspace() or c in "'\"\\" for c in text)


def _single_word_scalar(value: Any) -> bool:
    if isinstance(value, bool):
        return False  # `--opt=True` is no sbatch option value; write the option's own word
    if isinstance(value, int):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, str) and _single_word(value)


@dataclass
class SweepPoint:
    point_id: str
    overrides: dict[str, Any]  # the keys this point sets (grid keys, explicit keys)


@dataclass
class SweepSpec:
    name: str
    source: Path  # the sweep file
    config: Path  # base config, absolute
    fixed: dict[str, Any]
    points: list[SweepPoint]
    slurm: SlurmSettings
    command: list[str]

    @property
    def sweep_keys(self) -> list[str]:
        keys: list[str] = []
        for point in self.points:
            keys += [k for k in point.overrides if k not in keys]
        return keys

    def point(self, point_id: str) -> SweepPoint:
        """The point with this id (KeyError if none)."""
        for point in self.points:
            if point.point_id == point_id:
                return point
        raise KeyError(point_id)


def override_arg(key: str, value: Any) -> str:
    """`key=value` as OmegaConf's dot-list reads it back to the same value (a text YAML would read as
    another type, "1.10" or "on", is quoted)."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif value is None:
        text = "null"
    elif isinstance(value, (list, dict)):
        text = json.dumps(value)  # JSON is YAML flow syntax
    elif isinstance(value, str) and not _reads_back(value):
        text = json.dumps(value)  # a YAML double-quoted scalar
    else:
        text = str(value)
    return f"{key}={text}"


def dotlist_value(text: str) -> Any:
    """The value `key=text` gives on a command line (OmegaConf's dot-list: YAML), as `memfit run` reads it."""
    return OmegaConf.to_container(OmegaConf.from_dotlist([f"value={text}"]), resolve=False)["value"]


def _reads_back(text: str) -> bool:
    try:
        return dotlist_value(text) == text
    except Exception:  # noqa: BLE001  (whatever the dot-list parser refuses is quoted)
        return False


def _id_value(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "+".join(_id_value(v) for v in value) or "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", str(value)).strip("-") or "none"


def _all_dots(text: str) -> bool:
    """`.` or `..` (or more dots): as a directory name, the folder itself or its parent."""
    return set(text) <= {"."}


def _short_keys(keys: Sequence[str]) -> dict[str, str]:
    """Last dotted component, unless two keys share it (then the whole key)."""
    last = {k: k.rsplit(".", 1)[-1] for k in keys}
    counts: dict[str, int] = {}
    for short in last.values():
        counts[short] = counts.get(short, 0) + 1
    return {k: (last[k] if counts[last[k]] == 1 else k) for k in keys}


def _digest(overrides: dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(overrides, sort_keys=True, default=str).encode()).hexdigest()[:6]


def point_ids(overrides: Sequence[dict[str, Any]], names: Sequence[str | None]) -> list[str]:
    """Readable, unique directory names: `k=5,alpha=0.5`; a hash suffix only where needed.

    Args:
        overrides: each point's own keys and values.
        names: each point's `name:` (None: the id spells out the overrides).

    Returns:
        One id per point. Raises SweepError when two points are one: the same name (or none) and the same
        overrides, however spelled (`{pack: {k: 5}}` and `{pack.k: 5}`: OmegaConf merges a mapping value into
        its node).
    """
    seen: dict[tuple[str | None, str], int] = {}
    for i, (ov, name) in enumerate(zip(overrides, names, strict=True)):
        point = (name, json.dumps(flatten(ov), sort_keys=True, default=str))
        if point in seen:
            raise SweepError(f"two sweep points have the same overrides {point[1]} (points {seen[point]} and {i}, "
                             "counting the grid's first)")
        seen[point] = i
    all_keys: list[str] = []
    for ov in overrides:
        all_keys += [k for k in ov if k not in all_keys]
    short = _short_keys(all_keys)
    ids: list[str] = []
    for ov, name in zip(overrides, names, strict=True):
        text = _id_value(name) if name else ",".join(f"{short[k]}={_id_value(v)}" for k, v in ov.items())
        text = text or "base"
        if _all_dots(text):
            raise SweepError(f"point name {name!r} is no directory name (only dots); give it a name")
        if len(text) > 96:
            text = f"{text[:88]}-{_digest(ov)}"
        ids.append(text)
    uses = {i: ids.count(i) for i in ids}
    out = [f"{i}-{_digest(ov)}" if uses[i] > 1 else i for i, ov in zip(ids, overrides, strict=True)]
    if len(set(out)) != len(out):  # a point named as another's overrides spell, with the same overrides
        dup = next(i for i in out if out.count(i) > 1)
        raise SweepError(f"two sweep points would share the directory {dup}; name one apart")
    return out


def _flat_mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SweepError(f"{where}: expected a mapping of dotted keys to values, got {type(value).__name__}")
    return {str(k): v for k, v in value.items()}


def _check_command(command: list[str], where: str) -> None:
    """Every `{...}` of a command part is one point_command fills; a lone brace is written `{{` or `}}`."""
    for i, part in enumerate(command):
        try:
            fields = [name for _, name, _, _ in string.Formatter().parse(part) if name is not None]
        except ValueError as exc:
            raise SweepError(f"{where}: command[{i}]={part!r}: {exc} (write a literal brace as {{{{ or }}}})") from None
        for name in fields:
            if name not in COMMAND_PLACEHOLDERS:
                raise SweepError(f"{where}: command[{i}]={part!r}: unknown placeholder {{{name}}}; allowed: "
                                 f"{', '.join('{' + n + '}' for n in COMMAND_PLACEHOLDERS)}")


def _check_sweep_name(name: str, where: str) -> None:
    """The name is a folder of runs/sweeps/ (the default --out), a W&B group and a SLURM job name."""
    if not name or _all_dots(name) or any(c in name for c in "/\\\0"):
        raise SweepError(f"{where}: name {name!r} must be one folder name (no '/', not '.' or '..'); "
                         "choose where the sweep writes with --out")


def load_sweep(path: str | Path, extra_overrides: Sequence[str] = ()) -> SweepSpec:
    """Read and check a sweep file; every point's config is validated before anything runs.

    `extra_overrides` (`key=value` from the command line) join the file's `fixed:` block, e.g. the
    reader servers of slurm/vllm-servers.sbatch.
    """
    path = Path(path).resolve()
    if not path.exists():
        raise SweepError(f"sweep file not found: {path}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SweepError(f"{path}: not UTF-8 text ({exc})") from None
    except OSError as exc:
        raise SweepError(f"{path}: cannot be read ({exc})") from None
    try:
        data = yaml.load(text, Loader=UniqueKeyLoader) or {}  # noqa: S506  (a SafeLoader)
    except DuplicateKeyError as exc:
        raise SweepError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise SweepError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise SweepError(f"{path}: expected a mapping at the top level")
    unknown = sorted(set(data) - set(SWEEP_KEYS))
    if unknown:
        raise SweepError(f"{path}: unknown key(s) {unknown}; allowed: {', '.join(SWEEP_KEYS)}")
    if "config" not in data:
        raise SweepError(f"{path}: missing `config:` (the base config, relative to the sweep file)")
    config = (path.parent / str(data["config"])).resolve()
    if not config.exists():
        raise SweepError(f"{path}: config {data['config']} does not exist ({config})")
    name = str(data.get("name") or path.stem)
    _check_sweep_name(name, str(path))
    fixed = _flat_mapping(data.get("fixed"), f"{path}: fixed")
    from_command_line: set[str] = set()
    for item in extra_overrides:
        if "=" not in item:
            raise SweepError(f"override {item!r} is not key=value (e.g. reader.backend=openai)")
        key, value = item.split("=", 1)
        try:
            fixed[key] = dotlist_value(value)  # as `memfit run key=value` reads it (pack.k=3 is 3, [a,b] a list)
        except yaml.YAMLError as exc:
            raise SweepError(f"override {item!r}: its value is not read as YAML ({str(exc).splitlines()[0]})") from None
        from_command_line.add(key)

    grid = _flat_mapping(data.get("grid"), f"{path}: grid")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise SweepError(f"{path}: grid.{key} must be a non-empty list, got {values!r}")
    explicit = data.get("points") or []
    if not isinstance(explicit, list):
        raise SweepError(f"{path}: points must be a list of mappings")
    count = math.prod(len(values) for values in grid.values()) if grid else 0
    if count + len(explicit) > MAX_POINTS:
        raise SweepError(f"{path}: {count + len(explicit)} points (grid {count}, points {len(explicit)}); "
                         f"a sweep runs at most {MAX_POINTS}: split it into several sweep files")
    overrides: list[dict[str, Any]] = []
    names: list[str | None] = []
    if grid:
        for combo in itertools.product(*grid.values()):
            overrides.append(dict(zip(grid.keys(), combo, strict=True)))
            names.append(None)
    for i, item in enumerate(explicit):
        point = _flat_mapping(item, f"{path}: points[{i}]")
        point_name = str(point.pop("name")) if "name" in point else None
        if point_name is not None and _all_dots(_id_value(point_name)):
            raise SweepError(f"{path}: points[{i}].name={point_name!r}: no directory name (only dots)")
        names.append(point_name)
        overrides.append(point)
    if not overrides:
        overrides, names = [{}], [None]  # no grid, no points: the base config itself

    # a fixed key the grid varies is replaced at every point: never what the file (or command line) meant. An
    # explicit point may set a fixed key: fixed: is then the default of the points that do not.
    fixed_keys, varied = flatten(fixed), flatten(grid)
    both = sorted(k for k in fixed_keys if any(k == v or k.startswith(f"{v}.") or v.startswith(f"{k}.") for v in varied))
    if both:
        raise SweepError(f"{path}: {both[0]} is set by fixed: (or a command-line override) and by grid, which "
                         "would replace it at every point; set it in one place")
    # a command-line override is one every point gets (its --help): a point of the file that sets the key too
    # would keep its own value, so the override would hold at some points only
    for i, point in enumerate(overrides[len(overrides) - len(explicit):] if explicit else []):
        clash = sorted(k for k in from_command_line for v in flatten(point)
                       if k == v or k.startswith(f"{v}.") or v.startswith(f"{k}."))
        if clash:
            raise SweepError(f"{path}: the command-line override {clash[0]} is also set by points[{i}], which would "
                             "keep its own value there; change it in the sweep file")
    slurm_data = _flat_mapping(data.get("slurm"), f"{path}: slurm")
    allowed = {f.name for f in dataclasses.fields(SlurmSettings)}
    bad = sorted(set(slurm_data) - allowed)
    if bad:
        raise SweepError(f"{path}: unknown slurm key(s) {bad}; allowed: {', '.join(sorted(allowed))}")
    for key, value in slurm_data.items():
        problem = _slurm_value_problem(key, value)
        if problem is not None:
            raise SweepError(f"{path}: slurm.{key}={value!r}: {problem}")
    slurm = SlurmSettings(**slurm_data)

    command = data.get("command") or DEFAULT_COMMAND
    if not isinstance(command, list) or not all(isinstance(c, str) for c in command):
        raise SweepError(f"{path}: command must be a list of strings")
    _check_command(command, str(path))
    for placeholder in ("{config}", "{out}"):
        if not any(placeholder in c for c in command):
            raise SweepError(f"{path}: command must contain {placeholder}")

    try:
        ids = point_ids(overrides, names)
    except SweepError as exc:
        raise SweepError(f"{path}: {exc}") from None
    points = [SweepPoint(pid, ov) for pid, ov in zip(ids, overrides, strict=True)]
    for point in points:
        try:
            load_config(config, point_overrides(name, fixed, point))
        except ConfigError as exc:
            raise SweepError(f"{path}: point {point.point_id}: {exc}") from None
    return SweepSpec(name, path, config, fixed, points, slurm, list(command))


def pin_data_location(spec: SweepSpec) -> SweepSpec:
    """The spec with `data.path` fixed to where this process finds the data, when the config leaves it
    to the environment ($MEMFIT_DATA_DIR, the fetch cache): SLURM tasks and local points then read the
    same files, whatever their own environment holds. Points that read other splits (BEAM's, each in a
    folder of its own) get the folder holding them all, where each point's split finds its own files. A
    sweep whose data cannot be found stops here, before anything is submitted."""
    found: dict[str, tuple[MemFitConfig, list[Path], str]] = {}  # per point: config, files, data.path
    for point in spec.points:
        cfg = load_config(spec.config, point_overrides(spec.name, spec.fixed, point))
        if cfg.data.path is not None:
            continue
        try:
            found[point.point_id] = (cfg, resolve_data_path(cfg.data.benchmark, None, cfg.data.split),
                                     str(data_location(cfg.data.benchmark, None, cfg.data.split)))
        except DataNotFoundError as exc:
            raise SweepError(f"{spec.source}: point {point.point_id}: {exc}") from None
    if not found:
        return spec
    locations = {location for _, _, location in found.values()}
    where = next(iter(locations))
    if len(locations) > 1:
        where = os.path.commonpath(sorted(locations))
        for point_id, (cfg, files, _) in found.items():
            try:
                same = ([f.resolve() for f in resolve_data_path(cfg.data.benchmark, where, cfg.data.split)]
                        == [f.resolve() for f in files])
            except DataNotFoundError:
                same = False
            if not same:
                raise SweepError(f"{spec.source}: point {point_id}: the points read data in different places "
                                 f"({', '.join(sorted(locations))}) that no one data.path finds; give each its data.path")
    log.info("sweep %s: data.path=%s for every point (found here; tasks get it explicitly)", spec.name, where)
    return dataclasses.replace(spec, fixed={**spec.fixed, "data.path": where})


def point_overrides(sweep_name: str, fixed: dict[str, Any], point: SweepPoint) -> list[str]:
    """Dot-list overrides of one point: fixed ones, the point's own, and the W&B group = sweep name."""
    merged = {**fixed, **point.overrides}
    args = [override_arg(k, v) for k, v in merged.items()]
    if "tracking.wandb.group" not in merged:
        args.append(override_arg("tracking.wandb.group", sweep_name))
    return args


def point_command(spec: SweepSpec, point: SweepPoint, point_dir: Path) -> list[str]:
    """The argv that runs one point into `point_dir` (the sweep file's `command`, then the overrides)."""
    values = {"python": sys.executable, "config": str(spec.config), "out": str(point_dir)}
    return [part.format(**values) for part in spec.command] + point_overrides(spec.name, spec.fixed, point)


def find_point(spec: SweepSpec, which: str) -> SweepPoint:
    """A point by index (SLURM_ARRAY_TASK_ID) or by id."""
    if which.isdigit():
        index = int(which)
        if index >= len(spec.points):
            raise SweepError(f"{spec.source}: point index {index} out of range (sweep has {len(spec.points)} points)")
        return spec.points[index]
    try:
        return spec.point(which)
    except KeyError:
        raise SweepError(
            f"{spec.source}: no point {which!r}; points: {', '.join(p.point_id for p in spec.points)}"
        ) from None
