"""A finished run directory as the report reads it: every file `memfit run` wrote that the report shows.

Nothing is recomputed that a run wrote: metrics.json's tables and intervals, packs.jsonl's ranked candidates
and packs, predictions.jsonl's scores and verdicts (read by `memfit compare`'s reader), provenance.json,
ledger.json and timings.json (through `memfit efficiency`'s row), depths.json. A directory without them is
refused, naming the file.

The page puts metrics.json's numbers (the table's point estimates) beside numbers worked out from
predictions.jsonl (intervals, comparisons, attribution), so the two must be of one scoring: metrics.json's
question count and reader errors, each category's, Overall's and Average's (under its `averaging` rule) size,
means and judge accuracy under the table's variant, and the unparsed judge replies must be those of the evaluated
predictions (evaluate.tables.summarize of them), or the run is refused (naming the file, the category and the
field) rather than shown with an interval that is not its estimate's. Every field the page reads is checked where
it is read, so a damaged file is one error naming the file, the question or category and the field, never a
traceback.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit_gpu import provenance
from memfit_gpu.data.schema import DataError
from memfit_gpu.data.spec import AVERAGING_RULES
from memfit_gpu.evaluate.compare import PredictionsError, read_predictions
from memfit_gpu.evaluate.efficiency import efficiency_values
from memfit_gpu.evaluate.tables import summarize
from memfit_gpu.files import is_finite_number, read_json_object, read_jsonl, read_yaml_mapping
from memfit_gpu.readers.ledger import read_ledger


class ReportError(ValueError):
    """A run directory the report cannot read, or a report that cannot keep to its size limit (one line)."""


@dataclass
class RunFiles:
    path: Path
    label: str
    config: dict[str, Any]  # config.yaml as written (a plugin's method name needs no registry here)
    metrics: dict[str, Any]
    provenance: dict[str, Any] | None
    ledger: dict[str, Any]
    timings: dict[str, float]
    packs: dict[str, dict[str, Any]]  # packs.jsonl rows by question id
    predictions: list[dict[str, Any]]  # predictions.jsonl's evaluated rows (the later line of a repeated question)
    depths: dict[str, Any] | None  # depths.json (eval.pack_cutoffs)
    warnings: list[str]
    # the metric variant every table and figure of the report reads this run at: the first run's table variant,
    # so that one column or one axis never holds two variants (read_run checks the run has it)
    variant: str

    @property
    def benchmark(self) -> str | None:
        return self.metrics.get("benchmark")

    @property
    def hit_list(self) -> str:
        """What the run's hit@k ranked over, as its diagnostics record it (eval.hit_list when they were made); a run
        whose diagnostics were made before the setting ranked the turns alone."""
        return str((self.metrics.get("retrieval") or {}).get("hit_list", "episodes"))

    @property
    def method(self) -> str:
        return str(self.config.get("method", "memfit"))

    def efficiency(self, price: dict[str, float] | None) -> dict[str, Any]:
        """`memfit efficiency`'s row of this run."""
        return efficiency_values(self.label, self.config, self.ledger, self.timings, int(self.metrics["questions"]),
                                 price)


def _json(path: Path, fields: dict[str, type | tuple[type, ...]] | None = None, numbers: bool = False,
          read: Callable[[Path], dict[str, Any]] | None = None) -> dict[str, Any]:
    """read_json_object of a file a scored run has (or `read`: read_ledger), ReportError naming it otherwise."""
    if not path.is_file():
        raise ReportError(f"{path} does not exist: {path.parent} is not a scored memfit run (memfit run writes it)")
    try:
        return read(path) if read is not None else read_json_object(path, fields, numbers)
    except DataError as exc:  # damaged, or (read_ledger) not a ledger: named with its field
        raise ReportError(str(exc)) from None


def read_run(path: str | Path, label: str, variant: str | None = None) -> RunFiles:
    """One scored run directory (metrics.json written: DONE follows it), read at metric `variant` (None: its own
    table variant, metrics.json's metric_variant). ReportError naming the file, the question or category and the
    field when a file is damaged, lacks `variant`, or when metrics.json is not the scoring of predictions.jsonl."""
    run = Path(path)
    if not run.is_dir():
        raise ReportError(f"{run} is not a directory (give memfit run's --out directories)")
    config_path = run / "config.yaml"
    if not config_path.is_file():
        raise ReportError(f"{config_path} is missing: {run} is not a memfit run directory")
    try:
        config = read_yaml_mapping(config_path)
    except DataError as exc:
        raise ReportError(str(exc)) from None
    metrics_path = run / "metrics.json"
    metrics = _json(metrics_path, {"questions": int, "average": dict, "by_category": dict})
    own = str(metrics.get("metric_variant") or "paper")
    variant = variant or own
    packs_path = run / "packs.jsonl"
    if not packs_path.is_file():
        raise ReportError(f"{packs_path} does not exist: {run} is not a memfit run directory")
    packs = _packs(packs_path)
    try:
        predictions_file, by_id, warnings = read_predictions(run)
    except (PredictionsError, ValueError, FileNotFoundError) as exc:  # one line naming the file, line and field
        raise ReportError(str(exc)) from None
    _check_scores(predictions_file, by_id.values(), variant, label, own)
    predictions = [{k: v for k, v in row.items() if k != "_line"} for row in by_id.values()]
    _check_metrics(metrics_path, metrics, predictions_file, predictions, variant, label, own)
    missing = [row["question_id"] for row in predictions if row["question_id"] not in packs]
    if missing:
        raise ReportError(f"{packs_path}: {len(missing)} predicted questions have no row (first: {missing[0]})")
    try:
        record = provenance.read(run)
    except provenance.ProvenanceError as exc:
        raise ReportError(str(exc)) from None
    timings = _json(run / "timings.json", numbers=True) if (run / "timings.json").is_file() else dict(metrics.get("timings") or {})
    depths = _json(run / "depths.json") if (run / "depths.json").is_file() else None
    if depths is not None:
        _check_depths(run / "depths.json", depths, variant, label, own)
    if variant != own:
        warnings = [*warnings, f"its own table metric is {own}; this report shows every run at {variant} (the first "
                               "run's), which its metrics.json and predictions.jsonl also hold"]
    return RunFiles(run, label, config, metrics, record, _json(run / "ledger.json", read=read_ledger),
                    {k: float(v) for k, v in timings.items()}, packs, predictions, depths, warnings, variant)


def _packs(path: Path) -> dict[str, dict[str, Any]]:
    """packs.jsonl's rows by question id; ReportError naming the line when one is not an object with one."""
    try:
        rows = read_jsonl(path, repair=False)
    except DataError as exc:
        raise ReportError(str(exc)) from None
    packs = {}
    for number, row in enumerate(rows, start=1):  # read_jsonl skips blank lines: the number counts rows
        qid = row.get("question_id") if isinstance(row, dict) else None
        if not isinstance(qid, str) or not qid:
            what = "not a JSON object" if not isinstance(row, dict) else "field 'question_id' missing or not a string"
            raise ReportError(f"{path}, row {number}: {what}")
        packs[qid] = row
    return packs


def _lacks(label: str, variant: str, own: str) -> str:
    # why a variant can be missing: the report reads every run at the first run's variant (RunFiles.variant)
    return (f"run {label} has no {variant} scores, and the report reads it at {variant}, "
            + ("its table metric" if variant == own else f"the first run's table metric (its own is {own})"))


def _check_scores(path: Path, rows: Iterable[Mapping[str, Any]], variant: str, label: str, own: str) -> None:
    """Each evaluated row has scores.VARIANT's f1 and bleu1 (the per-question table, intervals and attribution
    read them); read_predictions' row check already holds every score it has to a number from 0 to 1."""
    for row in rows:
        scores = row.get("scores")
        where = f"{path}:{row['_line']}: question {row['question_id']}, field"
        if scores is None:
            raise ReportError(f"{where} 'scores': null; {_lacks(label, variant, own)}")
        if variant not in scores:
            raise ReportError(f"{where} 'scores.{variant}': missing; {_lacks(label, variant, own)}")
        for metric in ("f1", "bleu1"):
            if metric not in scores[variant]:
                raise ReportError(f"{where} 'scores.{variant}.{metric}': None, not a number")


def _close(a: float, b: float) -> bool:
    # the same values summed in another order differ in the last bits, an edited file by far more
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


def _check_block(path: Path, name: str, block: Any, variant: str, label: str, own: str,
                 scored: Mapping[str, Any] | None) -> None:
    """One of metrics.json's blocks (a category, overall, average): its n and its VARIANT f1 / bleu1 numbers, and
    when `scored` (the same block as evaluate.tables.summarize makes it of the evaluated predictions; {"n": 0}
    for a category they do not have) is given, that they are its count, means and judge accuracy."""
    if not isinstance(block, dict):
        raise ReportError(f"{path}, {name}: expected an object, got {type(block).__name__}")
    n = block.get("n")
    if not isinstance(n, int) or isinstance(n, bool):
        raise ReportError(f"{path}, {name}, field 'n': {n!r:.40}, not a count")
    table = block.get(variant)
    if not isinstance(table, dict):
        raise ReportError(f"{path}, {name}, field '{variant}': "
                          + (f"missing; {_lacks(label, variant, own)}" if table is None
                             else f"expected an object, got {type(table).__name__}"))
    for metric in ("f1", "bleu1"):
        if not is_finite_number(table.get(metric)):
            raise ReportError(f"{path}, {name}, field '{variant}.{metric}': {table.get(metric)!r:.40}, not a number")
    judge = block.get("judge")
    if judge is not None and not is_finite_number(judge):
        raise ReportError(f"{path}, {name}, field 'judge': {judge!r:.40}, not a number")
    if scored is None:
        return
    # the table prints these numbers beside intervals and tests worked out from predictions.jsonl
    stale = "; the two files are not of one scoring (one was edited or replaced)"
    if n != scored["n"] or not scored["n"]:  # a block of no question has no mean and no interval either
        held = f"{scored['n']} evaluated questions" if scored["n"] else "no evaluated question"
        raise ReportError(f"{path}, {name}, field 'n': {n}, but predictions.jsonl holds {held} of it{stale}")
    # the average of category means (summarize's block counts its categories) is not its questions' mean
    mean_of = "the mean of its category means" if "categories" in scored else "its questions' mean"
    for metric in ("f1", "bleu1"):
        mean = scored[variant][metric]
        if not _close(float(table[metric]), mean):
            raise ReportError(f"{path}, {name}, field '{variant}.{metric}': {table[metric]:.6g}, but {mean_of} in "
                              f"predictions.jsonl is {mean:.6g}{stale}")
    if "judge" not in block:  # a run without the judge has no judge column
        return
    accuracy = scored["judge"]
    if not (judge is None and accuracy is None
            or judge is not None and accuracy is not None and _close(float(judge), accuracy)):
        shown = "null" if judge is None else f"{judge:.6g}"
        if "judged" not in scored:  # the average of category means: the mean of the categories' accuracies
            have = ("judge accuracies whose mean is " + f"{accuracy:.6g}" if accuracy is not None
                    else "no judge accuracy for every category")
            raise ReportError(f"{path}, {name}, field 'judge': {shown}, but predictions.jsonl holds {have} for its "
                              f"categories{stale}")
        have = f"an accuracy of {accuracy:.6g} over {scored['judged']} verdicts" if scored["judged"] else "no verdict"
        raise ReportError(f"{path}, {name}, field 'judge': {shown}, but predictions.jsonl holds {have} for its "
                          f"questions{stale}")


def _check_metrics(path: Path, metrics: dict[str, Any], predictions_file: Path, predictions: list[dict[str, Any]],
                   variant: str, label: str, own: str) -> None:
    """metrics.json is the scoring of these predictions: its question count and reader errors, each category's size,
    means and judge accuracy, overall's (and its unparsed judge replies) and average's under its averaging rule."""
    stale = "; the two files are not of one scoring (one was edited or replaced)"
    if metrics["questions"] != len(predictions):
        raise ReportError(f"{path}, field 'questions': {metrics['questions']}, but {predictions_file} holds "
                          f"{len(predictions)} evaluated questions{stale}")
    averaging = metrics.get("averaging")
    if averaging not in AVERAGING_RULES:  # the rule the Average row is worked out by, and the page states
        raise ReportError(f"{path}, field 'averaging': {averaging!r:.40}, not one of {', '.join(AVERAGING_RULES)}")
    # what the score stage would write of these predictions (the one summary: evaluate.tables.summarize)
    scored = summarize(predictions, variant=variant, judge=True, averaging=averaging, ci=False)
    by_category = scored["by_category"]
    blocks = metrics["by_category"]
    for cat, block in blocks.items():
        _check_block(path, f"category {cat!r}", block, variant, label, own, by_category.get(cat, {"n": 0}))
        if not isinstance(block.get("name"), str):
            raise ReportError(f"{path}, category {cat!r}, field 'name': {block.get('name')!r:.40}, not a text")
    unscored = [cat for cat in by_category if cat not in blocks]
    if unscored:
        raise ReportError(f"{path}, field 'by_category': no category {unscored[0]!r}, which {by_category[unscored[0]]['n']} "
                          f"questions of {predictions_file} have; the two files are not of one scoring (one was "
                          "edited or replaced)")
    if "overall" in metrics:
        _check_block(path, "overall", metrics["overall"], variant, label, own, scored["overall"])
    # the page prints Average beside the categories and Overall: an edited average was shown as it stood
    average = scored["average"]
    if averaging == "question_mean":  # every question alike: its verdicts are overall's
        average = {**average, "judged": scored["overall"]["judged"]}
    _check_block(path, "average", metrics["average"], variant, label, own, average)
    categories = metrics["average"].get("categories")
    if "categories" in metrics["average"] and categories != average.get("categories"):
        raise ReportError(f"{path}, average, field 'categories': {categories!r:.40}, but predictions.jsonl holds "
                          f"{len(by_category)} categories{stale}")
    # the counts the page states under the table (results.md's lines)
    counts = [("reader_errors", metrics.get("reader_errors"), scored["reader_errors"], "answers with a reader error")]
    if isinstance(metrics.get("overall"), dict) and "judge_unparsed" in metrics["overall"]:
        counts.append(("overall.judge_unparsed", metrics["overall"]["judge_unparsed"],
                       scored["overall"]["judge_unparsed"], "unparsed judge replies"))
    for field, count, held, what in counts:
        if count is not None and count != held:
            raise ReportError(f"{path}, field '{field}': {count!r:.40}, but predictions.jsonl holds {held} {what}"
                              f"{stale}")
    ci = metrics.get("ci95")
    if ci is not None and not (isinstance(ci, dict) and all(isinstance(ci.get(k), (dict, type(None)))
                                                            for k in ("average", "overall"))):
        raise ReportError(f"{path}, field 'ci95': expected an object of intervals")


def _check_depths(path: Path, depths: dict[str, Any], variant: str, label: str, own: str) -> None:
    """depths.json's rows as the depth table reads them: k, questions, prompt tokens and the average at VARIANT."""
    rows = depths.get("depths")
    if not isinstance(rows, list):
        raise ReportError(f"{path}, field 'depths': expected a list of depths, got {type(rows).__name__}")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ReportError(f"{path}, depth {i}: expected an object, got {type(row).__name__}")
        for name, check in (("k", lambda v: isinstance(v, int) and not isinstance(v, bool)),
                            ("questions", lambda v: isinstance(v, int) and not isinstance(v, bool)),
                            ("input_tokens_per_question", is_finite_number)):
            if not check(row.get(name)):
                raise ReportError(f"{path}, depth {i}, field {name!r}: {row.get(name)!r:.40}, not a number")
        _check_block(path, f"depth k={row['k']} average", {"n": row["questions"], **(row.get("average") or {})}
                     if isinstance(row.get("average"), dict) else row.get("average"), variant, label, own, None)


def labels_for(paths: list[Path]) -> list[str]:
    """Short distinct labels: each directory's name, with as many parent folders as it takes to tell them apart
    (a sweep's `points/k=5` of two sweeps), and a number where even the whole paths are alike."""
    parts = [p.resolve().parts for p in paths]
    depth = 1
    while True:
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels) or depth >= max(len(p) for p in parts):
            break
        depth += 1
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label} ({seen[label]})")
    return out
