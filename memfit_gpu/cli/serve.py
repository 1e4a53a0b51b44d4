"""`memfit serve`: a live memory over HTTP (memfit_gpu/serve/); its API keys come from `memfit keys new`.

    memfit serve --store DIR --config C --keys FILE [--host 127.0.0.1 --port 8765] [key=value ...]
"""

from __future__ import annotations

import argparse

SERVE_DESCRIPTION = """\
Serve one live memory (memfit_gpu.Memory) over HTTP with FastAPI on uvicorn; OpenAPI at /docs.

DIR is the memory's folder (created when missing): its store (every turn verbatim, BM25 and dense
indexes), the reader's cache and ledger. One process serves a folder (DIR/.lock). The method is the
config's `method` (memfit, plain, naive_rag, lightmem_slm, mem0). Per user: POST /v1/users/U/turns adds turns
(durable when the reply comes), /search returns ranked hits with their stage scores, /answer makes one
reader call per question, /delete and DELETE /v1/users/U forget; /healthz, /metrics (Prometheus; an admin key).

Every /v1 request needs a key of the keys file (Authorization: Bearer KEY), bound to the user ids it may
touch: a missing or unknown key is 401, another user's path 403, and neither reads anything. Concurrent
searches, answers and adds arriving within serve.batch_window_ms (or until serve.max_batch wait) are
answered by one batched call (serve.max_batch=1: one at a time). Bodies above serve.max_body_bytes are
413; more than serve.max_turns_per_request turns or serve.max_queries_per_request queries 422.
SIGTERM (or Ctrl-C) drains: no new connections, in-flight requests finish (serve.drain_timeout_s), then the
store is snapshotted and closed."""

def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="serve a live memory over HTTP (add, search, answer, delete per user)",
                                   description=SERVE_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", required=True, metavar="DIR", help="the memory's folder (created when missing)")
    parser.add_argument("--config", help="YAML config (default: the built-in defaults, i.e. configs/memfit.yaml)")
    parser.add_argument("--keys", help="keys file (default serve.keys_file)")
    parser.add_argument("--host", help="address to bind (default serve.host, 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default serve.port, 8765; 0 = any free port)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (serve.max_batch=1)")
    parser.set_defaults(func=serve_command, user_errors=busy_errors)


def busy_errors() -> tuple[type[BaseException], ...]:
    from memfit_gpu.locks import DirectoryBusyError

    return (DirectoryBusyError,)


def serve_command(args: argparse.Namespace) -> int:
    from memfit_gpu.config import load_config
    from memfit_gpu.serve.server import serve

    cfg = load_config(args.config, args.overrides)
    serve(args.store, cfg, keys_file=args.keys, host=args.host, port=args.port)
    return 0
