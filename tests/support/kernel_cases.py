"""Every Triton kernel against its torch reference, run by tests/kernels/test_kernels.py in a fresh process under
TRITON_INTERPRET=1 (the interpreter is chosen when a kernel module is first imported, so the parent
pytest process cannot switch it on for itself). Not collected by pytest (no test_ prefix).

    TRITON_INTERPRET=1 python tests/support/kernel_cases.py [case ...]   -> one JSON line: {case: {"ok", "checked", "detail"}}

Random ragged batches with the edge cases the kernels must handle: empty memories, one-episode memories,
questions with no known term, all-tied scores, k larger than the candidates. "ok" means bit-identical
results; "checked" counts what was compared, so a case that compared nothing cannot pass.

The kernel cases (KERNEL_CASES, WIDE_CASES) also take `device` and `repeats`: the inputs are built on the
CPU, the torch reference runs there, and the Triton kernel runs `repeats` times on `device`, every run
compared bit for bit with the reference. experiments/gpu_check.py runs them compiled on a GPU, 10 runs
each: KERNEL_CASES launch no variant above K_PAD 64 (what the read path launches), WIDE_CASES compile
K_PAD 128 in the check's optional last stage.
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

import memfit_gpu.index.bm25 as bm25_module
from memfit_gpu.config import BoostConfig, load_config
from memfit_gpu.index.bm25 import BM25Index
from memfit_gpu.index.bm25_postings import _on_grid
from memfit_gpu.index.dense import DenseIndex
from memfit_gpu.index.tokenize import tokenize
from memfit_gpu.kernels.hybrid_topk import BoostInputs, hybrid_topk_triton
from memfit_gpu.kernels.segment_topk import segment_topk_kernel, segment_topk_torch, segment_topk_triton
from memfit_gpu.kernels.segmented_scatter import segmented_scatter_add_torch, segmented_scatter_add_triton
from memfit_gpu.retrieve.boosts import add_boosts
from memfit_gpu.retrieve.hybrid import fuse

REPO = Path(__file__).resolve().parents[2]
LOCOMO = REPO.parent / "shared" / "data" / "locomo" / "locomo10.json"
HITS = ("rows", "bm25", "dense", "fused", "boost", "score")


def _csr(rng: torch.Generator, n_terms: int, width: int, max_len: int) -> tuple[torch.Tensor, ...]:
    lengths = torch.randint(0, max_len + 1, (n_terms,), generator=rng)
    lengths[:3] = torch.tensor([0, 1, width])  # an empty run, a single posting, a run over every column
    lengths = lengths.clamp(max=width)
    cols = torch.cat([torch.randperm(width, generator=rng)[: int(n)] for n in lengths]).to(torch.int32)
    term_ptr = torch.zeros(n_terms + 1, dtype=torch.long)
    term_ptr[1:] = torch.cumsum(lengths, 0)
    # BM25-like weights on the index's grid: a wide range of magnitudes, exact float64 sums
    magnitude = 2.0 ** torch.randint(-14, 5, (cols.numel(),), generator=rng).float()
    weights = _on_grid(torch.rand(cols.numel(), generator=rng) * magnitude)
    return term_ptr, cols, weights


def case_scatter(device: str = "cpu", repeats: int = 1) -> dict:
    """Ragged per-question segments (some empty) and padded rows; pairs permuted; bits equal."""
    rng = torch.Generator().manual_seed(0)
    term_ptr, cols, weights = _csr(rng, 30, 200, 260)
    on = _mover(device)
    checked, ok = 0, True
    for layout in ("padded", "ragged"):
        n_q = 11
        docs = torch.full((n_q,), 200) if layout == "padded" else torch.randint(0, 201, (n_q,), generator=rng)
        docs[0] = 0
        seg = torch.zeros(n_q + 1, dtype=torch.long)
        seg[1:] = torch.cumsum(docs, 0)
        n_pairs = 150
        pair_q = torch.randint(1, n_q, (n_pairs,), generator=rng)
        pair_t = torch.randint(0, 30, (n_pairs,), generator=rng)
        pair_t[:5] = 0  # pairs on an empty posting run
        # a column past a ragged segment would spill into the next: keep each pair's term inside its segment
        keep = torch.tensor([bool((cols[term_ptr[t]: term_ptr[t + 1]] < docs[q]).all()) for q, t in
                             zip(pair_q.tolist(), pair_t.tolist(), strict=True)])
        pair_q, pair_t = pair_q[keep], pair_t[keep]
        base = seg[pair_q]
        ref = segmented_scatter_add_torch(torch.zeros(int(seg[-1]), dtype=torch.float64), base, pair_t, term_ptr,
                                          cols, weights)
        perm = torch.randperm(pair_q.numel(), generator=rng)
        for _ in range(repeats):
            got = segmented_scatter_add_triton(*on(torch.zeros(int(seg[-1]), dtype=torch.float64), base, pair_t,
                                                   term_ptr, cols, weights))
            shuffled = segmented_scatter_add_triton(*on(torch.zeros(int(seg[-1]), dtype=torch.float64), base[perm],
                                                        pair_t[perm], term_ptr, cols, weights))
            ok &= torch.equal(ref, got.cpu()) and torch.equal(ref, shuffled.cpu())
        checked += int((ref != 0).sum())
    return {"ok": bool(ok), "checked": checked, "detail": f"{checked} nonzero sums compared"}


def _topk_inputs() -> tuple[torch.Tensor, ...]:
    rng = torch.Generator().manual_seed(1)
    lengths = [0, 1, 7, 64, 65, 300, 0, 130, 2]
    seg = torch.zeros(len(lengths) + 1, dtype=torch.long)
    seg[1:] = torch.cumsum(torch.tensor(lengths), 0)
    acc = (torch.rand(int(seg[-1]), generator=rng, dtype=torch.float64) * 8).floor_() / 4  # many ties
    acc[torch.rand(acc.numel(), generator=rng) < 0.2] = 0.0  # no-hit documents
    acc[int(seg[3]): int(seg[4])] = 1.5  # a segment of 64 tied scores
    acc[int(seg[7]): int(seg[8])] = 0.0  # a segment with no hit at all
    row_start = torch.tensor([0, 5, 9, 100, 200, 300, 700, 800, 1000])
    rows = torch.arange(2000) * 3 + 1
    return acc, seg, row_start, rows


def _topk_compare(run, ks: tuple[int, ...], device: str, repeats: int) -> tuple[bool, int]:
    acc, seg, row_start, rows = _topk_inputs()
    checked, ok = 0, True
    on = _mover(device)
    for k in ks:
        ref = segment_topk_torch(acc, seg, row_start, rows, k)
        for _ in range(repeats):
            got = run(*on(acc, seg, row_start, rows), k)
            ok &= torch.equal(ref[0], got[0].cpu()) and torch.equal(ref[1], got[1].cpu())
        checked += int((ref[1] >= 0).sum())
    return ok, checked


def case_topk(device: str = "cpu", repeats: int = 1) -> dict:
    """Segments: empty, one document, all tied, longer than a block; k = 1 .. 64 through the kernel
    (K_PAD 16 and 64), and k = 65 and 301 through the Triton path, which routes k > TRITON_MAX_K to
    the torch reference (so no K_PAD above 64 is ever compiled here)."""
    ok, checked = _topk_compare(segment_topk_triton, (1, 3, 17, 33, 64), device, repeats)
    routed_ok, routed = _topk_compare(segment_topk_triton, (65, 301), device, 1)
    return {"ok": bool(ok and routed_ok), "checked": checked,
            "detail": f"{checked} selected rows compared (kernel, k <= 64); {routed} more at k = 65, 301 (routed)"}


def case_topk_wide(device: str = "cpu", repeats: int = 1) -> dict:
    """The kernel itself above TRITON_MAX_K (K_PAD 128: k = 65, 100, 128), which the read path never
    launches: only the GPU check's optional last stage compiles it."""
    ok, checked = _topk_compare(segment_topk_kernel, (65, 100, 128), device, repeats)
    return {"ok": bool(ok), "checked": checked, "detail": f"{checked} selected rows compared (K_PAD 128)"}


def _mover(device: str):
    """Tensors -> the same tensors on `device` (the kernels' side; the references stay on the CPU)."""
    target = torch.device(device)

    def on(*tensors: torch.Tensor) -> list[torch.Tensor]:
        return [t.to(target) for t in tensors]

    return on


def _bm25_corpus(seed: int) -> tuple[BM25Index, list[list[str]], list[int]]:
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(40)]
    docs, mems = [], []
    for mem, size in enumerate([0, 1, 5, 40, 250, 3, 90]):  # memory 0 stays empty
        for _ in range(size):
            docs.append([rng.choice(words[: 10 + 3 * mem]) for _ in range(rng.randint(0, 12))])
            mems.append(mem)
    docs += [["same", "tied", "words"]] * 6  # memory 7: six identical documents, all tied
    mems += [7] * 6
    docs += [["gone"], ["gone", "soon"]]  # memory 8: every row deleted
    mems += [8, 8]
    index = BM25Index()
    index.add(docs, mems)
    index.delete([len(docs) - 2, len(docs) - 1, 12, 60])
    return index, words, [m for m in range(10)]


def case_bm25_search(device: str = "cpu", repeats: int = 1) -> dict:
    """BM25Index.search / search_encoded with kernels=triton (on `device`) against kernels=torch (on the
    CPU), bit for bit."""
    rng = random.Random(2)
    index, words, memories = _bm25_corpus(2)
    on_device = _bm25_corpus(2)[0].to(device)
    queries, mems = [], []
    for _ in range(90):
        mem = rng.choice(memories)  # 9 was never added
        queries.append([rng.choice(words + ["unknown"]) for _ in range(rng.randint(0, 6))])
        mems.append(mem)
    queries += [["tied"], ["same", "tied"], ["zebra"], [], ["gone"], ["w1", "w1", "w1"]]
    mems += [7, 7, 4, 3, 8, 6]
    checked, ok = 0, True

    def same(ref: tuple[torch.Tensor, ...], got: tuple[torch.Tensor, ...]) -> bool:
        return torch.equal(ref[0], got[0].cpu()) and torch.equal(ref[1], got[1].cpu())

    for k in (1, 4, 60, 400):
        ref = index.search(queries, mems, k, kernels="torch")
        for _ in range(repeats):
            ok &= same(ref, on_device.search(queries, mems, k, kernels="triton"))
        checked += int((ref[1] >= 0).sum())
    # chunked launches (a few questions per chunk) give the same
    ragged_elements = bm25_module._RAGGED_ELEMENTS
    bm25_module._RAGGED_ELEMENTS = 300
    try:
        got = on_device.search(queries, mems, 60, kernels="triton")
    finally:
        bm25_module._RAGGED_ELEMENTS = ragged_elements
    ref = index.search(queries, mems, 60, kernels="torch")
    ok &= same(ref, got)
    # the PRF form: encoded (query, term) pairs
    rows = ref[1][:, :2]
    pair_q, pair_t = index.feedback_terms(rows, 1, 5, "idf")
    encoded = index.search_encoded(pair_q, pair_t, mems, 30, kernels="torch")
    for _ in range(repeats):
        ok &= same(encoded, on_device.search_encoded(pair_q, pair_t, mems, 30, kernels="triton"))
    tied = got[1][len(queries) - 6].tolist()
    return {"ok": bool(ok), "checked": checked, "detail": f"{checked} hits compared; tied rows {tied[:6]}"}


def _lists(rng: torch.Generator, n_q: int, k: int, n_rows: int, tie: float | None) -> tuple[torch.Tensor, ...]:
    rows = torch.full((n_q, k), -1, dtype=torch.long)
    scores = torch.zeros((n_q, k))
    for q in range(n_q):
        n = [0, 1, k][q] if q < 3 else int(torch.randint(0, k + 1, (1,), generator=rng))
        picked = torch.randperm(n_rows, generator=rng)[:n]
        vals = torch.full((n,), tie) if tie is not None else (torch.rand(n, generator=rng) * 4).floor() / 4 + 0.25
        vals, order = vals.sort(descending=True, stable=True)
        rows[q, :n], scores[q, :n] = picked[order], vals
    return scores, rows


def case_hybrid(device: str = "cpu", repeats: int = 1) -> dict:
    """hybrid_topk against fuse -> add_boosts -> ranked -> head: random ragged lists, ties, boosts."""
    rng = torch.Generator().manual_seed(3)
    np_rng = np.random.default_rng(3)
    n_q, n_rows = 14, 50
    checked, ok, failures = 0, True, []
    on = _mover(device)
    for kb, kd, tie_b, tie_d in ((8, 8, None, None), (12, 5, 0.5, None), (5, 9, 0.5, 0.5), (1, 1, None, None)):
        b_scores, b_rows = _lists(rng, n_q, kb, n_rows, tie_b)
        d_scores, d_rows = _lists(rng, n_q, kd, n_rows, tie_d)
        d_rows[5, :2] = b_rows[5, :2]  # rows found by both lists
        cfg = BoostConfig()
        bits = torch.randint(0, 4, (n_q,), generator=rng)
        years = torch.randint(2021, 2024, (n_q, 2), generator=rng)
        years[0] = -1
        months = torch.randint(1, 4, (n_q, 1), generator=rng)
        row_meta = [np_rng.integers(0, 4, n_rows), np_rng.integers(2021, 2024, n_rows), np_rng.integers(1, 4, n_rows)]
        # (alpha, boosts, empty row metadata, k, row order): the read path's uses and the edges
        combos = [(0.7, True, False, None, False), (0.7, True, False, 3, False), (0.7, False, False, None, True),
                  (0.7, False, False, None, False), (0.0, True, True, kb + kd + 5, False), (1.0, True, False, 1, False)]
        for alpha, boosted, empty_meta, k, by_row in combos:
            base = fuse(b_scores, b_rows, d_scores, d_rows, alpha)
            meta = [np.zeros(0, dtype=np.int64)] * 3 if empty_meta else row_meta
            ref = add_boosts(base, cfg, bits, years, months, *meta) if boosted else base
            inputs = BoostInputs(cfg.speaker, cfg.month, cfg.year, *on(bits, years, months,
                                                                       *(torch.from_numpy(a) for a in meta))
                                 ) if boosted else None
            ref = ref if by_row else ref.ranked()
            ref = ref if k is None else ref.head(k)
            same = True
            for _ in range(repeats):
                got = hybrid_topk_triton(*on(b_scores, b_rows, d_scores, d_rows), alpha, k=k, by_row=by_row,
                                         boosts=inputs)
                same &= all(torch.equal(g.cpu(), getattr(ref, name)) for g, name in zip(got, HITS, strict=True))
            if not same:
                failures.append((kb, kd, alpha, boosted, empty_meta, k, by_row))
            ok &= same
            checked += int((ref.rows >= 0).sum())
    return {"ok": bool(ok), "checked": checked, "detail": f"{checked} candidates compared; failures {failures[:3]}"}


def _view_with_summaries(n_questions: int):
    """conv-26 of LoCoMo with seeded random unit embeddings (no encoder) and a summary layer made of
    consecutive 6-turn windows, so every stage (episodes, summaries, expansions, PRF) runs."""
    from memfit_gpu.data import load_benchmark, select_questions
    from memfit_gpu.retrieve.view import ReadView

    cfg = load_config(REPO / "configs" / "memfit.yaml", ["rerank.backend=none", "index.device=cpu"])
    bench = select_questions(load_benchmark("locomo", LOCOMO), exclude_categories=["5"], limit_memories=1)
    memory = bench.memories[0]
    n_turns = len(memory.turns())
    rng = np.random.default_rng(0)

    def unit(rows: int) -> torch.Tensor:
        v = rng.standard_normal((rows, 384)).astype(np.float32)
        return torch.from_numpy(v / np.linalg.norm(v, axis=1, keepdims=True))

    view = ReadView.from_memories([memory], None, cfg, embeddings=unit(n_turns))
    members = [list(range(i, min(i + 6, n_turns))) for i in range(0, n_turns, 6)]
    texts = [" ".join(view.ep_text[m] for m in ms) for ms in members]
    sm_bm25 = BM25Index()
    sm_bm25.add([tokenize(t) for t in texts], [0] * len(texts))
    sm_dense = DenseIndex(dim=384, device="cpu")
    sm_dense.add(unit(len(texts)), [0] * len(texts))
    view = replace(view, sm_memory=np.zeros(len(texts), dtype=np.int64), sm_text=texts, sm_members=members,
                   sm_time=view.ep_time[[m[0] for m in members]], sm_recorded=view.ep_time[[m[-1] for m in members]],
                   sm_bm25=sm_bm25, sm_dense=sm_dense)
    questions = [q for q in memory.questions if q.evaluated][:n_questions]
    cache: dict[str, torch.Tensor] = {}

    def embed(texts: list[str]) -> torch.Tensor:  # seeded per text: the same vector in both runs
        for t in texts:
            if t not in cache:
                cache[t] = unit(1)[0]
        return torch.stack([cache[t] for t in texts])

    return view, cfg, [q.question for q in questions], [q.memory_id for q in questions], embed


def case_retrieve_batch() -> dict:
    """retrieve_batch with retrieve.kernels=triton against torch: same packs, rankings, scores, excerpts."""
    from memfit_gpu.retrieve.batched import retrieve_batch

    view, cfg, texts, mems, embed = _view_with_summaries(24)
    q_emb = embed(texts)
    checked, ok, details = 0, True, []
    for overrides in ([], ["retrieve.boosts.speaker_match=mention", "retrieve.prf.term_order=alphabetical",
                           "retrieve.boosts.summaries=true"],
                      ["retrieve.boosts_enabled=false", "retrieve.scan_top_k=7", "retrieve.summary_top_k=3"]):
        runs = {}
        for kernels in ("torch", "triton"):
            run_cfg = load_config(REPO / "configs" / "memfit.yaml", ["rerank.backend=none", f"retrieve.kernels={kernels}",
                                                                     *overrides])
            runs[kernels] = retrieve_batch(view, run_cfg, texts, mems, embed=embed, question_embeddings=q_emb)
        for a, b in zip(runs["torch"], runs["triton"], strict=True):
            same = (a.pack_key() == b.pack_key() and a.ranked == b.ranked and a.prf_terms == b.prf_terms
                    and a.excerpts == b.excerpts)
            ok &= same
            checked += len(a.ranked)
        details.append(sum(r.pack_key() == s.pack_key() for r, s in zip(runs["torch"], runs["triton"], strict=True)))
        sources = {c["source"] for r in runs["triton"] for c in r.ranked}
        kinds = {c["kind"] for r in runs["triton"] for c in r.ranked}
        ok &= {"pool", "prf"} <= sources and (kinds == {"episode", "summary"} or "retrieve.summary_top_k=3" in overrides)
    return {"ok": bool(ok), "checked": checked, "detail": f"identical packs per config {details}"}


def case_cli() -> dict:
    """`memfit retrieve ... retrieve.kernels=triton` against `=torch`: identical packs.jsonl rows."""
    import tempfile

    from memfit_gpu.cli import main as memfit

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kernels in ("torch", "triton"):
            out = Path(tmp) / kernels
            rc = memfit(["retrieve", "--config", str(REPO / "configs" / "memfit.yaml"), "--benchmark", "locomo",
                         "--data", str(LOCOMO), "--out", str(out), "--limit-memories", "1", "--limit-questions", "12",
                         "rerank.backend=none", f"retrieve.kernels={kernels}"])
            if rc != 0:
                return {"ok": False, "checked": 0, "detail": f"memfit retrieve exited {rc}"}
            rows[kernels] = [json.loads(line) for line in (out / "packs.jsonl").read_text().splitlines()]
            used = json.loads((out / "diagnostics.json").read_text())["config"]["retrieve"]["kernels"]
            if used != kernels:
                return {"ok": False, "checked": 0, "detail": f"diagnostics record retrieve.kernels={used}"}
    ok = rows["torch"] == rows["triton"]
    return {"ok": ok, "checked": sum(len(r["ranked"]) for r in rows["torch"]), "detail": f"{len(rows['torch'])} rows"}


def case_profile() -> dict:
    """The profiler's scaling sweep takes the Triton path when asked, and records which path ran."""
    from memfit_gpu.run.profile import scaling_sweep

    got = {}
    for kernels in ("torch", "triton"):
        cfg = load_config(REPO / "configs" / "memfit.yaml", [f"retrieve.kernels={kernels}", "index.device=cpu"])
        got[kernels] = [row["kernels"] for row in scaling_sweep(cfg, (300,), 4, progress=False)]
    return {"ok": got == {"torch": ["torch"], "triton": ["triton"]}, "checked": 2, "detail": str(got)}


KERNEL_CASES = ("scatter", "topk", "bm25_search", "hybrid")  # take (device, repeats); K_PAD <= 64 only
WIDE_CASES = ("topk_wide",)  # take (device, repeats); K_PAD 128, the GPU check's optional last stage
CASES = {"scatter": case_scatter, "topk": case_topk, "bm25_search": case_bm25_search, "hybrid": case_hybrid,
         "topk_wide": case_topk_wide, "retrieve_batch": case_retrieve_batch, "cli": case_cli,
         "profile": case_profile}


def main(names: list[str]) -> None:
    results = {}
    for name in names or list(CASES):
        try:
            results[name] = CASES[name]()
        except Exception as exc:  # reported per case, so one failure does not hide the others
            results[name] = {"ok": False, "checked": 0, "detail": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
