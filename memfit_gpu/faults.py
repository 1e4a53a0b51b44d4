"""Named kill points at the durable writes of a run, for crash-consistency tests.

`MEMFIT_FAULT=<point>[:<n>]` makes the process SIGKILL itself the n-th time (default the first) it
passes `point`, exactly as a power cut or the OOM killer would stop it there: no exception handler,
no `finally`, no flush. `MEMFIT_FAULT_TRACE=<file>` appends one line per point passed (`name` or
`name<TAB>count`), which tells a test every boundary a run crosses and how many texts the store
encoded. With neither variable set a point costs two environment lookups.

`MEMFIT_IO_FAULT=<file name>:<ERRNO>[:<n>]` makes the n-th durable write of a file of that name (default
the first; `cache.sqlite` = a response-cache commit) fail with that error (ENOSPC, EDQUOT, EACCES, EROFS,
EIO), as a full disk, a quota or a file system remounted read-only would (`io_fault`, called by
files.py, store/log.py, store/snapshot.py (`meta.json`, a snapshot's last file) and readers/cache.py
before each write).

Points (each right after its write is on disk, unless named otherwise):
config, timings, build_timings, summaries.ledger, diagnostics, packs, answer.ledger, predictions,
metrics, score.ledger, results, DONE (run/pipeline.py and the stages it runs: run/directory.py,
run/answer.py, run/score.py); provenance (provenance.py, provenance.json written);
audit.ledger, audit.json, audit.md (judge_audit.py); store.log (store/log.py, each append);
store.snapshot.staged (a snapshot's files written, not yet renamed into place), store.snapshot,
store.encode (before the store encodes texts; its count is the number of texts) (store/episodes.py);
reader.load (readers/reader.py: before a reader's backend loads its model, which it does only for a request
its response cache cannot serve; no write, a mark that tells a test which runs loaded a model);
compact.pending (live/memory.py: the users whose cached replies the compaction drops, recorded before the store
is rewritten), compact.built (the compacted store durable beside the old one), compact.retired (the old store renamed
aside), compact.swapped (the new store in its place), compact.removed (the old one deleted)
(store/episodes.py, `memfit store compact`); reader.commit (readers/reader.py: a group of responses and
their call records committed to cache.sqlite, before the ledger.json that reports them);
lightmem.turns, lightmem.mtm.ledger, lightmem.mtm, lightmem.ltm.ledger, lightmem.ltm, lightmem.rewrite.ledger,
lightmem.rerank.ledger (methods/lightmem.py; `.ledger` = the ledger saved after that batch of calls);
mem0.add.ledger (methods/peers/mem0.py: a mem0 `add` returned and the ledger is saved, its mark not yet
written), mem0.added (its mark in mem0/added.jsonl);
gpu_check.part (experiments/_gpu_check_stages.py: a part of the GPU check starts, gpu_check.json naming it);
growth.ledger, growth (a growth point's rows appended), growth.json (growth.py); depths.ledger, depths (a pack
depth's rows appended), depths.json (depths.py).
"""

from __future__ import annotations

import errno
import os
import signal
from collections import Counter

FAULT_ENV = "MEMFIT_FAULT"
TRACE_ENV = "MEMFIT_FAULT_TRACE"
IO_FAULT_ENV = "MEMFIT_IO_FAULT"

# Times each armed point was passed in this process: the n of `point:n` counts per process.
_passed: Counter[str] = Counter()
_written: Counter[str] = Counter()


def point(name: str, count: int | None = None) -> None:
    """A kill point; `count` (how many items the step handles) only goes to the trace."""
    trace = os.environ.get(TRACE_ENV)
    if trace:
        with open(trace, "a", encoding="utf-8") as handle:
            handle.write(name if count is None else f"{name}\t{count}")
            handle.write("\n")
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    target, _, nth = spec.partition(":")
    if target != name:
        return
    _passed[name] += 1
    if _passed[name] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)


def parse_trace(path: str | os.PathLike[str]) -> list[tuple[str, int | None]]:
    """(name, count) per line of a MEMFIT_FAULT_TRACE file, in the order the points were passed."""
    rows: list[tuple[str, int | None]] = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            name, _, count = line.rstrip("\n").partition("\t")
            if name:
                rows.append((name, int(count) if count else None))
    return rows


def reset() -> None:
    """Forget how often each point and write was passed (a test arming the same setting again in-process)."""
    _passed.clear()
    _written.clear()


def io_fault(path: str | os.PathLike[str]) -> None:
    """Raise the OSError MEMFIT_IO_FAULT names when this is the armed n-th write of a file named like `path`."""
    spec = os.environ.get(IO_FAULT_ENV)
    if not spec:
        return
    name, _, rest = spec.partition(":")
    code, _, nth = rest.partition(":")
    if os.path.basename(os.fspath(path)) != name:
        return
    _written[name] += 1
    if _written[name] == int(nth or 1):
        number = getattr(errno, code or "ENOSPC")
        raise OSError(number, f"{os.strerror(number)} ({IO_FAULT_ENV})", os.fspath(path))
