"""A test-only benchmark, `tiny`, added from tests/ with one module and one registry call.

A tiny chat-log format, one line each, `#` lines and blank lines skipped:

    M <memory id>                                  a memory starts
    T <ISO time> | <speaker> | <text>              a turn (a new time starts a new session)
    Q <category> | <question> | <answer> | <turn number, 1-based, of the evidence turn>

Loaded into a `memfit` process with MEMFIT_PLUGINS=seam_tiny_benchmark (tests/ on PYTHONPATH).
"""

from __future__ import annotations

from pathlib import Path

from memfit_gpu.data.registry import register_benchmark
from memfit_gpu.data.schema import Benchmark, DataError, Memory, Question, Session, Turn
from memfit_gpu.data.spec import BenchmarkSpec


def load(files: list[Path]) -> Benchmark:
    (path,) = files
    bench = Benchmark("tiny", str(path))
    memory: Memory | None = None
    turns: list[Turn] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        kind, _, rest = line.strip().partition(" ")
        if not kind or kind.startswith("#"):
            continue
        fields = [f.strip() for f in rest.split("|")]
        if kind == "M":
            memory, turns = Memory(rest.strip()), []
            bench.memories.append(memory)
        elif kind == "T" and memory is not None and len(fields) == 3:
            stamp, speaker, text = fields
            if not memory.sessions or memory.sessions[-1].timestamp != stamp:
                memory.sessions.append(Session(f"S{len(memory.sessions) + 1}", stamp, stamp))
            turn = Turn(f"t{len(turns) + 1}", speaker, text, stamp, stamp)
            memory.sessions[-1].turns.append(turn)
            turns.append(turn)
        elif kind == "Q" and memory is not None and len(fields) == 4:
            category, question, answer, evidence = fields
            memory.questions.append(Question(f"{memory.memory_id}:q{len(memory.questions)}", memory.memory_id, question,
                                             answer, category, evidence=[turns[int(evidence) - 1].turn_id]))
        else:
            raise DataError(str(path), f"line {number}", None, f"not an M, T or Q line: {line!r}")
    return bench


register_benchmark(BenchmarkSpec(name="tiny", title="Tiny", load=load, categories={"fact": "single fact"},
                                 category_source="tests/seam_tiny_benchmark.py"))
