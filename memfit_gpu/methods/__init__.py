"""Memory systems other than MemFit, run in the same harness: `memfit run ... method=M`.

Every method shares the data loading, encoders, readers, response cache, ledger, answer call and scoring
of `memfit run`; only how a question's excerpts are made (and the write-time work behind them) differs.

registry.py      method name -> implementation; `MethodRun`, what a method gets from the run
common.py        what several methods share: the turn table, the packs of a method, its diagnostics
plain.py         plain retrieval: MemFit's read path with every MemFit addition off
naive_rag.py     fixed-size word chunks of the history, dense top-k, no rerank
full_context.py  the whole history, oldest turns dropped first when it does not fit the reader
lightmem.py      LightMem-SLM: STM / MTM / LTM graph, SLM-1 rewrite + routing, SLM-2 re-rank
lightmem_noise.py  LightMem-SLM's error injection (lightmem.noise.*: HQ, write and MTM noise)

The `method` key and the `naive_rag`, `full_context`, `lightmem` config sections are in memfit_gpu/config.py
(which imports nothing of memfit_gpu). This package file imports nothing.
"""
