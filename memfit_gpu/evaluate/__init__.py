"""Evaluation: answer scores, per-category tables, uncertainty, judge replies, run comparison.

metrics.py  token F1 / BLEU-1: `paper`, official `locomo`, `memgallery` variants (score, score_all)
tables.py   summarize(rows) -> metrics.json; render_markdown (the paper's table); write_csv
paper_tables.py  the paper's tables from finished run / sweep directories (`memfit tables`; the renderer is
            memfit_gpu/render.py)
stats.py    seeded percentile bootstrap (mean, mean of category means); paired sign-flip permutation test
judge.py    judge reply parsers (paper and LongMemEval CORRECT/WRONG, MemGallery graded, BEAM rubric)
compare.py  paired comparison of two runs' predictions.jsonl (`memfit compare`: memfit_gpu/cli/compare.py);
            compare_seeds: two systems over repeated seeds (`memfit compare --seeds`)
text_metrics.py  ROUGE-L, ROUGE-2 (rouge-score), METEOR (nltk), SBERT similarity (eval.text_metrics)
lightmem_tables.py  the LightMem-SLM paper's tables (`memfit tables --lightmem`)
"""
