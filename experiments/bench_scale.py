"""Scale: a LongMemEval-shaped store built in bounded memory, then every question retrieved, same run.

The data is `memfit_gpu.data.synth` (seeded; S: 500 questions x ~550 turns, M: 500 x ~5,500 = ~2.75M
turns) with precomputed random unit embeddings, so no encoder runs: the figures are the store and the
read path. Memories stream from the generator into `EpisodeStore.add_memories` (chunks of
`store.write_budget_mb`; log, snapshot) and all questions go through `retrieve_batch` (hybrid BM25 +
dense, boosts, PRF; no summaries and no reranker: nothing here calls an LLM). PRF query vectors come
from `HashEncoder` (seeded token vectors), cached so the reference embeds the very same texts.

Printed (last line, JSON): build_s (the store's time, the generator's own time apart as generate_s), retrieve_s, questions_per_s, peak RSS (ru_maxrss and a 0.2 s
sampler, per phase), bytes per episode (in RAM by component, on disk, RSS growth), pack hit rate.
With --reference (default for S), today's path runs on the same data afterwards: the same store code in
ONE chunk with a FAISS index per memory (`index.dense_batched_max_rows=0`), and the packs must be equal;
--reference-repo PATH also runs `_scale_reference.py` against another checkout (e.g. a commit from
before the bounded write path and the batched dense product) in a subprocess and compares its packs too.

    .venv/bin/python experiments/bench_scale.py --like longmemeval-s
    .venv/bin/python experiments/bench_scale.py --like longmemeval-m --no-reference --store-dir /tmp/lme_m
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _scale_reference import scale_config  # noqa: E402  (experiments/, this script's folder)

from memfit_gpu.data.synth import HashEncoder, iter_memories
from memfit_gpu.retrieve.batched import retrieve_batch
from memfit_gpu.retrieve.view import ReadView
from memfit_gpu.store import EpisodeStore

GIB = 1 << 30


def rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssSampler:
    """Peak resident set size, sampled every `every` seconds, overall and per named phase; past `abort`
    bytes the process stops at once (exit 3) rather than take the machine down."""

    def __init__(self, every: float = 0.2, abort: int | None = None):
        self.every, self.peak, self.phase, self.phases, self.abort = every, 0, "setup", {}, abort
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.note()

    def note(self) -> None:
        now = rss_bytes()
        if self.abort is not None and now > self.abort:
            print(json.dumps({"aborted": f"RSS {now / GIB:.2f} GiB > --abort-rss-gib in phase {self.phase}",
                              "peak_rss_by_phase_gib": {k: round(v / GIB, 2) for k, v in self.phases.items()}}),
                  flush=True)
            os._exit(3)
        self.peak = max(self.peak, now)
        self.phases[self.phase] = max(self.phases.get(self.phase, 0), now)

    def enter(self, phase: str) -> None:
        self.note()
        self.phase = phase
        self.note()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.note()


def disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--like", required=True, choices=("longmemeval-s", "longmemeval-m"))
    parser.add_argument("--questions", type=int, default=500, help="questions, one memory (haystack) each")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--budget-mb", type=int, default=None, help="store.write_budget_mb (default: the config's)")
    parser.add_argument("--store-dir", default=None, help="where the store is built (default: a temp dir, removed)")
    parser.add_argument("--reference", action=argparse.BooleanOptionalAction, default=None,
                        help="also run today's path and compare packs (default: on for S, off for M)")
    parser.add_argument("--reference-repo", default=None,
                        help="also run _scale_reference.py with this checkout first on PYTHONPATH and compare")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    parser.add_argument("--abort-rss-gib", type=float, default=17.5, help="stop at once past this RSS (a safety net)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    reference = args.reference if args.reference is not None else args.like == "longmemeval-s"
    sampler = RssSampler(abort=int(args.abort_rss_gib * GIB))
    baseline = rss_bytes()

    cfg = scale_config()
    if args.budget_mb is not None:
        cfg.store.write_budget_mb = args.budget_mb
    encoder = HashEncoder(args.dim, seed=args.seed)
    cache: dict[str, torch.Tensor] = {}

    def embed(texts: list[str]) -> torch.Tensor:
        todo = [t for t in dict.fromkeys(texts) if t not in cache]
        if todo:
            cache.update(zip(todo, encoder.encode(todo), strict=True))
        return torch.stack([cache[t] for t in texts])

    scratch = Path(tempfile.mkdtemp(prefix="bench_scale_"))
    folder = Path(args.store_dir) if args.store_dir else scratch / "store"
    if folder.exists():
        shutil.rmtree(folder)
    asked: list[Any] = []
    generate_s = 0.0

    def memories() -> Any:
        nonlocal generate_s
        stream = iter_memories(args.like, args.questions, seed=args.seed, embedding_dim=args.dim)
        while True:
            start = time.perf_counter()
            memory = next(stream, None)
            generate_s += time.perf_counter() - start
            if memory is None:
                return
            asked.extend(memory.questions)
            yield memory

    # ---- build, streamed
    sampler.enter("build")
    start = time.perf_counter()
    store = EpisodeStore(folder, cfg, encoder)
    store.add_memories(memories(), progress=False, precomputed=True)
    build_s = time.perf_counter() - start
    timings = {k: round(v, 2) for k, v in store.last_timings.items()}
    gc.collect()
    sampler.note()
    episodes = store.size
    after_build = rss_bytes()
    held = {"columns": store.nbytes(), "bm25": store.episode_bm25.nbytes(), "dense": store.episode_dense.nbytes()}

    # ---- retrieve every question, batched
    sampler.enter("retrieve")
    texts = [q.question for q in asked]
    memory_ids = [q.memory_id for q in asked]
    q_emb = torch.from_numpy(np.stack([q.extra["embedding"] for q in asked]))
    start = time.perf_counter()
    view = ReadView.from_store(store)
    view_s = time.perf_counter() - start
    start = time.perf_counter()
    stage_timings: dict[str, float] = {}
    results = retrieve_batch(view, cfg, texts, memory_ids, embed=embed, question_embeddings=q_emb,
                             timings=stage_timings)
    retrieve_s = time.perf_counter() - start  # includes the first search's BM25 layout (_prepare)
    start = time.perf_counter()
    again = retrieve_batch(view, cfg, texts, memory_ids, embed=embed, question_embeddings=q_emb)
    warm_s = time.perf_counter() - start
    sampler.note()
    packs = {q.question_id: [list(part) for part in r.pack_key()] for q, r in zip(asked, results, strict=True)}
    stable = all(a.pack_key() == b.pack_key() for a, b in zip(results, again, strict=True))
    hit = sum(bool(set(q.evidence) & {view.ep_turn_id[r] for r in res.pack.selected})
              for q, res in zip(asked, results, strict=True)) / max(len(asked), 1)
    rss_bytes_after = rss_bytes()
    search_cache = store.episode_bm25.nbytes()["search_cache"]
    store.close()
    disk = disk_bytes(folder)
    held_total = sum(sum(v for v in part.values() if isinstance(v, int) and v > 1000) for part in held.values())
    peak_sampled = sampler.peak
    peak_ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    phases = {k: round(v / GIB, 2) for k, v in sampler.phases.items()}
    del view, results, again, store
    gc.collect()

    out: dict[str, Any] = {
        "like": args.like, "seed": args.seed, "questions": len(asked), "episodes": episodes,
        "memories": len(asked), "threads": torch.get_num_threads(), "write_budget_mb": cfg.store.write_budget_mb,
        "build_s": round(build_s - generate_s, 1), "generate_s": round(generate_s, 1), "build_breakdown_s": timings,
        "episodes_per_s": round(episodes / (build_s - generate_s), 1),
        "view_s": round(view_s, 2), "retrieve_s": round(retrieve_s, 2), "retrieve_warm_s": round(warm_s, 2),
        "questions_per_s": round(len(asked) / retrieve_s, 1), "questions_per_s_warm": round(len(asked) / warm_s, 1),
        "stage_s": {k: round(v, 3) for k, v in stage_timings.items() if k.startswith("stage_")},
        "peak_rss_gib": round(peak_ru / GIB, 2), "peak_rss_sampled_gib": round(peak_sampled / GIB, 2),
        "peak_rss_by_phase_gib": phases, "baseline_rss_gib": round(baseline / GIB, 2),
        "bytes_per_episode_held": round(held_total / max(episodes, 1), 1),
        "bytes_per_episode_held_by_part": {f"{name}.{k}": round(v / max(episodes, 1), 1)
                                           for name, part in held.items() for k, v in part.items() if v > 1000},
        "bytes_per_episode_bm25_search_cache": round(search_cache / max(episodes, 1), 1),
        "bytes_per_episode_rss": round((after_build - baseline) / max(episodes, 1), 1),
        "bytes_per_episode_rss_after_retrieve": round((rss_bytes_after - baseline) / max(episodes, 1), 1),
        "bytes_per_episode_disk": round(disk / max(episodes, 1), 1),
        "pack_hit": round(hit, 4), "packs_stable_across_runs": stable,
    }
    if not args.store_dir:
        shutil.rmtree(folder, ignore_errors=True)

    # ---- today's path on the same data
    if reference:
        sampler.enter("reference")
        ref_cfg = scale_config()
        ref_cfg.store.write_budget_mb = 1 << 30  # one chunk: the whole benchmark in one batch
        ref_cfg.index.dense_batched_max_rows = 0  # a FAISS index per memory, one FAISS call per question
        ref_folder = scratch / "reference"
        everything = list(iter_memories(args.like, args.questions, seed=args.seed, embedding_dim=args.dim))
        start = time.perf_counter()
        ref_store = EpisodeStore(ref_folder, ref_cfg, encoder)
        ref_store.add_memories(everything, progress=False, precomputed=True)
        ref_build_s = time.perf_counter() - start
        start = time.perf_counter()
        ref_results = retrieve_batch(ReadView.from_store(ref_store), ref_cfg, texts, memory_ids, embed=embed,
                                     question_embeddings=q_emb)
        ref_retrieve_s = time.perf_counter() - start
        ref_store.close()
        ref_packs = {q.question_id: [list(part) for part in r.pack_key()]
                     for q, r in zip(asked, ref_results, strict=True)}
        same = sum(packs[k] == ref_packs[k] for k in packs)
        out.update({
            "reference": "same store code, one chunk (write_budget_mb=2^30), FAISS per memory "
                         "(dense_batched_max_rows=0)",
            "reference_build_s": round(ref_build_s, 1), "reference_retrieve_s": round(ref_retrieve_s, 2),
            "build_ratio": round(ref_build_s / (build_s - generate_s), 3), "retrieve_ratio": round(ref_retrieve_s / retrieve_s, 3),
            "packs_equal_reference": same == len(packs), "packs_equal_reference_count": same,
            "reference_peak_rss_gib": round(sampler.phases.get("reference", 0) / GIB, 2),
        })
        del ref_results, ref_store, everything
        gc.collect()
    if args.reference_repo:
        sampler.enter("reference_repo")
        cache_path, packs_path = scratch / "embed_cache.pt", scratch / "reference_packs.pt"
        torch.save(cache, cache_path)
        env = {**os.environ, "PYTHONPATH": str(Path(args.reference_repo).resolve())}
        script = Path(__file__).resolve().parent / "_scale_reference.py"
        subprocess.run([sys.executable, str(script), "--like", args.like, "--questions", str(args.questions),
                        "--seed", str(args.seed), "--dim", str(args.dim), "--embed-cache", str(cache_path),
                        "--out", str(packs_path)], env=env, check=True)
        other = torch.load(packs_path, weights_only=True)
        same = sum(packs[k] == other["packs"].get(k) for k in packs)
        out.update({"reference_repo": str(args.reference_repo), "packs_equal_reference_repo": same == len(packs),
                    "packs_equal_reference_repo_count": same,
                    "reference_repo_timings_s": {k: round(v, 2) for k, v in other["timings"].items()}})
    sampler.stop()
    shutil.rmtree(scratch, ignore_errors=True)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
