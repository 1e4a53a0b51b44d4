"""`memfit retrieve`: the batched read path over a benchmark's evaluated questions, with diagnostics."""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

log = logging.getLogger(__name__)

DESCRIPTION = """\
Run MemFit retrieval (SPEC read path 1-9) for every evaluated question of a benchmark, all questions
in one batched pass per stage, and write:
  DIR/packs.jsonl       one line per question: ranked candidates with stage scores (bm25, dense,
                        fused, boost, source, rerank), the pack (episode rows + turn ids, summaries
                        with members), the excerpt text, and its retrieval diagnostics
  DIR/diagnostics.json  hit@5/10/20/30 over the final ranked episode list, pack_hit (a gold turn among
                        the k selected, before neighbours), pack_hit_window, all_gold_pack, mrr,
                        overall and per category; unmatched evidence ids and questions without
                        evidence are counted, not dropped; which reranker ran, with which weights

The episode store is built in memory from the benchmark (one encoder pass). Summaries need an LLM, so
this command runs WITHOUT summaries unless --store names an existing store directory that holds
them (built by `memfit run` with summary.enabled and a reader). rerank.backend=cross-encoder needs
the cross-encoder weights (no PyPI package ships them); rerank.backend=none keeps the first-stage
order. Any config key can be overridden as key=value, e.g. retrieve.scan_top_k=30 pack.k=5.

method=plain | naive_rag | full_context writes that method's packs instead (memfit_gpu/methods;
full_context bounds the history by reader.max_prompt_chars and full_context.context_tokens only, as no
reader is loaded here); method=lightmem_slm is refused: its retrieval calls small language models."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "retrieve", help="batched retrieval over a benchmark: packs and hit/pack diagnostics",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--config", required=True, help="YAML config (e.g. configs/memfit.yaml)")
    parser.add_argument("--benchmark", required=True, choices=("locomo", "longmemeval", "memgallery"))
    parser.add_argument("--data", help="benchmark file or folder (default: data.path, $MEMFIT_DATA_DIR, the cache)")
    parser.add_argument("--out", required=True, help="output directory (packs.jsonl, diagnostics.json)")
    parser.add_argument("--limit-memories", type=int, help="first N memories only")
    parser.add_argument("--limit-questions", type=int, help="first N questions per memory only")
    parser.add_argument("--store", help="existing EpisodeStore directory to read (keeps its summaries)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from memfit_gpu.config import load_config, to_dict
    from memfit_gpu.preflight import check_can_start

    overrides = [f"data.benchmark={args.benchmark}"] + list(args.overrides)
    if args.data:
        overrides.append(f"data.path={args.data}")
    if args.limit_memories is not None:
        overrides.append(f"data.limit_memories={args.limit_memories}")
    if args.limit_questions is not None:
        overrides.append(f"data.limit_questions={args.limit_questions}")
    cfg = load_config(args.config, overrides)
    check_can_start(cfg, readers=False)
    # --- issue 15: the method's packs (memfit_gpu/methods); plain is MemFit's path with its switches ---
    from memfit_gpu.config import ConfigError
    from memfit_gpu.methods.registry import NEEDS_READER_TO_RETRIEVE, memfit_path_config

    if cfg.method in NEEDS_READER_TO_RETRIEVE:
        raise ConfigError(f"method={cfg.method} retrieves with LLM calls (small language models): "
                          "use `memfit run`, which makes and accounts for them")
    memfit_cfg = memfit_path_config(cfg)
    if memfit_cfg is None:
        return _run_method(cfg, Path(args.out), to_dict(cfg))
    # --- end of the issue 15 seam ---
    return _run(memfit_cfg, Path(args.out), args.store, to_dict(cfg))


def _run_method(cfg, out: Path, cfg_dict: dict) -> int:
    """packs.jsonl and diagnostics.json of an LLM-free method with its own path, built in memory."""
    from memfit_gpu.data import load_benchmark, select_from_config
    from memfit_gpu.methods.base import MethodRun
    from memfit_gpu.methods.registry import make_method

    started = time.perf_counter()
    benchmark = select_from_config(load_benchmark(cfg.data.benchmark, cfg.data.path, split=cfg.data.split), cfg.data)
    questions = [q for q in benchmark.questions() if q.evaluated]
    method = make_method(cfg.method)
    run = MethodRun(cfg, None, benchmark, benchmark.memories, questions, progress=True)
    try:
        method.write(run)
        rows, diagnostics = method.read(run)
    finally:
        method.close()
    diagnostics["timings"] = {"total_s": time.perf_counter() - started}
    diagnostics["config"] = cfg_dict
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "packs.jsonl", "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    (out / "diagnostics.json").write_text(json.dumps(diagnostics, indent=2) + "\n")
    overall = diagnostics["overall"]
    print(json.dumps({"questions": overall["questions"], "method": cfg.method,
                      **{k: overall[k] for k in ("pack_hit", "pack_hit_window", "mrr")}, "out": str(out)}))
    return 0


def _run(cfg, out: Path, store_path: str | None, cfg_dict: dict) -> int:
    import torch

    from memfit_gpu.data import load_benchmark, select_from_config
    from memfit_gpu.index.encoders import load_bi_encoder
    from memfit_gpu.retrieve.batched import retrieve_batch
    from memfit_gpu.retrieve.diagnostics import compute_diagnostics
    from memfit_gpu.retrieve.rerank import load_reranker, reranker_info
    from memfit_gpu.retrieve.view import ReadView
    from memfit_gpu.store import EpisodeStore

    timings: dict[str, float] = {}
    started = time.perf_counter()
    # The reranker first: a missing cross-encoder fails before any encoding work.
    reranker = load_reranker(cfg.rerank, device=cfg.index.device, encoder_backend=cfg.index.encoder_backend)
    benchmark = select_from_config(load_benchmark(cfg.data.benchmark, cfg.data.path, split=cfg.data.split), cfg.data)
    questions = [q for q in benchmark.questions() if q.evaluated]
    timings["load_s"] = time.perf_counter() - started

    t0 = time.perf_counter()
    encoder = load_bi_encoder(cfg.index)
    if store_path:
        store = EpisodeStore(store_path, cfg, encoder)
        missing = [m.memory_id for m in benchmark.memories if m.memory_id not in store.memory_ids]
        if missing:
            raise FileNotFoundError(f"store {store_path} lacks memories {missing[:5]} of {cfg.data.benchmark}")
    else:
        store = EpisodeStore(None, cfg, encoder)
        store.add_memories(benchmark.memories, progress=True)
    view = ReadView.from_store(store)
    timings["store_s"] = time.perf_counter() - t0
    log.info("retrieve: %d questions over %d memories (%d episodes, %d summaries; summaries %s)",
             len(questions), len(benchmark.memories), view.num_episodes, len(view.sm_text),
             "used" if cfg.retrieve.summaries and view.has_summaries else "not used")

    def embed(texts: list[str]) -> torch.Tensor:
        return encoder.encode(texts, batch_size=cfg.index.encode_batch_size)

    t0 = time.perf_counter()
    results = retrieve_batch(view, cfg, [q.question for q in questions], [q.memory_id for q in questions],
                             embed=embed, reranker=reranker, progress=True)
    timings["retrieve_s"] = time.perf_counter() - t0
    info = reranker_info(cfg.rerank, reranker)
    diagnostics, records = compute_diagnostics(results, questions, view, info)
    diagnostics["encoder"] = view.encoder_info or encoder.info()
    diagnostics["summaries_used"] = bool(cfg.retrieve.summaries and view.has_summaries)
    diagnostics["timings"] = timings
    diagnostics["config"] = cfg_dict

    out.mkdir(parents=True, exist_ok=True)
    with open(out / "packs.jsonl", "w") as fh:
        for q, result, record in zip(questions, results, records, strict=True):
            row = {"question_id": q.question_id, "category": q.category, "gold": q.answer,
                   "evidence": q.evidence, **result.to_json(view), "retrieval": record}
            fh.write(json.dumps(row) + "\n")
    (out / "diagnostics.json").write_text(json.dumps(diagnostics, indent=2) + "\n")
    overall = diagnostics["overall"]
    print(json.dumps({"questions": overall["questions"], **{k: overall[k] for k in
                      ("hit@5", "hit@10", "hit@20", "hit@30", "pack_hit", "pack_hit_window", "mrr")},
                      "reranker": info["backend"], "out": str(out)}))
    return 0
