"""The plan as the console prints it (the one renderer, memfit_gpu/render.py)."""

from __future__ import annotations

from memfit_gpu.plan.build import Plan, _gib, _span
from memfit_gpu.plan.sizes import GIB
from memfit_gpu.render import console_table


def render(plan: Plan) -> str:
    """The plan as a table: a row per part (where, host GiB, GPU GiB per device), per-GPU totals against
    their memory, host total against RAM, and the verdict."""
    gpus = [g.index for g in plan.node.gpus]
    lines = [f"memfit plan{': ' + plan.config if plan.config else ''}",
             f"node:      {plan.node.describe()}",
             f"workload:  {plan.workload.describe()}"]
    for role, groups in plan.engine_gpus.items():
        lines.append(f"engines:   vLLM {role}: {len(groups)} engine(s) on {' | '.join(_span(g) for g in groups)}")
    lines.append(f"retrieval: index.device -> {plan.retrieval_spec}")
    lines.extend(f"note:      {n}" for n in plan.notes)
    lines.append("")
    rows = []
    for p in plan.parts:
        cells = [p.name, p.where, _gib(p.host + p.host_peak, p.unknown)]
        for g in gpus:
            value = p.gpu.get(g, 0) + p.gpu_peak.get(g, 0) + p.claim.get(g, 0)
            cells.append(_gib(value, p.unknown) if g in p.gpu or g in p.gpu_peak or g in p.claim else "-")
        rows.append([*cells, p.note])
    lines.append(console_table(["part", "where", "host GiB", *(f"cuda:{g}" for g in gpus), "note"], rows,
                               ["left", "left", "right", *(["right"] * len(gpus)), "left"]))
    lines.append("")
    if plan.gpu_checked:
        for t in plan.gpu_totals():
            lines.append(f"cuda:{t.gpu.index}: memfit {t.resident / GIB:6.1f} + peak {t.peak / GIB:5.1f} + engine claims "
                         f"{t.claims / GIB:6.1f} = {t.total / GIB:6.1f} of {t.gpu.total_bytes / GIB:.1f} GiB  "
                         f"{'ok' if t.fits else 'DOES NOT FIT'}")
    else:
        lines.append("GPUs: none on the node: GPU check skipped")
    resident, peak = plan.host_total()
    total = resident + peak
    lines.append(f"host:   resident {resident / GIB:6.1f} + peak {peak / GIB:5.1f} = {total / GIB:6.1f} of "
                 f"{plan.node.host_bytes / GIB:.1f} GiB  {'ok' if total <= plan.node.host_bytes else 'DOES NOT FIT'}")
    if plan.unknown:
        lines.append(f"WARNING: UNKNOWN sizes, not counted: {', '.join(plan.unknown)}")
    if plan.fits:
        lines.append("verdict: fits")
    else:
        lines.append("verdict: DOES NOT FIT")
        lines.extend(f"  - {p.message}" for p in plan.problems)
    return "\n".join(lines)
