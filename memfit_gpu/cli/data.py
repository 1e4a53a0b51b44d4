"""`memfit data`: inspect, fetch, validate and convert benchmarks (LoCoMo, LongMemEval, MemGallery, BEAM, own jsonl)."""

from __future__ import annotations

import argparse
import json

from memfit_gpu.cli.errors import UsageError

DESCRIPTION = """\
Benchmark data: LoCoMo (10 conversations), LongMemEval (S, M and oracle files; each question is its
own memory), MemGallery (20 multimodal scenarios), BEAM (splits 100K, 500K, 1M, 10M: the repository's
conversation folders or the hub's parquet) and your own data (jsonl: one memory per line, the
schema in docs/how-to/own-data.md), all read into one schema (Benchmark -> Memory -> Session -> Turn,
plus Questions). NAME is a registered benchmark (memfit_gpu/data/registry.py); a misspelt one is refused
with the list.

Where data is found, first hit wins:
  1. --path FILE_OR_FOLDER
  2. $MEMFIT_DATA_DIR, a folder laid out as locomo/locomo10.json, longmemeval/*.json, memgallery/dialog/,
     beam/<split>/<id>/chat.json
  3. the fetch cache, $MEMFIT_CACHE/data (default ~/.cache/memfit/data), same layout

Known quirks of the real files (malformed LoCoMo evidence, date keys without sessions,
adversarial-only answers, VS answers that are not image ids, ...) are handled and counted under
"problems"; a file that cannot be read fails with the file, item and field named.
"""

STATS_HELP = """\
Load a benchmark and print its counts: memories, sessions, turns, questions (all, evaluated,
abstention), questions per category, images, evidence coverage and the data quirks handled.
With --json, one JSON object on one line (for scripts and CI)."""

VALIDATE_HELP = """\
Read an own-data jsonl file (one memory per line: user_id, sessions with timestamps, turns with speaker
and text, optional images, questions with answer, category, optional evidence turn ids and question
date) and print every problem, one per line, naming the file, the line (and user) and the field: errors
(a missing or mistyped field, an unknown key, a repeated id, a date that is not ISO 8601) and warnings
(evidence naming no turn, an image file that is not there, an empty turn). Exit code 0 when the file
loads (warnings alone), 2 when it has errors. The schema: docs/how-to/own-data.md.

--live: the file is meant for a live memory (`memfit store import`); also list, as errors, what a live
memory refuses that a run takes: a user id outside the live alphabet (ASCII letters, digits and _ - . @ :)
and a turn whose text is empty or only white space (images alone make no turn there)."""

FETCH_HELP = """\
Download the official files (LoCoMo from snap-research/LoCoMo on GitHub; LongMemEval from the
Hugging Face dataset xiaowu0162/longmemeval-cleaned; MemGallery dialogs from Ethan-Bei/Mem-Gallery on
Hugging Face and its prompts from GitHub; BEAM's conversation folders of one split and its judge and
answer prompts, src/prompts.py and src/evaluation/compute_metrics.py, from mohammadtavakoli78/BEAM on
GitHub at the pinned commit b2a3ee8), check each against the sha256 in memfit_gpu/data/checksums.json
(BEAM's largest chat.json files, whose sha256 could not be computed: the git blob id the commit names)
and store it in the cache (or --dest). BEAM's hub parquet (Mohammadta/BEAM, Mohammadta/BEAM-10M) is read
from local files (--path) and not fetched: memfit holds no checksum of it to verify. A download is written to
NAME.part and renamed only when its checksum matches: a failed or corrupted download leaves nothing.
Files already cached with the right checksum are skipped."""


def _benchmark_to_read(parser: argparse.ArgumentParser) -> None:
    """NAME, --path and --split: which benchmark an action loads, found as `memfit run` finds it."""
    parser.add_argument("name", help="benchmark (locomo, longmemeval, memgallery, beam, jsonl, ...)")
    parser.add_argument("--path", help="file or folder to read (default: $MEMFIT_DATA_DIR, then the cache)")
    parser.add_argument("--split", help="LongMemEval split (s, m, oracle) or BEAM split (100K, 500K, 1M, 10M) when a "
                        "folder holds several")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "data",
        help="inspect, fetch, validate and convert benchmark data",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True

    stats = actions.add_parser(
        "stats", help="counts of a benchmark", description=STATS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    _benchmark_to_read(stats)
    stats.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    stats.add_argument(
        "--problems", type=int, default=5, metavar="N", help="how many quirks to list (default 5)"
    )
    stats.set_defaults(func=_stats)

    fetch = actions.add_parser(
        "fetch", help="download and verify the official files", description=FETCH_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    fetch.add_argument("name", help="benchmark with official files (locomo, longmemeval, memgallery, beam)")
    fetch.add_argument(
        "--dest", help="folder to store into (default: $MEMFIT_CACHE/data or ~/.cache/memfit/data)"
    )
    fetch.add_argument("--split", help="LongMemEval split: s (default), m, oracle; BEAM: 100K (default), 500K, 1M, 10M")
    fetch.add_argument(
        "--mirror",
        help="URL (http://, file://) or folder laid out like the cache to download from instead of the "
        "official hosts; checksums are still enforced",
    )
    fetch.add_argument("--no-progress", action="store_true", help="no progress bars")
    fetch.set_defaults(func=_fetch)

    synth = actions.add_parser(
        "synth", help="write a seeded synthetic benchmark: LongMemEval-format file or BEAM folders (data/synth.py)",
        description="A seeded synthetic benchmark shaped like LongMemEval S or M (or with LoCoMo-sized "
        "haystacks), one gold evidence turn per question, in the LongMemEval JSON layout that "
        "`--benchmark longmemeval --data FILE` reads (streamed memory by memory); or shaped like BEAM "
        "(beam-100k, beam-500k, beam-1m: the real 100K split's message lengths at each split's size; beam-10m: "
        "~21,000 messages a conversation, in plans as BEAM-10M), written in BEAM's repository layout that "
        "`--benchmark beam --data DIR` reads.",
    )  # fmt: skip
    # data/synth.py LIKES, spelt out so that `--help` does not import torch (a test holds the two equal)
    synth.add_argument("--like", required=True, choices=("longmemeval-s", "longmemeval-m", "locomo", "beam-100k",
                                                         "beam-500k", "beam-1m", "beam-10m"))
    synth.add_argument("--out", required=True, help="JSON file to write (beam-*: a folder, written in BEAM's layout)")
    synth.add_argument("--questions", type=int, default=50, help="questions (each with its own haystack; not beam-*)")
    synth.add_argument("--conversations", type=int, default=1, help="beam-*: conversations to write (20 questions each)")
    synth.add_argument("--seed", type=int, default=0)
    synth.set_defaults(func=_synth)


    validate = actions.add_parser(
        "validate", help="check an own-data jsonl file: every problem with its line and field",
        description=VALIDATE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    validate.add_argument("file", help="the jsonl file (docs/how-to/own-data.md)")
    validate.add_argument("--live", action="store_true",
                          help="also check what a live memory refuses (`memfit store import`): user ids, empty turns")
    validate.set_defaults(func=_validate)

    convert = actions.add_parser(
        "convert", help="write a benchmark in the own-data jsonl format",
        description="Load a benchmark (as `memfit run` would: --path, $MEMFIT_DATA_DIR, the cache) and write every "
        "memory, turn and question in the jsonl format of `data.benchmark=jsonl` (docs/how-to/own-data.md): a "
        "starting point for your own data, and the same packs as the original. Relative image paths are "
        "rewritten to name the same files from the output file's folder (where the format reads them from).",
    )  # fmt: skip
    _benchmark_to_read(convert)
    convert.add_argument("--out", required=True, help="jsonl file to write (atomically)")
    convert.set_defaults(func=_convert)


def _stats(args: argparse.Namespace) -> int:
    from memfit_gpu.data import load_benchmark
    from memfit_gpu.data.stats import benchmark_stats, format_stats

    benchmark = load_benchmark(args.name, args.path, split=args.split)
    stats = benchmark_stats(benchmark, first_problems=max(args.problems, 0))
    print(json.dumps(stats, ensure_ascii=False) if args.json else format_stats(stats))
    return 0


def _fetch(args: argparse.Namespace) -> int:
    from memfit_gpu.data.fetch import fetch_benchmark
    from memfit_gpu.data.registry import benchmark_spec, split_benchmarks

    if args.split is not None and not benchmark_spec(args.name).splits:
        raise UsageError(f"--split applies to {' or '.join(split_benchmarks())} only, not {args.name}")
    paths = fetch_benchmark(
        args.name, args.dest, split=args.split, mirror=args.mirror, progress=not args.no_progress
    )
    for path in paths:
        print(path)
    return 0


def _synth(args: argparse.Namespace) -> int:
    from memfit_gpu.data.synth import write_beam, write_longmemeval

    if args.like.startswith("beam"):
        if args.conversations < 1:
            raise UsageError(f"--conversations must be >= 1, got {args.conversations}")
        counts = write_beam(args.out, args.like, args.conversations, args.seed)
        print(json.dumps({"out": args.out, "like": args.like, **counts, "seed": args.seed,
                          "read_with": f"--benchmark beam --data {args.out}"}))
        return 0
    if args.questions < 1:
        raise UsageError(f"--questions must be >= 1, got {args.questions}")
    count = write_longmemeval(args.out, args.like, args.questions, args.seed)
    print(json.dumps({"out": args.out, "like": args.like, "questions": count, "seed": args.seed}))
    return 0


def _validate(args: argparse.Namespace) -> int:
    from memfit_gpu.data.jsonl import read
    from memfit_gpu.data.schema import DataError

    benchmark, report = read(args.file)
    errors = list(report.errors)
    if args.live:
        from memfit_gpu.cli.store import live_problems

        # memories the reader refused are named once, by the reader: checked again once they read
        errors += map(str, live_problems(args.file, benchmark.memories, {item for item, _, _ in report.problems}))
    for line in errors:
        print(f"error: {line}")
    # the file's warnings, then the quirks a run handles (empty turns, huge turns, questions left unscored)
    for line in benchmark.problems:
        print(f"warning: {line}")
    if errors:
        raise DataError(args.file, None, None, f"{len(errors)} error(s), {len(benchmark.problems)} warning(s) "
                                               "(listed above)")
    questions = sum(len(m.questions) for m in benchmark.memories)
    scored = sum(q.evaluated and "excluded" not in q.extra for m in benchmark.memories for q in m.questions)
    turns = sum(len(m.turns()) for m in benchmark.memories)
    print(f"ok: {args.file}: {len(benchmark.memories)} memories, {turns} turns, {questions} questions "
          f"({scored} scored by default), {len(benchmark.problems)} warning(s)")
    return 0


def _convert(args: argparse.Namespace) -> int:
    from memfit_gpu.data import load_benchmark
    from memfit_gpu.data.jsonl import rebase_images, to_jsonl
    from memfit_gpu.files import atomic_write_text

    benchmark = load_benchmark(args.name, args.path, split=args.split)
    # the format reads image paths from the output file's folder, the benchmark wrote them from its own
    atomic_write_text(args.out, to_jsonl(rebase_images(benchmark.memories, benchmark.source, args.out)))
    print(json.dumps({"out": args.out, "from": benchmark.source, "memories": len(benchmark.memories),
                      "questions": len(benchmark.questions())}))
    return 0
