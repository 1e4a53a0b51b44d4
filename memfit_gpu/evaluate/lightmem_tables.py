"""The LightMem-SLM paper's tables (../shared/papers/lightmem-slm-paper.txt) from finished runs and sweeps:
`memfit tables --lightmem DIR ... --out tables` (or experiments/paper_tables.py, the same program;
its options are memfit_gpu/cli/tables.py's).

Every DIR is a run directory or a sweep (`memfit sweep --out`, e.g. configs/sweeps/lightmem_locomo_*.yaml),
`LABEL=DIR` as for MemFit's tables; rows are found by their point labels (the sweep files' `name:`s):

| table | rows (labels) | numbers (metrics.json unless said) |
| --- | --- | --- |
| 2 | every label in METHOD_POINTS present | per LoCoMo category (1-5: run with data.exclude_categories=[]) F1 / BLEU-1; context tokens = ledger.json answer input tokens per generated call |
| 3 | the same | average F1, BLEU-1 and the text metrics ROUGE-L, ROUGE-2, METEOR, SBERT (`average.text`: eval.text_metrics) |
| 5 | `lightmem`, `naive_rag` | `growth.points` (eval.growth_points): F1 of the questions due at each MTM size, the difference |
| 6 | `lightmem`, `hq_noise`, `no_rerank`, `write_noise`, `cascading` | average F1 and SBERT, differences to `lightmem` |
| 7 | `lightmem`, `ltm_only`, `mtm_only`, `mtm_noise` | multi-hop (category 1) F1, difference to `lightmem` |
| 8 | seeds of `naive_rag` and `lightmem` (`<name>` and `<name>-seed<N>`) | evaluate.compare.compare_seeds: F1 mean ± std, Δ, 95 % CI, p |
| 10 | `lightmem`, `no_ltm_update` | diagnostics `method` (turns, LTM nodes and batches), config, ledger roles.consolidate, average F1 |

A table whose rows are all absent is an error naming the labels it looks for; a row absent from a table
that has others is printed as `-` and named in the table's notes. Fractions print x100 as in tables.md.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from memfit_gpu.evaluate.compare import PredictionsError, compare_seeds
from memfit_gpu.evaluate.paper_tables import (
    Column,
    Run,
    Table,
    TablesError,
    _category,
    _f1,
    answer_tokens_per_call,
    expand_all,
)
from memfit_gpu.evaluate.tables import LOCOMO_CATEGORIES

METHOD_POINTS = ("lightmem", "memfit", "plain", "naive_rag", "full_context")
FULL = "lightmem"
NOISE_POINTS = (("A", FULL, "Full LightMem"), ("B", "hq_noise", "SLM-1 50% HQ noise"),
                ("C", "no_rerank", "w/o SLM-2 reranking"), ("D", "write_noise", "SLM-3 50% write noise"),
                ("E", "cascading", "Cascading failure"))
GAP_POINTS = (("A", FULL, "Full LightMem (normal gap)"), ("B", "ltm_only", "LTM-only retrieval"),
              ("C", "mtm_only", "MTM-only retrieval"), ("D", "mtm_noise", "MTM noise saturation"))
NO_UPDATE = "no_ltm_update"
VECTOR = "naive_rag"
SEED_BASELINE = "naive_rag"
CATEGORIES = ("4", "1", "2", "3", "5")  # the paper's column order: single-hop, multi-hop, temporal, open-domain, adversarial
TEXT_NAMES = (("rouge_l", "ROUGE-L"), ("rouge_2", "ROUGE-2"), ("meteor", "METEOR"), ("sbert", "SBERT"))


def find(runs: Sequence[Run], name: str) -> Run | None:
    """The run labelled `name` (or `<sweep label>/name`), None when absent."""
    return next((r for r in runs if r.label == name or r.label.endswith("/" + name)), None)


def _rows(runs: Sequence[Run], names: Sequence[str], table: str) -> list[tuple[str, Run | None]]:
    found = [(n, find(runs, n)) for n in names]
    if not any(r for _, r in found):
        raise TablesError(f"{table}: none of the runs is labelled {', '.join(names)} "
                          f"(have: {', '.join(r.label for r in runs)})")
    return found


def _missing_note(found: Sequence[tuple[str, Run | None]]) -> list[str]:
    missing = [n for n, r in found if r is None]
    return [f"Not run: {', '.join(missing)} (shown as -)."] if missing else []


def _variant(run: Run) -> str:
    return str(run.metrics.get("metric_variant", "paper"))


def _average(run: Run | None, metric: str = "f1") -> float | None:
    return None if run is None else _f1(run.metrics.get("average"), _variant(run), metric)


def _text(run: Run | None, name: str) -> float | None:
    return None if run is None else ((run.metrics.get("average") or {}).get("text") or {}).get(name)


def _diff(value: float | None, base: float | None) -> float | None:
    return None if value is None or base is None else value - base


def table2(runs: Sequence[Run]) -> Table:
    """Table 2: F1 and BLEU-1 per LoCoMo category (adversarial included when scored), context tokens."""
    found = _rows(runs, METHOD_POINTS, "LightMem Table 2")
    columns = [Column("Method", "text"), Column("Reader", "text")]
    for cat in CATEGORIES:
        columns += [Column(f"{LOCOMO_CATEGORIES[cat]} F1"), Column(f"{LOCOMO_CATEGORIES[cat]} BLEU-1")]
    table = Table("lightmem_table2_locomo", "LightMem Table 2: LoCoMo by category, with the context length",
                  columns + [Column("Context tokens", "num0")])
    for name, run in found:
        if run is not None and run.benchmark != "locomo":
            raise TablesError(f"{run.path}: LightMem Table 2 needs LoCoMo runs, this one is {run.benchmark}")
        row: list[Any] = [name, run.reader if run else None]
        for cat in CATEGORIES:
            block = _category(run, cat) if run else None
            row += [_f1(block, _variant(run)) if run else None, _f1(block, _variant(run), "bleu1") if run else None]
        row.append(answer_tokens_per_call(run) if run else None)
        table.rows.append(row)
    table.notes = [
        "F1 / BLEU-1 x100 in each run's metric variant (eval.table_metric). Adversarial (category 5) is scored "
        "only by runs with data.exclude_categories=[] (gold: its adversarial answer; - otherwise). Context tokens: "
        "the answer prompt's input tokens per generated call (ledger.json roles.answer), the effective context the "
        "reader read.",
    ] + _missing_note(found)
    return table


def table3(runs: Sequence[Run]) -> Table:
    """Table 3: F1, BLEU-1, ROUGE-L, ROUGE-2, METEOR, SBERT per method."""
    found = _rows(runs, METHOD_POINTS, "LightMem Table 3")
    table = Table("lightmem_table3_metrics", "LightMem Table 3: answer metrics by memory mechanism",
                  [Column("Method", "text"), Column("F1"), Column("BLEU-1"), *(Column(label) for _, label in TEXT_NAMES)])
    variants = set()
    for name, run in found:
        table.rows.append([name, _average(run), _average(run, "bleu1"), *(_text(run, n) for n, _ in TEXT_NAMES)])
        if run is not None:
            variants.add(str((run.metrics.get("text_metrics") or {}).get("meteor_variant", "not scored")))
    table.notes = [
        "x100, each run's Average (LoCoMo: mean of the category means); ROUGE = rouge-score F-measure (Porter "
        "stems), METEOR = nltk's, SBERT = cosine of the run's bi-encoder embeddings (eval.text_metrics; - where a "
        f"run did not score them). METEOR variant: {', '.join(sorted(variants))}.",
    ] + _missing_note(found)
    return table


def table5(runs: Sequence[Run], system: str = FULL, vector: str = VECTOR) -> Table:
    """Table 5: F1 at each growth point, plain vector retrieval against LightMem, and the difference."""
    found = _rows(runs, (vector, system), "LightMem Table 5")
    growth = {}
    for name, run in found:
        if run is None:
            continue
        if "growth" not in run.metrics:
            raise TablesError(f"{run.path}/metrics.json: no growth analysis (run it with eval.growth_points)")
        growth[name] = {p["point"]: p for p in run.metrics["growth"]["points"]}
    points = sorted({p for g in growth.values() for p in g})
    table = Table("lightmem_table5_growth", "LightMem Table 5: stability under MTM growth (cumulative)", [
        Column("MTM size", "int"), Column("Questions", "int"), Column("Vector retrieval F1"), Column("LightMem F1"),
        Column("Δ F1", "dpct"), Column("LightMem MTM entries", "int"), Column("LightMem LTM nodes", "int")])

    def f1(name: str, p: int) -> float | None:
        entry = growth.get(name, {}).get(p)
        run = find(runs, name)
        return None if entry is None or run is None or entry.get(_variant(run)) is None else entry[_variant(run)]["f1"]

    for p in points:
        entry = growth.get(system, {}).get(p) or growth.get(vector, {}).get(p) or {}
        held = (growth.get(system, {}).get(p) or {}).get("memory") or {}
        table.rows.append([p, entry.get("questions"), f1(vector, p), f1(system, p), _diff(f1(system, p), f1(vector, p)),
                           held.get("mtm_entries"), held.get("ltm_nodes")])
    table.notes = [
        "One write of the whole trajectory, read as it stood at each point (memfit_gpu/run/growth.py): MTM size = "
        "LightMem's MTM entries per memory (its windows; both methods cut each dialogue at the same turn); the "
        "questions whose evidence lies before the point are scored, cumulatively. F1 x100, metric variant of the "
        "runs; MTM entries / LTM nodes: what LightMem held over all memories at the point.",
    ] + _missing_note(found)
    return table


def _stress(runs: Sequence[Run], points: Sequence[tuple[str, str, str]], key: str, title: str,
            values: Any, columns: list[Column], notes: list[str]) -> Table:
    found = _rows(runs, [name for _, name, _ in points], title)
    table = Table(key, title, [Column("Group", "text"), Column("Setting", "text"), *columns])
    base = find(runs, FULL)
    for (group, _, setting), (_, run) in zip(points, found, strict=True):
        table.rows.append([group, setting, *values(run, base)])
    table.notes = notes + _missing_note(found)
    return table


def table6(runs: Sequence[Run]) -> Table:
    """Table 6: error injection under the fixed top-K budget: F1 and SBERT per setting."""
    return _stress(
        runs, NOISE_POINTS, "lightmem_table6_noise", "LightMem Table 6: error injection under a fixed top-K budget",
        lambda run, base: [_average(run), _text(run, "sbert"), _diff(_average(run), _average(base))],
        [Column("F1"), Column("SBERT"), Column("Δ F1", "dpct")],
        ["x100, each run's Average. B: lightmem.noise.hq=0.5; C: lightmem.rerank=false; D: lightmem.noise.write=0.5; "
         "E: all three (methods/lightmem_noise.py says how noise is made); the same lightmem.top_k everywhere. "
         "Δ F1 to group A."])


def table7(runs: Sequence[Run]) -> Table:
    """Table 7: the update-gap stress test on the multi-hop category."""
    def values(run: Run | None, base: Run | None) -> list[Any]:
        f1 = _f1(_category(run, "1"), _variant(run)) if run else None
        base_f1 = _f1(_category(base, "1"), _variant(base)) if base else None
        return [f1, _diff(f1, base_f1), _category(run, "1")["n"] if run and _category(run, "1") else None]

    return _stress(
        runs, GAP_POINTS, "lightmem_table7_update_gap", "LightMem Table 7: update-gap stress test (LoCoMo multi-hop)",
        values, [Column("Multi-hop F1"), Column("Δ F1", "dpct"), Column("n", "int")],
        ["Multi-hop = LoCoMo category 1, F1 x100. B: lightmem.routing=ltm; C: lightmem.routing=mtm; D: "
         "lightmem.noise.mtm (MTM notes replaced at read time; LTM consolidated from the clean notes). Δ F1 to A."])


def seed_runs(runs: Sequence[Run], name: str) -> list[Run]:
    """`name` and `name-seed<N>` (any sweep label prefix), in the order given."""
    pattern = re.compile(rf"(^|/){re.escape(name)}(-seed\d+)?$")
    return [r for r in runs if pattern.search(r.label)]


def table8(runs: Sequence[Run], baseline: str = SEED_BASELINE, system: str = FULL, n_permutations: int = 10_000,
           n_boot: int = 10_000, seed: int = 0) -> Table:
    """Table 8: F1 mean ± std over seeds of the baseline and LightMem per category, Δ, 95 % CI, p."""
    side_a, side_b = seed_runs(runs, baseline), seed_runs(runs, system)
    if not side_a or not side_b:
        raise TablesError(f"LightMem Table 8: needs runs labelled {baseline}[-seedN] and {system}[-seedN] "
                          f"(have: {', '.join(r.label for r in runs)})")
    try:
        result = compare_seeds([r.path for r in side_a], [r.path for r in side_b], variant=_variant(side_b[0]),
                               n_permutations=n_permutations, n_boot=n_boot, seed=seed)
    except PredictionsError as exc:
        raise TablesError(f"LightMem Table 8: {exc}") from None
    table = Table("lightmem_table8_significance", f"LightMem Table 8: significance against {baseline} over seeds", [
        Column("Category", "text"), Column("Method", "text"), Column("Seeds", "int"), Column("F1 mean"),
        Column("F1 std"), Column("Δ F1", "dpct"), Column("CI low", "dpct"), Column("CI high", "dpct"),
        Column("p-value", "p")])
    scopes = [(r["name"], r) for r in result["by_category"].values()] + [("Average", result["category_mean"])]
    for label, r in scopes:
        table.rows.append([label, baseline, len(side_a), r["a"]["mean"], r["a"]["std"], None, None, None, None])
        table.rows.append([label, system, len(side_b), r["b"]["mean"], r["b"]["std"], r["diff"], *r["ci95"],
                           r["p_value"]])
    table.notes = [
        f"F1 x100 ({result['metric']}), mean and std (ddof 1) over each system's seed runs ({', '.join(r.label for r in side_a)}"
        f" | {', '.join(r.label for r in side_b)}); Δ = {system} - {baseline}; 95 % CI: percentile bootstrap over "
        f"questions ({n_boot} resamples) of each question's seed-averaged F1 difference; p: paired sign-flip "
        f"permutation test ({n_permutations}, seed {seed}) on the same values (evaluate/compare.py compare_seeds, "
        "also `memfit compare --seeds`). Average = mean of the category means.",
    ]
    return table


def table10(runs: Sequence[Run]) -> Table:
    """Table 10: consolidation interval, node growth per turn, offline time per batch, F1 with / without
    LTM updates."""
    full, none = find(runs, FULL), find(runs, NO_UPDATE)
    if full is None:
        raise TablesError(f"LightMem Table 10: needs the run labelled {FULL} (have: {', '.join(r.label for r in runs)})")
    held = (full.metrics.get("retrieval") or {}).get("method") or {}
    lightmem = full.config.get("lightmem") or {}
    turns, nodes, batches = held.get("turns"), held.get("ltm_nodes"), held.get("ltm_batches")
    consolidate = (full.need_ledger().get("roles") or {}).get("consolidate") or {}
    window, every = lightmem.get("mtm_window_turns"), lightmem.get("consolidate_every")
    f1_full, f1_none = _average(full), _average(none)

    def per(a: Any, b: Any, fmt: str) -> str:
        return "-" if not a or not b else fmt.format(a / b)

    table = Table("lightmem_table10_ltm", "LightMem Table 10: LTM update frequency, consolidation cost, ablation",
                  [Column("Metric", "text"), Column("Value", "text"), Column("How it is measured", "text")])
    table.rows = [
        ["Batch update interval", f"every {window * every if window and every else '-'} turns "
         f"(measured: {per(turns, batches, '{:.1f}')} turns / batch)",
         "lightmem.consolidate_every x lightmem.mtm_window_turns; measured = turns / LTM batches written"],
        ["Node growth rate", f"1 node / {per(turns, nodes, '{:.1f}')} turns",
         f"turns ({turns}) / LTM nodes ({nodes}) over all memories (diagnostics.json method)"],
        ["Offline processing time", f"{per(consolidate.get('wall_s'), consolidate.get('calls'), '{:.2f}')} s / batch",
         "ledger.json roles.consolidate wall_s / calls (batched calls share their batch's wall time)"],
        ["Reasoning accuracy (F1)",
         f"{'-' if f1_full is None else f'{100 * f1_full:.2f}'} (full) vs "
         f"{'-' if f1_none is None else f'{100 * f1_none:.2f}'} (no update)",
         f"Average F1 x100 of `{FULL}` and `{NO_UPDATE}` (lightmem.ltm_updates=false)"],
    ]
    table.notes = [] if none is not None else [f"Not run: {NO_UPDATE} (shown as -)."]
    return table


def build(runs: Sequence[Run], seed_runs_: Sequence[Run] | None = None, baseline: str = SEED_BASELINE,
          n_permutations: int = 10_000, n_boot: int = 10_000, seed: int = 0) -> list[Table]:
    """Every LightMem table, in the paper's order; Table 8 from `seed_runs_` when given, else from `runs`."""
    return [table2(runs), table3(runs), table5(runs), table6(runs), table7(runs),
            table8(runs if seed_runs_ is None else seed_runs_, baseline=baseline, n_permutations=n_permutations,
                   n_boot=n_boot, seed=seed),
            table10(runs)]


# ------------------------------------------------------------------ what `memfit tables --lightmem` runs
def build_tables(args: Any) -> list[Table]:
    if not args.lightmem:
        return []
    seeds = expand_all(args.lightmem_seeds) if args.lightmem_seeds else None
    return build(expand_all(args.lightmem), seeds, args.lightmem_seed_baseline, n_permutations=args.permutations,
                 seed=args.seed)
