"""The report's figures as inline SVG (matplotlib's SVG backend, no pyplot): text stays text (svg.fonttype
none: searchable, small, no font file to fetch), ids are salted per figure (several SVGs share one HTML page)
and no date is written, so the same runs give the same bytes.

Every function takes plain values (what report/build.py read from the run directories) and returns the
`<svg>` element as a string, or None when there is nothing to draw.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

# One colour per outcome (evaluate/attribution.py OUTCOMES), alike in every figure and in the page's legend.
OUTCOME_COLOURS = {"correct": "#4c9a2a", "not_retrieved": "#c0392b", "cut_from_pack": "#e67e22",
                   "reader_missed": "#2e86c1", "no_evidence": "#95a5a6"}
RUN_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def run_colour(index: int) -> str:
    return RUN_COLOURS[index % len(RUN_COLOURS)]


def _svg(name: str, draw: Callable[[Any], None], size: tuple[float, float]) -> str:
    # matplotlib is imported here, by the report alone (~0.3 s): every other command that imports this package's
    # layer stays free of it; the Figure API needs no backend to be selected, so nothing global changes
    import matplotlib
    from matplotlib.figure import Figure

    # text.parse_math off: labels are run directory names, and one holding a `$` pair (`r$x$`) was drawn as TeX
    # math or, unparsable (`r$\foo{$`), stopped the report with a mathtext traceback
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": f"memfit-report-{name}",
                                "font.size": 9, "axes.spines.top": False, "axes.spines.right": False,
                                "text.parse_math": False}):
        figure = Figure(figsize=size, layout="constrained")
        draw(figure)
        buffer = io.StringIO()
        figure.savefig(buffer, format="svg", metadata={"Date": None})
    text = buffer.getvalue()
    # inline in HTML: no XML declaration or DOCTYPE (its DTD address is never fetched, but it has no place there)
    text = text[text.index("<svg"):]
    return re.sub(r"\s*<metadata>.*?</metadata>", "", text, flags=re.S)


def category_scores(categories: Sequence[str], labels: Sequence[str], runs: Sequence[str],
                    panels: Mapping[str, Sequence[Sequence[float | None]]]) -> str:
    """Grouped bars: per category one bar per run, one panel per score (e.g. "F1 (paper)" -> [run][category])."""

    def draw(figure: Any) -> None:
        axes = figure.subplots(1, len(panels), squeeze=False)[0]
        width = 0.8 / max(1, len(runs))
        for ax, (title, values) in zip(axes, panels.items(), strict=True):
            for r, run in enumerate(runs):
                xs = [c + (r - (len(runs) - 1) / 2) * width for c in range(len(categories))]
                ys = [100.0 * v if v is not None else 0.0 for v in values[r]]
                ax.bar(xs, ys, width, label=run, color=run_colour(r))
            ax.set_xticks(range(len(categories)), labels, rotation=20, ha="right")
            ax.set_ylabel(f"{title} x100")
            ax.set_title(title)
        axes[0].legend(fontsize=8, frameon=False)

    return _svg("scores", draw, (3.2 + 0.9 * len(categories) * len(panels), 3.2))


def attribution_bars(categories: Sequence[str], labels: Sequence[str], runs: Sequence[str],
                     counts: Sequence[Mapping[str, Mapping[str, int]]], outcomes: Mapping[str, str]) -> str:
    """Stacked bars of the outcome counts per category, one panel per run."""

    def draw(figure: Any) -> None:
        axes = figure.subplots(1, len(runs), squeeze=False, sharey=True)[0]
        for ax, run, per in zip(axes, runs, counts, strict=True):
            bottom = [0] * len(categories)
            for outcome, name in outcomes.items():
                heights = [(per.get(c) or {}).get(outcome, 0) for c in categories]
                ax.bar(range(len(categories)), heights, 0.7, bottom=bottom, label=name, color=OUTCOME_COLOURS[outcome])
                bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
            ax.set_xticks(range(len(categories)), labels, rotation=20, ha="right")
            ax.set_title(run)
            ax.yaxis.get_major_locator().set_params(integer=True)  # counts of questions
        axes[0].set_ylabel("questions")
        axes[-1].legend(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))

    return _svg("attribution", draw, (2.2 + 2.6 * len(runs) + 0.25 * len(categories) * len(runs), 3.2))


def _pareto(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats (less cost and at least the accuracy, or the same cost and more), by cost."""
    best: list[tuple[float, float]] = []
    for x, y in sorted(points, key=lambda p: (p[0], -p[1])):
        if not best or y > best[-1][1]:
            best.append((x, y))
    return best


def frontier(runs: Sequence[str], accuracy: Sequence[float | None], accuracy_label: str,
             axes_values: Mapping[str, Sequence[float | None]]) -> str | None:
    """Accuracy against each cost (e.g. tokens / question, latency s / question), the runs as labelled points and
    the frontier of the runs no other beats on both."""
    panels = {name: [(x, y, run, i) for i, (run, x, y) in enumerate(zip(runs, values, accuracy, strict=True))
                     if x is not None and y is not None] for name, values in axes_values.items()}
    panels = {name: points for name, points in panels.items() if points}
    if not panels:
        return None

    def draw(figure: Any) -> None:
        axes = figure.subplots(1, len(panels), squeeze=False)[0]
        for ax, (name, points) in zip(axes, panels.items(), strict=True):
            for x, y, run, i in points:
                ax.scatter([x], [100.0 * y], color=run_colour(i), zorder=3)
                ax.annotate(run, (x, 100.0 * y), textcoords="offset points", xytext=(4, 4), fontsize=8)
            line = _pareto([(x, y) for x, y, _, _ in points])
            ax.plot([x for x, _ in line], [100.0 * y for _, y in line], color="#555555", linestyle="--", linewidth=1,
                    zorder=2, label="frontier")
            ax.set_xlabel(name)
            ax.set_ylabel(f"{accuracy_label} x100")
            ax.margins(0.2)
        axes[0].legend(fontsize=8, frameon=False)

    return _svg("frontier", draw, (3.6 * len(panels), 3.0))


def depths(series: Sequence[tuple[str, int, Sequence[int], Sequence[float | None], Sequence[float]]],
           accuracy_label: str) -> str | None:
    """Per run with pack depths (label, colour index, k's, accuracy, input tokens / question): accuracy and prompt
    tokens against k (the paper's Table 10 as two curves)."""
    if not series:
        return None

    def draw(figure: Any) -> None:
        left, right = figure.subplots(1, 2, squeeze=True)
        for label, colour, ks, accuracy, tokens in series:
            left.plot(ks, [100.0 * a if a is not None else float("nan") for a in accuracy], marker="o",
                      color=run_colour(colour), label=label)
            right.plot(ks, tokens, marker="o", color=run_colour(colour), label=label)
        left.set_xlabel("pack depth k")
        left.set_ylabel(f"{accuracy_label} x100")
        right.set_xlabel("pack depth k")
        right.set_ylabel("answer prompt tokens / question")
        left.legend(fontsize=8, frameon=False)

    return _svg("depths", draw, (7.2, 3.0))


def latency(table: Sequence[Mapping[str, Any]], concurrency: Sequence[Mapping[str, Any]]) -> str | None:
    """bench_online.py's latency percentiles: per kind of call (insert, retrieval, end to end) P50 / P95 / P99 per
    method and path; with its concurrency levels, the batched and one-at-a-time servers' P95 against clients."""
    kinds = [k for k in ("insert", "retrieval", "e2e")
             if any(row.get(f"{k}_p50_ms") is not None for row in table)]
    if not kinds and not concurrency:
        return None
    rows = [row for row in table if any(row.get(f"{k}_p50_ms") is not None for k in kinds)]
    names = {"insert": "insert", "retrieval": "search", "e2e": "end to end (answer)"}

    def draw(figure: Any) -> None:
        axes = list(figure.subplots(1, len(kinds) + bool(concurrency), squeeze=False)[0])
        for ax, kind in zip(axes, kinds, strict=False):
            shown = [row for row in rows if row.get(f"{kind}_p50_ms") is not None]
            for p, (pct, shade) in enumerate((("p50", 0.35), ("p95", 0.65), ("p99", 1.0))):
                xs = [i + (p - 1) * 0.27 for i in range(len(shown))]
                ax.bar(xs, [row[f"{kind}_{pct}_ms"] for row in shown], 0.27, label=pct.upper(), color="#1f77b4",
                       alpha=shade)
            ax.set_xticks(range(len(shown)), [f"{row['method']}\n{row['path']}" for row in shown], fontsize=7)
            ax.set_title(names[kind])
            ax.set_ylabel("ms")
        if kinds:
            axes[0].legend(fontsize=8, frameon=False)
        if concurrency:
            ax = axes[-1]
            clients = [level["clients"] for level in concurrency]
            for key, colour in (("batched", "#1f77b4"), ("unbatched", "#ff7f0e")):
                ys = [(level.get(key) or {}).get("p95_ms") for level in concurrency]
                ax.plot(clients, [y if y is not None else float("nan") for y in ys], marker="o", color=colour,
                        label=f"{key} P95")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent clients")
            ax.set_ylabel("search P95 ms")
            ax.set_title("HTTP, concurrent searches")
            ax.legend(fontsize=8, frameon=False)

    return _svg("latency", draw, (2.6 + 2.8 * (len(kinds) + bool(concurrency)), 3.0))
