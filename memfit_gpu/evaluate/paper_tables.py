"""The paper's tables, as Markdown and CSV, from finished `memfit run` / `memfit sweep` directories.

    memfit tables --out tables \
        --locomo-main runs/paper/locomo_qwen3_8b runs/paper/locomo_gemma3_27b \
        --plain-vs-memfit runs/paper/plain_vs_memfit_locomo_qwen3_8b runs/paper/ablations_locomo_gemma3_27b \
        --ablation runs/paper/ablations_locomo_gemma3_27b \
        --diagnostics runs/paper/ablations_locomo_gemma3_27b \
        --sensitivity runs/paper/sensitivity_locomo_qwen3_8b \
        --memgallery text=runs/paper/mg_text question=runs/paper/mg_question retrieved=runs/paper/mg_retrieved \
        --longmemeval runs/paper/longmemeval_s_qwen3_8b \
        --efficiency runs/paper/efficiency_locomo_gemma3_27b runs/paper/longmemeval_s_qwen3_8b

(the command line is memfit_gpu/cli/tables.py; `python experiments/paper_tables.py` is the same program.)
Every argument is `DIR` or `LABEL=DIR`.
A DIR holding `sweep.json` (a `memfit sweep --out`) stands for all its points, labelled by point id (`full`,
`no_prf`, ...). Only finished runs (`DONE`) are read. Each table goes to OUT/<name>.md and OUT/<name>.csv;
OUT/tables.md holds them all and is printed; the last line printed is a JSON object naming the files.

What each number is read from (nothing is recomputed that a run already wrote, except the paired tests):
- metrics.json (memfit_gpu.evaluate.tables.summarize): `by_category[cat][variant].f1|bleu1`,
  `by_category[cat].judge`, `average` (LoCoMo: mean of the category means), `overall` (question-weighted);
  `retrieval.overall|by_category[cat].pack_hit|hit@30|questions` (retrieval diagnostics);
  `timings.build|summaries|retrieve|answer` (seconds, StageTimer).
- ledger.json (memfit_gpu.readers.ledger.Ledger.to_dict): `roles[summary|answer|judge].calls|cached|
  input_tokens|output_tokens|wall_s|gpu_seconds`, `cost.usd|priced_usd|unpriced_models` (readers.ledger
  recorded_cost); every role summed into its phase (write | read | eval, readers.types.ROLE_PHASES) for the
  efficiency tables, so a baseline's own roles (LightMem-SLM's mtm_summary, consolidate, rewrite, rerank_slm) are
  counted too.
- config.yaml: `method` (memfit when absent) names the memory system in the efficiency table by method.
- predictions.jsonl: per-question judge verdicts for the paired sign-flip permutation tests
  (memfit_gpu.evaluate.compare.compare_runs), memory ids (memories per run), `*_abs` ids (LongMemEval
  abstention).
- provenance.json: under each table of several runs, provenance.drift's lines (provenance_notes), as `memfit compare`
  and `memfit aggregate` print them.
Fractions are printed x100 with two decimals, as the paper prints them; CSV cells hold the same scale unrounded.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from memfit_gpu import provenance, render
from memfit_gpu.data.schema import DataError
from memfit_gpu.evaluate.compare import (
    PredictionsError,
    check_same_questions,
    compare_runs,
    read_predictions,
    row_problem,
)
from memfit_gpu.evaluate.efficiency import efficiency_values
from memfit_gpu.evaluate.tables import LOCOMO_CATEGORIES, category_name, category_order
from memfit_gpu.files import (
    atomic_write_text,
    read_json_object,
    read_jsonl,
    read_yaml_mapping,
)
from memfit_gpu.readers.ledger import Ledger, load_prices, read_ledger, recorded_cost, usd_text
from memfit_gpu.sweep.spec import SweepError
from memfit_gpu.sweep.state import point_dir, read_sweep_record

LOCOMO_SCORED = ("1", "2", "3", "4")  # the paper's columns: multi-hop, temporal, open-domain, single-hop
LONGMEMEVAL_TYPES = (  # LongMemEval's own order of question types
    "single-session-user",
    "single-session-assistant",
    "single-session-preference",
    "multi-session",
    "knowledge-update",
    "temporal-reasoning",
)
ABLATION_BASELINE = "full"  # point names in configs/sweeps/paper_*.yaml
PLAIN_POINT = "plain_retrieval"
SENSITIVITY_BASELINE = "default"


class TablesError(ValueError):
    """A run directory or sweep that cannot make the asked table; the message names the directory and field."""


# ---------------------------------------------------------------------------------------------- runs


@dataclass
class Run:
    """One finished run directory (docs/concepts/design.md "Run directory")."""

    path: Path
    label: str
    config: dict[str, Any]
    metrics: dict[str, Any]
    ledger: dict[str, Any] | None
    # the config keys the run's sweep varies (sweep.json `sweep_keys`): a model or judge they name differs by design,
    # and the provenance lines under a table (provenance_notes) say so
    varied: tuple[str, ...] = ()

    @property
    def reader(self) -> str:
        return str(self.config.get("reader", {}).get("model", "?"))

    @property
    def method(self) -> str:
        return str(self.config.get("method", "memfit"))  # absent: a run from before methods existed

    @property
    def benchmark(self) -> str:
        return str(self.metrics.get("benchmark") or self.config.get("data", {}).get("benchmark", "?")).lower()

    def predictions(self) -> list[dict[str, Any]]:
        path = self.path / "predictions.jsonl"
        if not path.is_file():
            raise TablesError(f"{self.path}: no predictions.jsonl")
        try:  # the one JSONL reader: lines end at \n (a reply may hold U+2028, written raw)
            rows = read_jsonl(path, repair=False, finished=True)  # a finished run's: a torn line is damage
        except DataError as exc:
            raise TablesError(str(exc)) from None
        for row in rows:  # what every reader of predictions checks (a verdict "false" is no correct answer)
            problem = row_problem(row) if isinstance(row, dict) and row.get("evaluated", True) else None
            if problem is not None:
                raise TablesError(f"{path}: question {row.get('question_id')}: field '{problem[0]}' is {problem[1]}")
        return rows

    def need_ledger(self) -> dict[str, Any]:
        if self.ledger is None:
            raise TablesError(f"{self.path}: no ledger.json (calls, tokens and costs come from it)")
        return self.ledger

    def role(self, role: str) -> dict[str, Any]:
        roles = self.need_ledger().get("roles", {})
        stats = roles.get(role)
        if stats is None:
            raise TablesError(f"{self.path}/ledger.json: no roles.{role}")
        return stats

    def timing(self, stage: str) -> float | None:
        value = (self.metrics.get("timings") or {}).get(stage)
        return None if value is None else float(value)


def _read_json(path: Path, fields: dict[str, type | tuple[type, ...]] | None = None) -> dict[str, Any]:
    try:
        return read_json_object(path, fields)
    except DataError as exc:  # damaged, or another memfit's: named with its field
        raise TablesError(str(exc)) from None


def load_run(path: str | Path, label: str | None = None) -> Run:
    """A finished run directory; an unfinished or incomplete one is an error naming what is missing."""
    path = Path(path)
    if not path.is_dir():
        raise TablesError(f"{path}: not a run directory")
    if not (path / "DONE").exists():
        raise TablesError(f"{path}: no DONE, the run has not finished (the same `memfit run --out` resumes it)")
    for name in ("config.yaml", "metrics.json"):
        if not (path / name).is_file():
            raise TablesError(f"{path}: DONE but no {name}")
    try:
        config = read_yaml_mapping(path / "config.yaml")
    except DataError as exc:  # damaged: named
        raise TablesError(str(exc)) from None
    # what the tables read (an older memfit's metrics.json without them: refused naming the field)
    metrics = _read_json(path / "metrics.json", {"metric_variant": str, "average": dict, "by_category": dict})
    try:
        ledger = read_ledger(path / "ledger.json") if (path / "ledger.json").is_file() else None
    except DataError as exc:  # not a ledger: named with its field
        raise TablesError(str(exc)) from None
    return Run(path, label or path.name, config, metrics, ledger)


def sweep_point_dirs(sweep_dir: Path) -> list[tuple[str, Path]]:
    """(point id, directory) in the sweep file's order, from OUT/sweep.json."""
    try:
        points = read_sweep_record(sweep_dir / "sweep.json").points
    except SweepError as exc:
        raise TablesError(str(exc)) from None  # a sweep.json without points among them
    return [(p.point_id, point_dir(sweep_dir, p.point_id)) for p in points]  # never sweep.json's recorded dir


def sweep_keys(sweep_dir: Path) -> tuple[str, ...]:
    """The config keys a sweep varies (its sweep.json)."""
    try:
        return tuple(read_sweep_record(sweep_dir / "sweep.json").sweep_keys)
    except SweepError as exc:
        raise TablesError(str(exc)) from None


def split_spec(spec: str) -> tuple[str, Path]:
    """(label or "", directory) of `DIR` or `LABEL=DIR`; an existing DIR may itself contain "=" (`points/k=5`)."""
    label, _, rest = spec.partition("=")
    if not rest or Path(spec).exists():
        return "", Path(spec)
    return label, Path(rest)


def expand(spec: str) -> list[Run]:
    """`DIR` or `LABEL=DIR`; a sweep directory becomes all its points (labels `LABEL/point` or `point`)."""
    label, path = split_spec(spec)
    if (path / "sweep.json").is_file():
        varied = sweep_keys(path)
        return [replace(load_run(d, f"{label}/{pid}" if label else pid), varied=varied)
                for pid, d in sweep_point_dirs(path)]
    return [load_run(path, label or None)]


def expand_all(specs: Iterable[str]) -> list[Run]:
    """Every run the specs name; two runs of one label are refused (a table's rows are found by label)."""
    runs: list[Run] = []
    for spec in specs:
        runs += expand(spec)
    seen: dict[str, Path] = {}
    for run in runs:
        if run.label in seen:
            raise TablesError(f"two runs are labelled {run.label!r} ({seen[run.label]} and {run.path}): give each "
                              "its own LABEL=DIR")
        seen[run.label] = run.path
    return runs


def point(runs: Sequence[Run], name: str, where: str) -> Run:
    """The run labelled `name` (or `<sweep label>/name`)."""
    for run in runs:
        if run.label == name or run.label.endswith("/" + name):
            return run
    raise TablesError(f"{where}: no run labelled {name!r} (have: {', '.join(r.label for r in runs)})")


def provenance_notes(runs: Sequence[Run], varied: Sequence[str] = ()) -> list[str]:
    """provenance.drift over the runs a table combines, the first the reference: a `warning:` line per section whose
    difference makes their numbers incomparable (data, category names, weights, judge, prompts), a `note:` line per
    other (code, packages, devices; a run without provenance.json), as `memfit compare` and `memfit aggregate` print
    them. varied: config keys the table's rows differ in by design (Table 1's readers), with the runs' sweep keys; a
    model or judge they name is marked as expected. Nothing for a table of one run."""
    if len(runs) < 2:
        return []
    labels = [run.label for run in runs]
    # two sweeps' points share labels (Table 6: `full` of each reader): such a run is named by its directory
    names = [label if labels.count(label) == 1 else str(run.path) for label, run in zip(labels, runs, strict=True)]
    try:
        records = {name: provenance.read(run.path) for name, run in zip(names, runs, strict=True)}
    except provenance.ProvenanceError as exc:  # a damaged provenance.json: named
        raise TablesError(str(exc)) from None
    keys = list(dict.fromkeys([*varied, *(key for run in runs for key in run.varied)]))
    return provenance.drift(records, varied=keys)


# --------------------------------------------------------------------------------------------- table


# How a column's values are shown: markdown text, and the number written to CSV (None = empty).
FORMATS: dict[str, tuple[Callable[[Any], str], Callable[[Any], Any]]] = {
    "text": (str, str),
    "int": (lambda v: f"{int(v)}", int),
    "pct": (lambda v: f"{100.0 * v:.2f}", lambda v: 100.0 * v),  # a fraction, printed x100
    "dpct": (lambda v: f"{100.0 * v:+.2f}", lambda v: 100.0 * v),  # a difference of fractions, signed
    "p": (lambda v: f"{v:.4f}", float),
    "ratio": (lambda v: f"x{v:.2f}", float),
    "num0": (lambda v: f"{v:.0f}", float),
    "num1": (lambda v: f"{v:.1f}", float),
    "num2": (lambda v: f"{v:.2f}", float),
    "num4": (lambda v: f"{v:.4f}", float),
}


@dataclass
class Column:
    name: str
    kind: str = "pct"


@dataclass
class Table:
    key: str  # file stem
    title: str
    columns: list[Column]
    rows: list[list[Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def formatted(self) -> list[list[str]]:
        out = []
        for row in self.rows:
            out.append(["-" if v is None else FORMATS[c.kind][0](v) for c, v in zip(self.columns, row, strict=True)])
        return out

    def cell(self, row_label: str, column: str) -> str:
        """The shown text of one cell (row by its first cell), for tests and readers of the table."""
        names = [c.name for c in self.columns]
        if column not in names:
            raise KeyError(f"{self.key}: no column {column!r} (have {names})")
        for row in self.formatted():
            if row[0] == row_label:
                return row[names.index(column)]
        raise KeyError(f"{self.key}: no row {row_label!r}")

    def markdown(self) -> str:
        table = render.markdown_table([c.name for c in self.columns], self.formatted(),
                                      align=["left" if c.kind == "text" else "right" for c in self.columns])
        lines = [f"### {self.title}", "", table.rstrip("\n")]
        if self.notes:
            lines += [""] + [f"- {n}" for n in self.notes]
        return "\n".join(lines) + "\n"

    def write_csv(self, path: Path) -> Path:
        atomic_write_text(path, render.csv_text(
            [c.name for c in self.columns],
            [[None if v is None else FORMATS[c.kind][1](v) for c, v in zip(self.columns, row, strict=True)]
             for row in self.rows]))
        return path


# ----------------------------------------------------------------------------------------- helpers


@dataclass
class PairedTests:
    """Paired sign-flip permutation tests (memfit_gpu.evaluate.stats via compare_runs)."""

    n_permutations: int = 10_000
    seed: int = 0
    method: str = "monte_carlo"  # exact: every sign vector (tiny runs, tests)


def _variant(runs: Sequence[Run], variant: str | None) -> str:
    chosen = variant or runs[0].metrics.get("metric_variant", "paper")
    for run in runs:
        if chosen not in run.metrics.get("variants", [run.metrics.get("metric_variant")]):
            raise TablesError(f"{run.path}/metrics.json: metric variant {chosen!r} not scored "
                              f"(variants: {run.metrics.get('variants')})")
    return chosen


def _check_benchmark(runs: Sequence[Run], benchmark: str, table: str) -> None:
    for run in runs:
        if run.benchmark != benchmark:
            raise TablesError(f"{run.path}: {table} needs {benchmark} runs, this one is {run.benchmark}")


def _category(run: Run, cat: str) -> dict[str, Any] | None:
    return (run.metrics.get("by_category") or {}).get(cat)


def _f1(block: Mapping[str, Any] | None, variant: str, metric: str = "f1") -> float | None:
    if block is None or variant not in block:
        return None
    return block[variant][metric]


def _judge(block: Mapping[str, Any] | None) -> float | None:
    return None if block is None else block.get("judge")


def _average(run: Run, variant: str, metric: str = "f1") -> float | None:
    if run.benchmark == "locomo" and run.metrics.get("averaging") != "category_mean":
        raise TablesError(f"{run.path}/metrics.json: LoCoMo's Average must be the mean of category means, "
                          f"averaging is {run.metrics.get('averaging')!r}")
    return _f1(run.metrics.get("average"), variant, metric)


def _judged(run: Run) -> bool:
    return (run.metrics.get("overall") or {}).get("judge") is not None


NO_TEST = {"n": None, "mean_a": None, "mean_b": None, "diff": None, "p_value": None, "gained": None, "lost": None}


def _paired(a: Run, b: Run, tests: PairedTests, variant: str) -> dict[str, Any]:
    """B against A, judge verdicts; the overall (question-weighted) test. The two runs must have answered the
    same questions, judged or not: the tables print differences of their averages beside the test. Runs made
    without the judge (eval.judge.enabled false) have no verdicts: every judge cell stays empty."""
    try:
        (path_a, rows_a, _), (path_b, rows_b, _) = read_predictions(a.path), read_predictions(b.path)
        if rows_a.keys() != rows_b.keys():
            only_a, only_b = len(rows_a.keys() - rows_b.keys()), len(rows_b.keys() - rows_a.keys())
            raise TablesError(f"{path_a} and {path_b} answered different questions ({only_a} only in the first, "
                              f"{only_b} only in the second): their differences would compare other questions")
        check_same_questions(path_a, rows_a, path_b, rows_b)  # one id, other gold: judged or not
        if not (_judged(a) and _judged(b)):
            return dict(NO_TEST)
        return compare_runs(a.path, b.path, metric="judge", variant=variant, n_permutations=tests.n_permutations,
                            seed=tests.seed, method=tests.method)["overall"]
    except (PredictionsError, FileNotFoundError) as exc:
        raise TablesError(f"paired test {a.label} vs {b.label}: {exc}") from None


def _locomo_cat_label(cat: str) -> str:
    return LOCOMO_CATEGORIES[cat]


def _test_note(tests: PairedTests) -> str:
    how = ("exact enumeration" if tests.method == "exact"
           else f"{tests.n_permutations} random sign flips, seed {tests.seed}")
    return (f"p: two-sided paired sign-flip permutation test over per-question judge verdicts ({how}); "
            "gained / lost: questions judged wrong -> right / right -> wrong; - where a run was not judged.")


# ------------------------------------------------------------------------------------------ tables


def locomo_main(runs: Sequence[Run], variant: str | None = None) -> Table:
    """Table 1: per-category F1 / BLEU-1 / judge and the average (mean of the category means) per reader."""
    _check_benchmark(runs, "locomo", "Table 1")
    variant = _variant(runs, variant)
    columns = [Column("Run", "text"), Column("Reader", "text"), Column("n", "int")]
    for cat in LOCOMO_SCORED:
        name = _locomo_cat_label(cat)
        columns += [Column(f"{name} F1"), Column(f"{name} BLEU-1"), Column(f"{name} Judge")]
    columns += [Column("Average F1"), Column("Average BLEU-1"), Column("Average Judge")]
    table = Table("table1_locomo", "Table 1: LoCoMo, per category and average", columns)
    for run in runs:
        row: list[Any] = [run.label, run.reader, run.metrics.get("questions")]
        for cat in LOCOMO_SCORED:
            block = _category(run, cat)
            row += [_f1(block, variant), _f1(block, variant, "bleu1"), _judge(block)]
        average = run.metrics.get("average") or {}
        row += [_average(run, variant), _average(run, variant, "bleu1"), average.get("judge")]
        table.rows.append(row)
    table.notes = [
        f"F1 / BLEU-1: metric variant `{variant}`, x100. {_averaged_note(runs)} (each Judge column likewise); "
        "n = scored questions.",
    ] + provenance_notes(runs, ("reader.model",))
    return table


def _averaged_note(runs: Sequence[Run]) -> str:
    """Which category means each run's Average is the mean of: the categories of its metrics.json (the ones
    evaluate.tables.summarize found among its scored questions), named; "the four" only when they are 1-4."""
    averaged = {run.label: category_order(run.metrics.get("by_category") or {}) for run in runs}

    def named(cats: Sequence[str]) -> str:
        return ", ".join(category_name(c, "locomo") for c in cats)

    if all(cats == list(LOCOMO_SCORED) for cats in averaged.values()):
        return "Average = unweighted mean of the four category means"
    # a run without a category's questions (a smoke run's 3 of 4), or with category 5 scored: another mean
    kinds = {tuple(cats) for cats in averaged.values()}
    if len(kinds) == 1:
        (cats,) = kinds
        return f"Average = unweighted mean of the {len(cats)} category means the runs scored ({named(cats)})"
    each = "; ".join(f"{label}: {len(cats)} ({named(cats)})" for label, cats in averaged.items())
    return f"Average = unweighted mean of the means of the categories each run scored ({each})"


def plain_vs_memfit(pairs: Sequence[tuple[str, Run, Run]], tests: PairedTests, variant: str | None = None) -> Table:
    """Table 6: plain retrieval against MemFit per reader: judge, difference, p, gained/lost, average F1."""
    variant = _variant([r for _, a, b in pairs for r in (a, b)], variant)
    table = Table("table6_plain_vs_memfit", "Table 6: plain retrieval vs MemFit (same store, encoders, reader)", [
        Column("Reader", "text"), Column("n", "int"), Column("Plain Judge"), Column("MemFit Judge"),
        Column("Judge diff", "dpct"), Column("p", "p"), Column("Gained", "int"), Column("Lost", "int"),
        Column("Plain Avg F1"), Column("MemFit Avg F1"), Column("F1 diff", "dpct"),
    ])
    for label, plain, memfit in pairs:
        test = _paired(plain, memfit, tests, variant)
        f1_plain, f1_memfit = _average(plain, variant), _average(memfit, variant)
        table.rows.append([label, test["n"], test["mean_a"], test["mean_b"], test["diff"], test["p_value"],
                           test["gained"], test["lost"], f1_plain, f1_memfit,
                           None if f1_plain is None or f1_memfit is None else f1_memfit - f1_plain])
    table.notes = [
        "Judge = accuracy over all paired questions (question-weighted), x100; Avg F1 = the benchmark's Average "
        f"(LoCoMo: mean of category means), variant `{variant}`.",
        _test_note(tests),
    ] + provenance_notes([r for _, a, b in pairs for r in (a, b)], ("reader.model",))
    return table


def pairs_from_sweeps(specs: Iterable[str]) -> list[tuple[str, Run, Run]]:
    """(reader label, plain run, MemFit run) from sweeps holding `full` and `plain_retrieval` points."""
    pairs = []
    for spec in specs:
        runs = expand(spec)
        memfit = point(runs, ABLATION_BASELINE, spec)
        plain = point(runs, PLAIN_POINT, spec)
        label, _ = split_spec(spec)
        pairs.append((label or memfit.reader, plain, memfit))
    return pairs


def ablation(runs: Sequence[Run], tests: PairedTests, baseline: str = ABLATION_BASELINE,
             variant: str | None = None) -> Table:
    """Tables 3/7: per-category F1, average F1 / BLEU-1, judge, and differences to the full system."""
    _check_benchmark(runs, "locomo", "the ablation table")
    variant = _variant(runs, variant)
    base = point(runs, baseline, "ablation")
    columns = [Column("Configuration", "text")]
    columns += [Column(f"{_locomo_cat_label(c)} F1") for c in LOCOMO_SCORED]
    columns += [Column("Avg F1"), Column("Avg BLEU-1"), Column("Judge"), Column("F1 diff", "dpct"),
                Column("Judge diff", "dpct"), Column("p", "p"), Column("Gained", "int"), Column("Lost", "int")]
    table = Table("table7_ablation", f"Tables 3/7: LoCoMo ablation ({base.reader})", columns)
    base_f1 = _average(base, variant)
    for run in runs:
        row: list[Any] = [run.label] + [_f1(_category(run, c), variant) for c in LOCOMO_SCORED]
        f1 = _average(run, variant)
        row += [f1, _average(run, variant, "bleu1"), (run.metrics.get("overall") or {}).get("judge")]
        if run is base:
            row += [None] * 5
        else:
            test = _paired(base, run, tests, variant)
            row += [None if f1 is None or base_f1 is None else f1 - base_f1, test["diff"], test["p_value"],
                    test["gained"], test["lost"]]
        table.rows.append(row)
    table.notes = [
        f"Differences are to `{base.label}`. Avg = mean of the category means (variant `{variant}`); "
        "Judge = accuracy over all questions (question-weighted).",
        _test_note(tests),
    ] + provenance_notes(runs)
    return table


def retrieval_diagnostics(runs: Sequence[Run]) -> Table:
    """Tables 8/9: pack hit and hit@30, overall and per category (metrics.json "retrieval")."""
    blocks = []
    for run in runs:
        retrieval = run.metrics.get("retrieval")
        if not isinstance(retrieval, Mapping) or "overall" not in retrieval:
            raise TablesError(f"{run.path}/metrics.json: no retrieval diagnostics (`retrieval.overall`)")
        blocks.append(retrieval)
    benchmark = runs[0].benchmark
    cats = category_order(c for b in blocks for c in (b.get("by_category") or {}))
    if benchmark == "locomo":
        cats = [c for c in cats if c in LOCOMO_SCORED]
    # what each run's hit@30 ranked over (eval.hit_list): runs of `final` and `episodes` side by side count other
    # lists, so the column says which (a run whose diagnostics predate the setting ranked the turns alone)
    hit_lists = [str(block.get("hit_list", "episodes")) for block in blocks]
    columns = [Column("Configuration", "text"), Column("Hit list", "text"), Column("n", "int"), Column("Pack hit"),
               Column("Hit@30")]
    for cat in cats:
        name = category_name(cat, benchmark)
        columns += [Column(f"{name} pack hit"), Column(f"{name} hit@30")]
    table = Table("table9_retrieval", "Tables 8/9: retrieval diagnostics (gold evidence in the pack / top 30)",
                  columns)
    for run, block, hit_list in zip(runs, blocks, hit_lists, strict=True):
        overall = block["overall"]
        row: list[Any] = [run.label, hit_list, overall.get("questions"), overall.get("pack_hit"), overall.get("hit@30")]
        for cat in cats:
            per = (block.get("by_category") or {}).get(cat) or {}
            row += [per.get("pack_hit"), per.get("hit@30")]
        table.rows.append(row)
    table.notes = [
        "Pack hit: a gold evidence turn among the k selected episodes, before neighbour turns are added; Hit@30: "
        "in the first 30 of the ranked list the run's `eval.hit_list` names (Hit list: `final`, the final ranked "
        "list, where a summary holds a rank too; `episodes`, the episodes alone). n = questions with matched gold "
        "evidence.",
    ]
    if len(set(hit_lists)) > 1:
        table.notes.append("warning: the runs' Hit@30 rank over different lists (" + ", ".join(
            f"{run.label}: {h}" for run, h in zip(runs, hit_lists, strict=True)) + "): those columns are not "
            "comparable between them (rerun with one eval.hit_list)")
    table.notes += provenance_notes(runs)
    return table


def answer_tokens_per_call(run: Run) -> float | None:
    """Mean input tokens of the answer prompts the backend generated (cache hits carry no token counts)."""
    stats = run.role("answer")
    return stats["input_tokens"] / stats["calls"] if stats.get("calls") else None


def sensitivity(runs: Sequence[Run], tests: PairedTests, baseline: str = SENSITIVITY_BASELINE,
                variant: str | None = None) -> Table:
    """Table 10: per-category F1, average, judge, difference and p to the default, input tokens relative to it."""
    _check_benchmark(runs, "locomo", "the sensitivity table")
    variant = _variant(runs, variant)
    base = point(runs, baseline, "sensitivity")
    columns = [Column("Setting", "text")] + [Column(f"{_locomo_cat_label(c)} F1") for c in LOCOMO_SCORED]
    columns += [Column("Avg F1"), Column("Judge"), Column("Judge diff", "dpct"), Column("p", "p"),
                Column("Input tokens / question", "num0"), Column("Tokens vs default", "ratio")]
    table = Table("table10_sensitivity", f"Table 10: sensitivity to retrieval settings ({base.reader})", columns)
    base_tokens = answer_tokens_per_call(base)
    for run in runs:
        row: list[Any] = [run.label] + [_f1(_category(run, c), variant) for c in LOCOMO_SCORED]
        row += [_average(run, variant), (run.metrics.get("overall") or {}).get("judge")]
        if run is base:
            row += [None, None]
        else:
            test = _paired(base, run, tests, variant)
            row += [test["diff"], test["p_value"]]
        tokens = answer_tokens_per_call(run)
        row += [tokens, None if tokens is None or not base_tokens else tokens / base_tokens]
        table.rows.append(row)
    table.notes = [
        f"Differences and the token ratio are to `{base.label}`. Input tokens / question: answer-prompt tokens "
        "(ledger.json roles.answer.input_tokens / calls) as the reader's tokenizer counts them.",
        _test_note(tests),
    ] + provenance_notes(runs)
    return table


def memgallery(runs: Sequence[Run], tests: PairedTests, variant: str | None = None) -> Table:
    """Table 11: MemGallery F1 per category, overall F1 and judge per condition, judge difference to the first."""
    _check_benchmark(runs, "memgallery", "the MemGallery table")
    variant = _variant(runs, variant)
    cats = category_order(c for r in runs for c in (r.metrics.get("by_category") or {}))
    columns = [Column("Condition", "text"), Column("n", "int")]
    columns += [Column(f"{c} F1") for c in cats]
    columns += [Column("Overall F1"), Column("Judge"), Column("Judge diff", "dpct"), Column("p", "p")]
    table = Table("table11_memgallery", "Table 11: MemGallery F1 by category", columns)
    first = runs[0]
    for run in runs:
        overall = run.metrics.get("overall") or {}
        row: list[Any] = [run.label, run.metrics.get("questions")]
        row += [_f1(_category(run, c), variant) for c in cats]
        row += [_f1(overall, variant), overall.get("judge")]
        if run is first:
            row += [None, None]
        else:
            test = _paired(first, run, tests, variant)
            row += [test["diff"], test["p_value"]]
        table.rows.append(row)
    names = ", ".join(f"{c} = {category_name(c, 'memgallery')}" for c in cats if category_name(c, "memgallery") != c)
    table.notes = [
        f"Token F1 (variant `{variant}`) x100; Overall = question-weighted over all questions. Judge diff and p are "
        f"to `{first.label}`." + (f" {names}." if names else ""),
        _test_note(tests),
    ] + provenance_notes(runs)
    return table


def longmemeval(runs: Sequence[Run]) -> Table:
    """Table 2 (LongMemEval-S): judge accuracy by question type, abstention questions, overall."""
    _check_benchmark(runs, "longmemeval", "the LongMemEval table")
    present = {c for r in runs for c in (r.metrics.get("by_category") or {})}
    types = [t for t in LONGMEMEVAL_TYPES if t in present] + sorted(present - set(LONGMEMEVAL_TYPES))
    columns = [Column("Run", "text"), Column("Reader", "text"), Column("n", "int")]
    columns += [Column(t) for t in types] + [Column("Abstention"), Column("n abstention", "int"), Column("Overall")]
    table = Table("table2_longmemeval", "Table 2: LongMemEval accuracy by question type", columns)
    for run in runs:
        overall = run.metrics.get("overall") or {}
        if overall.get("judge") is None:
            raise TablesError(f"{run.path}/metrics.json: not judged (LongMemEval accuracy is the judge's)")
        abstention = [r for r in run.predictions() if r.get("evaluated", True)
                      and str(r.get("question_id", "")).endswith("_abs")]
        verdicts = [bool(r["judge"]["verdict"]) for r in abstention
                    if isinstance(r.get("judge"), Mapping) and r["judge"].get("verdict") is not None]
        if len(verdicts) != len(abstention):
            raise TablesError(f"{run.path}/predictions.jsonl: {len(abstention) - len(verdicts)} abstention "
                              "questions have no judge verdict")
        row: list[Any] = [run.label, run.reader, run.metrics.get("questions")]
        row += [_judge(_category(run, t)) for t in types]
        row += [sum(verdicts) / len(verdicts) if verdicts else None, len(abstention), overall["judge"]]
        table.rows.append(row)
    table.notes = [
        "Judge accuracy x100 with LongMemEval's per-type judge prompts. A question type's column includes its "
        "abstention questions (ids ending `_abs`), which are also shown on their own; Overall = all questions.",
    ] + provenance_notes(runs, ("reader.model",))
    return table


def _memories(run: Run) -> int:
    return len({str(r.get("memory_id")) for r in run.predictions()})


def _per(value: float | None, count: int | None, scale: float = 1.0) -> float | None:
    return None if value is None or not count else scale * value / count


def _price(price_model: str, prices_path: str | Path | None) -> dict[str, float]:
    prices = load_prices(prices_path)
    if price_model not in prices:
        raise TablesError(f"no price for {price_model!r} in the price table (have: {', '.join(sorted(prices))})")
    return prices[price_model]


def efficiency(runs: Sequence[Run], price_model: str = "gpt-4.1-mini",
               prices_path: str | Path | None = None) -> tuple[Table, Table]:
    """Figure 3 / Tables 13-14: build time, latency, LLM calls, tokens and cost per run (timings, ledger).

    Any method's run: its LLM calls and tokens are the ledger's write and read phases (readers.types.ROLE_PHASES;
    for MemFit, summary and answer); `efficiency_methods` splits them per phase and names the method."""
    price = _price(price_model, prices_path)
    time_table = Table("efficiency_time", "Efficiency: time per stage", [
        Column("Run", "text"), Column("Memories", "int"), Column("Questions", "int"),
        Column("Store + index s", "num1"), Column("Summaries s", "num1"), Column("Memory build s", "num1"),
        Column("Build s / memory", "num2"), Column("Retrieval ms / question", "num1"),
        Column("Answer s / question", "num2"), Column("GPU-seconds", "num0"),
    ])
    cost_table = Table("efficiency_cost", "Efficiency: LLM calls, tokens and cost", [
        Column("Run", "text"), Column("Summary calls", "int"), Column("Answer calls", "int"),
        Column("Judge calls", "int"), Column("LLM calls", "int"), Column("Summary calls / memory", "num2"),
        Column("Build tokens / memory (k)", "num2"), Column("Answer input tokens / question", "num0"),
        # four decimals, as efficiency_methods prints the same cost: a smoke run's 0.0022 is no 0.00
        Column("Answer output tokens / question", "num1"), Column("Ledger USD", "num4"),
        Column(f"USD at {price_model} prices", "num4"),
    ])
    cached_notes = []
    unpriced_notes = []
    for run in runs:
        summary, answer = run.role("summary"), run.role("answer")
        judge = run.need_ledger().get("roles", {}).get("judge") or {}
        phases = Ledger.from_dict(run.need_ledger()).phases()
        write, read = phases["write"], phases["read"]
        memories = _memories(run)
        questions = answer["calls"] + answer["cached"]
        store_s, summaries_s = run.timing("build"), run.timing("summaries")
        build_s = None if store_s is None else store_s + (summaries_s or 0.0)
        retrieve_s = run.timing("retrieve")
        time_table.rows.append([
            run.label, memories, questions, store_s, summaries_s, build_s, _per(build_s, memories),
            # answer wall time is spent on generated calls; cache hits (a resumed run) take ~0 s
            _per(retrieve_s, questions, 1000.0), _per(answer.get("wall_s"), answer["calls"]),
            write.gpu_seconds + read.gpu_seconds,
        ])
        summary_calls = summary["calls"] + summary["cached"]
        tokens_in = write.input_tokens + read.input_tokens
        tokens_out = write.output_tokens + read.output_tokens
        cost = recorded_cost(run.need_ledger())
        if cost["unpriced_models"]:
            unpriced_notes.append(f"{run.label}: Ledger USD {usd_text(cost)}")
        cost_table.rows.append([
            run.label, summary_calls, questions, judge.get("calls", 0) + judge.get("cached", 0),
            write.calls + write.cached + read.calls + read.cached, _per(summary_calls, memories),
            _per(write.input_tokens + write.output_tokens, memories, 1e-3),
            _per(answer["input_tokens"], answer["calls"]), _per(answer["output_tokens"], answer["calls"]),
            cost["usd"],
            tokens_in / 1e6 * price["input"] + tokens_out / 1e6 * price["output"],
        ])
        cached = {r: s["cached"] for r, s in run.need_ledger().get("roles", {}).items() if r != "judge" and s["cached"]}
        if cached:
            cached_notes.append(f"{run.label}: {cached} requests came from the response cache (a resumed run); "
                                "their tokens are not in the ledger, so token totals undercount")
    drift = provenance_notes(runs, ("reader.model",))  # provenance.json read once for both tables
    time_table.notes = [
        "Store + index = timings.build (encode, BM25 and dense insertion; another method's write-time work); "
        "Summaries = timings.summaries (segmentation and one LLM call per segment); Memory build = both. "
        "Retrieval ms / question = timings.retrieve / questions (one batched pass, so a mean, not a single-question "
        "latency). Answer s / question = ledger roles.answer.wall_s / answer calls generated (judge time excluded). "
        "GPU-seconds = reader wall time x GPUs held (write and read phases: summary + answer for MemFit).",
    ] + drift  # each table read alone says it
    cost_table.notes = [
        "LLM calls = the system's own calls, the ledger's write and read phases (MemFit: summary + answer; "
        "LightMem-SLM adds its MTM, consolidation, rewrite and re-rank calls); judge calls are evaluation and listed "
        "apart. Build tokens = the write phase's input + output tokens (MemFit: its summaries'). Ledger USD prices "
        "hosted models only (local vLLM = 0; - when a hosted model has no price, named below); "
        f"the last column prices this run's write and read tokens at {price_model}'s list price "
        f"(configs/prices.yaml: ${price['input']}/M in, ${price['output']}/M out), as the paper's cost figure does.",
    ] + unpriced_notes + cached_notes + drift
    return time_table, cost_table


def efficiency_methods(runs: Sequence[Run], price_model: str = "gpt-4.1-mini",
                       prices_path: str | Path | None = None) -> Table:
    """The efficiency table of every method (MemFit and the baselines), one row per run: LLM calls and
    tokens at write time and at read time, build time, per-question latency, cost (evaluate.efficiency)."""
    price = _price(price_model, prices_path)
    table = Table("efficiency_methods", "Efficiency by method: write / read LLM calls, tokens, time and cost", [
        Column("Run", "text"), Column("Method", "text"), Column("Questions", "int"), Column("Write calls", "int"),
        Column("Read calls", "int"), Column("Write input tokens", "int"), Column("Write output tokens", "int"),
        Column("Read input tokens", "int"), Column("Read output tokens", "int"), Column("Build s", "num1"),
        Column("Latency s / question", "num2"), Column("GPU-seconds", "num0"),
        Column(f"USD at {price_model} prices", "num4"),
    ])
    for run in runs:
        row = efficiency_values(run.label, run.config, run.need_ledger(), run.metrics.get("timings") or {},
                                int(run.metrics.get("questions") or 0), price)
        table.rows.append([run.label, row["method"], row["questions"], row["write_calls"], row["read_calls"],
                           row["write_input_tokens"], row["write_output_tokens"], row["read_input_tokens"],
                           row["read_output_tokens"], row["build_s"], row["latency_s_per_question"],
                           row["gpu_seconds"], row["est_usd"]])
    table.notes = [
        "Write = building memory (MemFit's summaries; LightMem-SLM's MTM notes and LTM consolidation), read = "
        "answering (the answer call; LightMem-SLM's query rewrite and re-rank): the ledger's phases "
        "(readers.types.ROLE_PHASES); the judge is evaluation and left out. Calls count generated and cached "
        "requests; tokens are the generated calls'. Build s = timings.build + timings.summaries; Latency = "
        "(timings.retrieve + the answer role's wall time) / questions, a mean over one batched pass. "
        f"USD prices the write and read tokens at {price_model}'s list price ($" + f"{price['input']}/M in, "
        f"${price['output']}/M out). Same numbers as `memfit efficiency`.",
    ] + provenance_notes(runs, ("reader.model",))
    return table


# ------------------------------------------------ what `memfit tables` (memfit_gpu/cli/tables.py) runs


def build_tables(args: argparse.Namespace) -> list[Table]:
    tests = PairedTests(args.permutations, args.seed, args.permutation_method)
    tables: list[Table] = []
    if args.locomo_main:
        tables.append(locomo_main(expand_all(args.locomo_main), args.variant))
    if args.plain_vs_memfit:
        tables.append(plain_vs_memfit(pairs_from_sweeps(args.plain_vs_memfit), tests, args.variant))
    if args.ablation:
        tables.append(ablation(expand_all(args.ablation), tests, args.ablation_baseline, args.variant))
    if args.diagnostics:
        tables.append(retrieval_diagnostics(expand_all(args.diagnostics)))
    if args.sensitivity:
        tables.append(sensitivity(expand_all(args.sensitivity), tests, args.sensitivity_baseline, args.variant))
    if args.memgallery:
        tables.append(memgallery(expand_all(args.memgallery), tests, args.variant))
    if args.longmemeval:
        tables.append(longmemeval(expand_all(args.longmemeval)))
    if args.efficiency:
        runs = expand_all(args.efficiency)
        tables += [*efficiency(runs, args.price_model, args.prices),
                   efficiency_methods(runs, args.price_model, args.prices)]
    return tables


def write_tables(tables: Sequence[Table], out: str | Path) -> list[str]:
    """OUT/<table>.md and .csv per table and OUT/tables.md with all of them; returns the files written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for table in tables:
        atomic_write_text(out / f"{table.key}.md", table.markdown())
        table.write_csv(out / f"{table.key}.csv")
        files += [str(out / f"{table.key}.md"), str(out / f"{table.key}.csv")]
    atomic_write_text(out / "tables.md", "\n".join(t.markdown() for t in tables))
    return files + [str(out / "tables.md")]
