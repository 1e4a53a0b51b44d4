"""Readers: `make_reader(cfg, run_dir).generate(requests) -> responses`, over transformers | vllm | openai.

types.py        Request, Response, the Backend ABC, ReaderError / MissingBackendError, ROLES, ROLE_PHASES
registry.py     reader.backend name -> "module:Class", imported on first use (make_backend)
reader.py       Reader: a backend behind the response cache and the ledger (make_reader)
transformers.py in-process Hugging Face models (text and vision-language; accelerate device maps)
vllm.py         offline vLLM engines, one subprocess each (vllm_worker.py)
openai.py       OpenAI-compatible HTTP servers (vLLM serve, hosted APIs)
images.py       image paths and URLs as OpenAI content parts / data URLs
cache.py        the SQLite response cache and its request keys
ledger.py       calls, tokens, GPU-seconds and cost per role (prices.yaml); the one-answer check
prompts.py      prompt files (memfit_gpu/prompts/) and the chat messages built from them; judge kinds
clean.py        a reader's raw output -> the answer that is scored

This package imports nothing on its own: a backend's library (torch, transformers, vllm, httpx) loads
only when that backend is built.
"""
