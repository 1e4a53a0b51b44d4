"""`memfit store`: delete turns from a store, compact it so that deleted turns leave the disk, repair a log
an older memfit_gpu left unopenable, and take a live memory's users out and in.

    memfit store delete DIR --memory ID --turn TURN [--turn TURN ...] [--no-resummarize]
    memfit store compact DIR
    memfit store repair DIR [--dry-run]
    memfit store export DIR --user U --out FILE [--summaries] --config C
    memfit store import DIR FILE --config C
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Container, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memfit_gpu.config import MemFitConfig
    from memfit_gpu.data.schema import DataError
    from memfit_gpu.data.schema import Memory as DataMemory
    from memfit_gpu.readers.reader import Reader
    from memfit_gpu.store.episodes import EpisodeStore

DESCRIPTION = """\
Change a persistent episode store (SPEC write path 5, user-initiated deletion).

DIR is a run directory (config.yaml and what `memfit run` writes beside it from its first stage on; its
config.yaml says where the store is: DIR/store unless store.path is set), a live memory's folder
(memfit_gpu.Memory, `memfit serve --store`: DIR/store and DIR/.lock, with --config; a config.yaml of
your own in it does not make it a run directory) or a store folder (log.jsonl inside; --config is
needed unless its parent is a run directory). The config gives the
encoder and index settings the store was built with, and the reader for summaries. Every command holds
the directory's lock (DIR/.lock, the lock `memfit run`, `memfit serve` and Memory.open hold): a
directory in use is refused.

  delete   tombstones turns: they leave every index and every later retrieval, in one logged batch.
           A summary that covers one of them is retired and, by default, rebuilt over the remaining
           turns with the config's reader (one LLM batch), through the run's response cache where DIR
           is a run directory (elsewhere uncached, and in no ledger.json);
           --no-resummarize retires it without a reader (that segment is left without a summary).
           The text stays in the append-only log until `compact`.
  compact  rewrites the log and the index snapshots without deleted turns and retired summaries (rows
           renumbered, order kept: the same queries give the same results), built beside the store
           and swapped in atomically. Afterwards the turns' text and vectors are nowhere in the store.
  repair   makes a log openable that an older memfit_gpu left with a record its replay refuses (a write
           batch logged before it was checked, e.g. a live add past 63 speakers): the batches that do
           not apply are dropped (they were refused to their callers), everything else is kept byte for
           byte; the old log and the dropped records are kept beside it. --dry-run: report only, not a
           byte of the store changes. No config and no model needed.
  export   a live memory's user as one line of the own-data jsonl format (its turns in order, with ids,
           sessions, timestamps and images; --summaries: its segment summaries with the turn ids they
           cover); DIR is the memory's folder.
  import   adds the users of such a file (or any own-data file) to the live memory in DIR (created when
           missing): every turn in one all-or-nothing add, then the summaries; a second import of the
           same file stores nothing twice. Export then import into an empty memory searches the same.
           A file the memory would refuse (`memfit data validate --live FILE` lists why) is refused
           before the memory is opened: nothing is created or changed.

A run directory is a finished experiment: its packs, predictions and metrics were made from the store as
it was, and these commands leave them (and DONE) as they are. Deleting is for live stores and for
retrieving again over the changed store (a new run directory with store.path set to this store, or
`memfit retrieve --store`)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "store", help="delete turns from a store; compact it so they leave the disk",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    commands = parser.add_subparsers(dest="action", metavar="ACTION")
    commands.required = True
    delete = commands.add_parser("delete", help="tombstone turns of one memory (and rebuild their summaries)")
    delete.add_argument("dir", metavar="DIR", help="run directory, live memory folder or store folder")
    delete.add_argument("--memory", required=True, help="memory id (e.g. conv-26)")
    delete.add_argument("--turn", required=True, action="append", help="turn id (e.g. D1:3); repeat for more")
    delete.add_argument("--no-resummarize", action="store_true",
                        help="retire summaries that cover a deleted turn without rebuilding them (no reader)")
    delete.add_argument("--config", help="config the store was built with (default: the run directory's config.yaml)")
    delete.set_defaults(func=delete_command, user_errors=user_errors)
    compact = commands.add_parser("compact", help="rewrite the store without deleted turns and retired summaries")
    compact.add_argument("dir", metavar="DIR", help="run directory, live memory folder or store folder")
    compact.add_argument("--config", help="config the store was built with (default: the run directory's config.yaml)")
    compact.set_defaults(func=compact_command, user_errors=user_errors)
    repair = commands.add_parser("repair", help="drop the write batches a store's replay refuses (older logs)")
    repair.add_argument("dir", metavar="DIR", help="run directory, live memory folder or store folder")
    repair.add_argument("--dry-run", action="store_true", help="report what would be dropped; change nothing")
    repair.set_defaults(func=repair_command, user_errors=user_errors)
    export = commands.add_parser("export", help="a live memory's user as own-data jsonl (turns, summaries)")
    export.add_argument("dir", metavar="DIR", help="the live memory's folder")
    export.add_argument("--user", required=True, help="the user id")
    export.add_argument("--out", required=True, metavar="FILE", help="the jsonl file to write (replaced atomically)")
    export.add_argument("--summaries", action="store_true", help="also the user's segment summaries and their turns")
    export.add_argument("--config", required=True, help="the config the memory is served with")
    export.set_defaults(func=export_command, user_errors=live_errors)
    importer = commands.add_parser("import", help="add the users of an own-data jsonl file to a live memory")
    importer.add_argument("dir", metavar="DIR", help="the live memory's folder (created when missing)")
    importer.add_argument("file", metavar="FILE", help="own-data jsonl (what `memfit store export` writes)")
    importer.add_argument("--config", required=True, help="the config the memory is served with")
    importer.set_defaults(func=import_command, user_errors=live_errors)


@dataclass(frozen=True)
class Target:
    store: Path  # the store folder (log.jsonl, snapshots/)
    run_dir: Path | None  # its run directory, when there is one (config.yaml, cache.sqlite, .lock)
    lock: Path
    cfg: MemFitConfig


def resolve_target(directory: str | Path, config: str | None) -> Target:
    """The store a DIR argument names, its config, and the lock that keeps runs out. A store whose
    compaction was killed counts as there (even between the swap's two renames, when its folder is
    missing): opening it under the lock finishes or undoes the compaction."""
    from memfit_gpu.config import ConfigError, load_config
    from memfit_gpu.run.directory import is_memory_folder, is_run_directory, run_config
    from memfit_gpu.store.compaction import interrupted

    path = Path(directory)
    if is_run_directory(path):
        cfg = load_config(config) if config else run_config(path)
        store = Path(cfg.store.path) if cfg.store.path is not None else path / "store"
        run_dir: Path | None = path
    elif is_memory_folder(path):
        if config is None:
            raise ConfigError(f"{path}: a live memory's folder needs --config (the config it is served with)")
        # a live memory's log is fsynced, whoever writes it (Memory.open does the same): every add it
        # acknowledged is on disk, which its open checks against its snapshots
        cfg = load_config(config)
        cfg = replace(cfg, store=replace(cfg.store, fsync=True))
        store, run_dir = path / "store", None
    elif (path / "log.jsonl").is_file() or interrupted(path):
        store = path
        run_dir = path.parent if is_run_directory(path.parent) else None
        if config is None and run_dir is None:
            raise ConfigError(f"{path}: a store folder outside a run directory needs --config (the encoder and "
                              f"index settings it was built with)")
        cfg = load_config(config) if config else run_config(path.parent)
    else:
        raise FileNotFoundError(f"{path}: {_NOT_A_TARGET}")
    if not (store / "log.jsonl").is_file() and not interrupted(store):
        raise FileNotFoundError(f"{store / 'log.jsonl'}: no store there (was the run's build stage reached?)")
    return Target(store=store, run_dir=run_dir, lock=_lock_of(store, run_dir), cfg=cfg)


# What a DIR that is none of the three lacks
_NOT_A_TARGET = ("neither a run directory (config.yaml and timings.json, provenance.json, packs.jsonl or DONE), a "
                 "live memory's folder (store/ and .lock) nor a store folder (log.jsonl)")


def one_shot(cfg: MemFitConfig) -> MemFitConfig:
    """The config a store command opens a live memory with: no background consolidation (a command that
    exports, imports or compacts starts no LLM work; the turns it leaves waiting are taken up where the
    memory is next opened to serve)."""
    return replace(cfg, live=replace(cfg.live, consolidate="manual"))


def _lock_of(store: Path, run_dir: Path | None) -> Path:
    """The lock that keeps other writers out of `store`: its run directory's, its live memory's (a store
    folder `store` beside a memory's .lock), else one beside the store folder."""
    from memfit_gpu.locks import LOCK_FILE

    if run_dir is not None:
        return run_dir / ".lock"
    if store.name == "store" and (store.parent / LOCK_FILE).is_file():
        return store.parent / LOCK_FILE
    return store.parent / f".{store.name}.lock"


def repair_command(args: argparse.Namespace) -> int:
    from memfit_gpu.run.directory import is_memory_folder, is_run_directory, run_config
    from memfit_gpu.store.compaction import interrupted
    from memfit_gpu.store.repair import repair_store

    path = Path(args.dir)
    if is_run_directory(path):
        cfg = run_config(path)
        store, run_dir = (Path(cfg.store.path) if cfg.store.path is not None else path / "store"), path
    elif is_memory_folder(path):
        store, run_dir = path / "store", None
    else:
        store = path
        run_dir = path.parent if is_run_directory(path.parent) else None
    if not (store / "log.jsonl").is_file() and not interrupted(store):
        raise FileNotFoundError(f"{path}: {_NOT_A_TARGET}")
    with locked(_lock_of(store, run_dir)):
        report = repair_store(store, dry_run=args.dry_run)
    if report.torn_bytes:  # what any open to write does too; said here so that a dry run shows it
        print(f"  the log {'ends' if args.dry_run else 'ended'} in a torn record of {report.torn_bytes} bytes (a "
              f"killed writer's): {'the repair cuts it off' if args.dry_run else 'cut off'}, as any open does")
    if report.uncommitted:  # likewise (a store opened to read only, `memfit retrieve --store`, refuses it)
        print(f"  the log {'ends' if args.dry_run else 'ended'} in a write batch of {report.uncommitted} records that "
              f"was never committed (a killed writer's, or the log was cut short): "
              f"{'the repair drops it' if args.dry_run else 'dropped'}, as any open to write does")
    if not report.dropped:
        kept = "" if args.dry_run or report.backup is None else \
            f"; the old log is {report.backup}, the dropped records {report.dropped_file}"
        print(f"memfit store repair: {store}: all {report.batches} write batches apply; nothing "
              f"{'else ' if report.torn_bytes or report.uncommitted else ''}to repair{kept}")
        return 0
    for item in report.dropped:
        print(f"  log record {item['log_record']}: {item['reason']} ({item['records']} records"
              + (f", its {item['kept_memory_records']} memory record(s) kept" if item["kept_memory_records"] else "")
              + ")")
    verb = "would drop" if args.dry_run else "dropped"
    print(f"memfit store repair: {store}: {verb} {len(report.dropped)} of {report.batches} write batches "
          f"({report.records_dropped} records)" + ("" if args.dry_run else
          f"; the old log is {report.backup}, the dropped records {report.dropped_file}; "
          f"{report.snapshots_removed} snapshot(s) past the first change removed (the next open re-indexes "
          "what follows the last one kept)"))
    return 0


def live_errors() -> tuple[type[Exception], ...]:
    from memfit_gpu.live.memory import TurnConflictError, UnknownUserError
    from memfit_gpu.locks import DirectoryBusyError

    return (DirectoryBusyError, UnknownUserError, TurnConflictError)


def export_command(args: argparse.Namespace) -> int:
    from memfit_gpu.config import load_config
    from memfit_gpu.files import atomic_write_text
    from memfit_gpu.live.memory import Memory
    from memfit_gpu.run.directory import is_memory_folder

    folder = Path(args.dir)
    if not is_memory_folder(folder):
        raise FileNotFoundError(f"{folder}: not a live memory's folder (store/log.jsonl and .lock inside)")
    with Memory.open(folder, one_shot(load_config(args.config))) as memory:
        line = memory.export(args.user, summaries=args.summaries)
    atomic_write_text(args.out, json.dumps(line, ensure_ascii=False) + "\n")
    turns = sum(len(s["turns"]) for s in line["sessions"])
    print(f"memfit store export: {args.user}: {turns} turn(s) in {len(line['sessions'])} session(s)"
          + (f", {len(line.get('summaries', []))} summary(ies)" if args.summaries else "") + f" -> {args.out}")
    return 0


def import_command(args: argparse.Namespace) -> int:
    from memfit_gpu.config import load_config
    from memfit_gpu.data.jsonl import read
    from memfit_gpu.data.schema import DataError
    from memfit_gpu.live.memory import Memory

    bench, report = read(args.file)
    if report.errors:
        raise DataError(args.file, None, None, f"{len(report.errors)} problem(s); the first: {report.errors[0]} "
                                               f"(memfit data validate {args.file} lists them all)")
    # checked before the memory is opened: a refused import creates no folder and leaves a memory untouched
    problems = live_problems(args.file, bench.memories)
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise DataError(args.file, None, None, f"{len(problems)} problem(s) a live memory refuses; the first: "
                                               f"{problems[0]} (memfit data validate --live {args.file} lists "
                                               "them all)")
    with Memory.open(args.dir, one_shot(load_config(args.config))) as memory:
        counts = memory.import_memories(bench.memories)
    print(f"memfit store import: {args.file} -> {args.dir}: {counts['users']} user(s), {counts['turns']} turn(s) "
          f"stored, {counts['duplicates']} already there, {counts['summaries']} summary(ies)")
    return 0


def live_problems(file: str | Path, memories: Sequence[DataMemory], skip: Container[str] = ()) -> list[DataError]:
    """What a live memory refuses in the memories an own-data file holds (live.memory.import_problems), each
    named as `memfit data validate` names the file's problems: the file, "line 3 (user 'alice')" and the
    field's path. `skip`: the items (lines) whose memories are not checked (the reader's errors name them
    already)."""
    from memfit_gpu.live.memory import import_problems

    if not memories:  # nothing read (a file that is no UTF-8 text among them): nothing to check
        return []
    lines = Path(file).read_text(encoding="utf-8").split("\n")  # as data/jsonl.py reads it: lines end at \n
    numbers = [n for n, text in enumerate(lines, start=1) if text.strip()]
    if len(numbers) != len(memories):
        # the reader skipped lines (errors): each memory is the first line with its user id
        first: dict[str, int] = {}
        for n in numbers:
            try:
                record = json.loads(lines[n - 1])
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and isinstance(record.get("user_id"), str):
                first.setdefault(record["user_id"], n)
        numbers = [first[m.memory_id] for m in memories]
    items = [f"line {n} (user {m.memory_id!r})" for n, m in zip(numbers, memories, strict=True)]
    chosen = [i for i, (n, item) in enumerate(zip(numbers, items, strict=True))
              if item not in skip and f"line {n}" not in skip]  # a problem found before the user id names the line
    return import_problems([memories[i] for i in chosen], str(file), [items[i] for i in chosen])


def user_errors() -> tuple[type[Exception], ...]:
    from memfit_gpu.locks import DirectoryBusyError  # a run holds the directory: one line, exit code 2

    return (DirectoryBusyError,)


@contextmanager
def locked(lock: Path) -> Iterator[None]:
    """The store's lock (memfit_gpu.locks, the one `memfit run` holds); DirectoryBusyError if a run has it."""
    from memfit_gpu.locks import exclusive

    with exclusive(lock, f"a run in progress? try again when it has finished ({lock})"):
        yield


def _open_store(target: Target) -> EpisodeStore:
    from memfit_gpu.index.encoders import load_bi_encoder
    from memfit_gpu.store.episodes import EpisodeStore

    cfg = target.cfg
    encoder = load_bi_encoder(cfg.index)
    return EpisodeStore(target.store, cfg, encoder)


class _Summariser:
    """`generate` for rebuilt summaries: the config's reader behind the run's response cache, loaded only
    when a summary really has to be rebuilt."""

    def __init__(self, target: Target):
        self.target = target
        self.reader: Reader | None = None
        self.prompts = 0

    def __call__(self, prompts: list[str]) -> list[str]:
        from memfit_gpu.methods.memfit import summary_generate
        from memfit_gpu.readers.reader import make_reader

        if self.reader is None:
            self.reader = make_reader(self.target.cfg.reader, self.target.run_dir, progress=False)
        self.prompts += len(prompts)
        return summary_generate(self.reader, self.target.cfg)(prompts)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()


def delete_command(args: argparse.Namespace) -> int:
    from memfit_gpu.config import ConfigError

    target = resolve_target(args.dir, args.config)
    with locked(target.lock):
        store = _open_store(target)
        summariser = None if args.no_resummarize else _Summariser(target)
        try:
            try:
                counts = store.delete_episodes(args.memory, args.turn, summariser)
            except KeyError as exc:
                raise ConfigError(f"{target.store}: {exc.args[0]}") from None
        finally:
            store.close()
            if summariser is not None:
                summariser.close()
    turns = ", ".join(dict.fromkeys(args.turn))
    print(f"memfit store delete: {target.store}: deleted {counts['episodes']} turn(s) of {args.memory} ({turns}); "
          f"{counts['summaries_retired']} summary(ies) retired, {counts['summaries_rebuilt']} rebuilt"
          + (f" ({summariser.prompts} reader prompt(s))" if summariser is not None and summariser.prompts else ""))
    if target.run_dir is not None:
        print(f"{target.run_dir} is a finished experiment: its packs, predictions and metrics were made before "
              f"this deletion and are unchanged.")
    print(f"The text stays in {target.store / 'log.jsonl'} (tombstoned) until `memfit store compact {args.dir}`.")
    return 0


def compact_command(args: argparse.Namespace) -> int:
    from memfit_gpu.live.memory import Memory
    from memfit_gpu.run.directory import is_memory_folder

    target = resolve_target(args.dir, args.config)
    if target.run_dir is None and is_memory_folder(target.store.parent):
        # a live memory: compacted as Memory.compact does it (under the memory's own lock), so the method's
        # files follow and the users nothing is left of leave the reader's cache too
        with Memory.open(target.store.parent, one_shot(target.cfg)) as memory:
            counts = memory.compact()
    else:
        with locked(target.lock):
            store = _open_store(target)
            counts = store.compact()
    print(f"memfit store compact: {target.store}: {counts['episodes_before']} -> {counts['episodes_after']} "
          f"episode rows, {counts['summaries_before']} -> {counts['summaries_after']} summary rows, "
          f"{counts['records_before']} -> {counts['records_after']} log records; deleted turns and retired "
          f"summaries are gone from disk (rows renumbered in their old order)")
    if counts.get("memories_before", 0) > counts.get("memories_after", 0):
        print(f"{counts['memories_before'] - counts['memories_after']} memory(ies) with nothing left are gone with "
              "their ids and speakers"
              + (f"; the memory's cache.sqlite dropped their {counts['cache_responses_dropped']} cached response(s) "
                 f"and {counts['cache_calls_dropped']} call record(s)" if "cache_responses_dropped" in counts else ""))
    return 0
