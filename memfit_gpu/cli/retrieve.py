"""`memfit retrieve`: the batched read path over a benchmark's evaluated questions, with diagnostics."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DESCRIPTION = """\
Run MemFit retrieval (SPEC read path 1-9) for every evaluated question of a benchmark, all questions
in one batched pass per stage, and write:
  DIR/packs.jsonl       one line per question: ranked candidates with stage scores (bm25, dense,
                        fused, boost, source, rerank), the pack (episode rows + turn ids, summaries
                        with members), the excerpt text, and its retrieval diagnostics
  DIR/diagnostics.json  hit@5/10/20/30 over the final ranked list (a summary holds its rank;
                        eval.hit_list=episodes ranks the episodes alone), pack_hit (a gold turn among
                        the k selected, before neighbours), pack_hit_window, all_gold_pack, mrr,
                        overall and per category; unmatched evidence ids and questions without
                        evidence are counted, not dropped; which reranker ran, with which weights

The episode store is built in memory from the benchmark (one encoder pass). Summaries need an LLM, so
this command runs WITHOUT summaries unless --store names an existing store directory that holds
them (built by `memfit run` with summary.enabled and a reader). rerank.backend=cross-encoder needs
the cross-encoder weights (no PyPI package ships them); rerank.backend=none keeps the first-stage
order. Any config key can be overridden as key=value, e.g. retrieve.scan_top_k=30 pack.k=5.

method=plain | naive_rag | full_context (or a registered method whose read path calls no LLM) writes
that method's packs instead, through the same method seam and packs writer as `memfit run`
(memfit_gpu/methods; full_context bounds the history by reader.max_prompt_chars and
full_context.context_tokens only, as no reader is loaded here); method=lightmem_slm is refused: its
retrieval calls small language models."""


# diagnostics.json's overall figures the command prints (every method's rows have them: hit@k over its ranked turns)
SUMMARY_KEYS = ("hit@5", "hit@10", "hit@20", "hit@30", "pack_hit", "pack_hit_window", "mrr")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "retrieve", help="batched retrieval over a benchmark: packs and hit/pack diagnostics",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--config", required=True, help="YAML config (e.g. configs/memfit.yaml)")
    parser.add_argument("--benchmark", required=True,
                        help="a registered benchmark: locomo, longmemeval, memgallery, jsonl (your own file), ...")
    parser.add_argument("--data", help="benchmark file or folder (default: data.path, $MEMFIT_DATA_DIR, the cache)")
    parser.add_argument("--out", required=True,
                        help="output directory (packs.jsonl, diagnostics.json, provenance.json; held while written); "
                             "a run directory or a live memory's folder is refused")
    parser.add_argument("--limit-memories", type=int, help="first N memories only")
    parser.add_argument("--limit-questions", type=int, help="first N questions per memory only")
    parser.add_argument("--store", help="existing EpisodeStore directory to read (keeps its summaries)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    parser.set_defaults(func=run, user_errors=user_errors)


def user_errors() -> tuple[type[Exception], ...]:
    """Exit code 2, one line: an --out that is a run directory or a live memory's folder, or busy."""
    from memfit_gpu.run.directory import RunError

    return (RunError,)


def run(args: argparse.Namespace) -> int:
    from memfit_gpu.config import load_config
    from memfit_gpu.run.inputs import resolve_inputs
    from memfit_gpu.run.offline import retrieve_with_method
    from memfit_gpu.run.preflight import check_can_start

    overrides = [f"data.benchmark={args.benchmark}"] + list(args.overrides)
    if args.data:
        overrides.append(f"data.path={args.data}")
    if args.limit_memories is not None:
        overrides.append(f"data.limit_memories={args.limit_memories}")
    if args.limit_questions is not None:
        overrides.append(f"data.limit_questions={args.limit_questions}")
    cfg = load_config(args.config, overrides)
    # retrieval alone (no reader, judge or prompts), checked and placed by the device plan
    inputs = check_can_start(resolve_inputs(cfg, readers=False))
    out = Path(args.out)
    diagnostics = retrieve_with_method(inputs, out, args.store)
    overall = diagnostics["overall"]
    print(json.dumps({"questions": overall["questions"], "method": cfg.method,
                      **{k: overall[k] for k in SUMMARY_KEYS if k in overall},
                      "reranker": diagnostics.get("reranker", {}).get("backend", "none"), "out": str(out)}))
    return 0
