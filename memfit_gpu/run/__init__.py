"""A run directory's life: what `memfit run`, `memfit retrieve`, `memfit profile` and `memfit judge-audit` do
between reading the config and writing the last file.

- preflight.py: refuse to start what cannot finish (files, weights, servers, devices), before any work;
- inputs.py: the run's inputs (data files, models and their weights, prompts, judge) with their digests;
- pipeline.py: the stages of `memfit run` in order (load, build, retrieve, answer, growth, depths, score),
  each resumable; directory.py its run directory's lock, config.yaml and timings; answer.py the answer stage
  with the run's judge; score.py metrics.json and results.md;
- offline.py: `memfit retrieve`, the retrieval alone, packs to a file;
- growth.py, depths.py: the analyses a run adds after answering (growth points, pack depths);
- judge_audit.py: a judge's agreement with people's labels;
- profile.py: `memfit profile`, the per-stage timings of the read path;
- tracking.py: the optional W&B run.
"""
