"""memfit_gpu.data.synth and `memfit data synth`: seeded, LongMemEval-shaped, streamable, loader round trip;
experiments/bench_kernels.py on synthetic data."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from memfit_gpu.cli import main
from memfit_gpu.data import load_benchmark
from memfit_gpu.data.synth import LIKES, iter_memories, synth_benchmark, write_longmemeval
from memfit_gpu.index.bm25 import BM25Index
from memfit_gpu.index.tokenize import tokenize, tokenize_many

REPO = Path(__file__).resolve().parents[2]


def test_same_seed_same_benchmark_other_seed_other_text():
    a = synth_benchmark("longmemeval-s", n_questions=3, seed=7, embedding_dim=8)
    b = synth_benchmark("longmemeval-s", n_questions=3, seed=7, embedding_dim=8)
    c = synth_benchmark("longmemeval-s", n_questions=3, seed=8)
    strip = [[(t.turn_id, t.speaker, t.text, t.timestamp) for t in m.turns()] for m in a.memories]
    assert strip == [[(t.turn_id, t.speaker, t.text, t.timestamp) for t in m.turns()] for m in b.memories]
    assert [m.questions for m in a.memories] != [m.questions for m in c.memories]
    assert strip != [[(t.turn_id, t.speaker, t.text, t.timestamp) for t in m.turns()] for m in c.memories]
    for ma, mb in zip(a.memories, b.memories, strict=True):
        assert np.array_equal(ma.extra["embeddings"], mb.extra["embeddings"])
    # memory i does not depend on the ones before it: streaming M can start anywhere
    third = list(iter_memories("longmemeval-s", n_questions=3, seed=7))[2]
    assert [(t.turn_id, t.text) for t in third.turns()] == [(t.turn_id, t.text) for t in a.memories[2].turns()]


@pytest.mark.parametrize("like, turns, sessions", [("longmemeval-s", (440, 770), (45, 55)),
                                                   ("longmemeval-m", (4400, 7000), (480, 520))])
def test_shapes_and_counts(like, turns, sessions):
    memories = list(iter_memories(like, n_questions=2, seed=0, embedding_dim=64))
    assert len(memories) == 2
    for memory in memories:
        all_turns = memory.turns()
        assert turns[0] <= len(all_turns) <= turns[1] and sessions[0] <= len(memory.sessions) <= sessions[1]
        assert [s.timestamp for s in memory.sessions] == sorted(s.timestamp for s in memory.sessions)
        (question,) = memory.questions
        assert question.memory_id == memory.memory_id == question.question_id
        gold = [t for t in all_turns if t.extra.get("has_answer")]
        assert [t.turn_id for t in gold] == question.evidence and gold[0].speaker == "user"
        # the fact the question asks for is in the gold turn only: BM25 finds it first
        assert question.answer in gold[0].text.split(" is ")[-1]
        index = BM25Index()
        index.add(tokenize_many([t.text for t in all_turns]), [0] * len(all_turns))
        _, rows = index.search([tokenize(question.question)], [0], k=1)
        assert all_turns[int(rows[0, 0])].turn_id == question.evidence[0]
        vectors = memory.extra["embeddings"]
        assert vectors.shape == (len(all_turns), 64) and vectors.dtype == np.float32
        assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-6)
        gold_row = [t.turn_id for t in all_turns].index(question.evidence[0])
        assert int(np.argmax(vectors @ question.extra["embedding"])) == gold_row
    words = [len(t.text.split()) for m in memories for t in m.turns()]
    assert 25 < np.mean(words) < 70  # user turns short, assistant turns long (medians 18 and 70)


def test_locomo_like_memories_hold_many_questions():
    memories = list(iter_memories("locomo", n_questions=200, seed=0))
    assert [len(m.questions) for m in memories] == [154, 46]
    assert all(400 <= len(m.turns()) <= 900 for m in memories)
    evidence = [q.evidence[0] for q in memories[0].questions]
    assert len(set(evidence)) == 154  # one distinct gold turn per question
    assert {q.category for q in memories[0].questions} == {"1", "2", "3", "4"}


def test_file_round_trips_through_the_longmemeval_loader(tmp_path):
    path = tmp_path / "synth.json"
    assert write_longmemeval(path, "longmemeval-s", n_questions=4, seed=3) == 4
    assert not (tmp_path / "synth.json.part").exists()
    loaded = load_benchmark("longmemeval", path)
    assert loaded.problems == []
    assert loaded.memories == synth_benchmark("longmemeval-s", n_questions=4, seed=3).memories


def test_data_synth_command(tmp_path, capsys):
    out = tmp_path / "m.json"
    assert main(["data", "synth", "--like", "locomo", "--out", str(out), "--questions", "2", "--seed", "5"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {
        "out": str(out), "like": "locomo", "questions": 2, "seed": 5}
    loaded = load_benchmark("longmemeval", out)
    assert [len(m.questions) for m in loaded.memories] == [1, 1]  # one question per haystack in this layout
    assert main(["data", "synth", "--like", "locomo", "--out", str(out), "--questions", "0"]) == 2
    assert "--questions must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["data", "synth", "--like", "longmemeval-x", "--out", str(out)])
    usage = capsys.readouterr().err
    choices = re.search(r"--like \{([^}]*)\}", " ".join(usage.split())).group(1)
    assert set(choices.split(",")) == set(LIKES)  # the command offers every shape data/synth.py has, no other
    assert {"longmemeval-s", "longmemeval-m", "locomo", "beam-100k", "beam-500k", "beam-1m", "beam-10m"} == set(LIKES)


def test_unknown_shape_is_named():
    with pytest.raises(ValueError, match="like='lme' is not one of longmemeval-s, longmemeval-m, locomo"):
        synth_benchmark("lme", n_questions=1)


# ---------------------------------------------------------------- experiments/bench_kernels.py
def _bench_module():
    spec = importlib.util.spec_from_file_location("bench_kernels", REPO / "experiments" / "bench_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_kernels_on_the_cpu_times_torch_only(capsys):
    import torch

    bench = _bench_module()
    result = bench.main(["--sizes", "locomo:12,s:3", "--device", "cpu", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "the Triton path is not timed on the CPU" in out
    assert list(result["sizes"]) == ["locomo:12", "s:3"]
    locomo, s = result["sizes"]["locomo:12"], result["sizes"]["s:3"]
    assert (locomo["questions"], locomo["memories"], s["questions"], s["memories"]) == (12, 1, 3, 3)
    assert locomo["triton_s"] is None and locomo["identical"] is None and locomo["torch_s"] > 0
    with pytest.raises(RuntimeError, match="not a GPU"):
        bench.run_gpu_stage(["locomo:2"], device="cpu")
    assert torch.device("cpu").type == "cpu"


def test_bench_kernels_paths_agree_under_the_interpreter():
    """The comparison the GPU stage reports (`identical`), run with the interpreter on CPU tensors."""
    script = ("import importlib.util, json, sys, torch; sys.argv = ['x'];"
              f"spec = importlib.util.spec_from_file_location('b', {str(REPO / 'experiments' / 'bench_kernels.py')!r});"
              "b = importlib.util.module_from_spec(spec); spec.loader.exec_module(b);"
              "r = b.run(['locomo:10', 's:2'], torch.device('cpu'), repeats=1, with_triton=True, progress=False);"
              "print(json.dumps(r))")
    done = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, TRITON_INTERPRET="1"), cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])["sizes"]
    assert [rows[s]["identical"] for s in ("locomo:10", "s:2")] == [True, True]
