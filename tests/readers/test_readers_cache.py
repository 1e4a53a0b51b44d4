"""Response cache keys, SQLite persistence, the ledger and its one-answer-per-question check, cost."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

from memfit_gpu.config import ReaderConfig
from memfit_gpu.data.schema import DataError
from memfit_gpu.files import temporaries
from memfit_gpu.readers.cache import ResponseCache, request_key
from memfit_gpu.readers.ledger import (
    Ledger,
    LedgerCheckError,
    check_ledger,
    load_prices,
    read_ledger,
    recorded_cost,
    usd_text,
)
from memfit_gpu.readers.reader import Reader, background_calls
from memfit_gpu.readers.types import Backend, Request, Response

REPO = Path(__file__).resolve().parents[2]


def _req(content: str = "What is the capital of France?", **kw: object) -> Request:
    base: dict = {"max_new_tokens": 8, "temperature": 0.0, "key": "q1"}
    base.update(kw)
    return Request([{"role": "user", "content": content}], "answer", **base)  # type: ignore[arg-type]


def test_key_depends_on_what_decides_the_output(tmp_path: Path) -> None:
    k = request_key("transformers", "m", _req())
    assert k == request_key("transformers", "m", _req(key="another question id"))  # the id is not an input
    assert len(k) == 64 and int(k, 16) >= 0
    assert k != request_key("vllm", "m", _req())
    assert k != request_key("transformers", "m2", _req())
    assert k != request_key("transformers", "m", _req("What is the capital of Spain?"))
    assert k != request_key("transformers", "m", _req(max_new_tokens=9))
    assert k != request_key("transformers", "m", _req(temperature=0.7))
    # reader.seed decides a sampled output only: greedy keys ignore it (and stay what they were before it)
    assert k == request_key("transformers", "m", _req(), seed=5)
    sampled = request_key("transformers", "m", _req(temperature=0.7))
    assert sampled == request_key("transformers", "m", _req(temperature=0.7), seed=0)
    assert sampled != request_key("transformers", "m", _req(temperature=0.7), seed=5)


def test_local_images_enter_the_key_by_content(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a.png", tmp_path / "b.png", tmp_path / "c.png"
    a.write_bytes(b"\x89PNG same bytes")
    b.write_bytes(b"\x89PNG same bytes")
    c.write_bytes(b"\x89PNG other bytes")
    key = lambda p: request_key("vllm", "m", _req(images=[str(p)]))  # noqa: E731
    assert key(a) == key(b)  # same picture under another name: same answer
    assert key(a) != key(c)
    url = "https://example.org/x.png"
    assert request_key("vllm", "m", _req(images=[url])) != key(a)


def test_cache_persists_in_wal_mode(tmp_path: Path) -> None:
    path = tmp_path / "cache.sqlite"
    cache = ResponseCache(path)
    cache.put_many("openai", [("k1", "answer", Response("Paris", 30, 2, 0.5, False, "gpt-4o-mini", True)),
                              ("k2", "judge", Response("{}", 10, 1, 0.1, False, "gpt-4o-mini"))])
    cache.close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        rows = conn.execute("SELECT key, backend, role, text FROM responses ORDER BY key").fetchall()
    assert rows == [("k1", "openai", "answer", "Paris"), ("k2", "openai", "judge", "{}")]
    again = ResponseCache(path)
    found = again.get_many(["k1", "k1", "missing"])
    assert list(found) == ["k1"]
    assert found["k1"] == Response("Paris", 30, 2, 0.5, True, "gpt-4o-mini", True)
    assert len(again) == 2


def _resp(n_in: int, n_out: int, cached: bool = False, model: str = "gpt-4o-mini") -> Response:
    return Response("x", n_in, n_out, 0.25, cached, model)


def test_ledger_counts_per_role() -> None:
    ledger = Ledger()
    ledger.record("answer", "q1", _resp(100, 5), "openai")
    ledger.record("answer", "q2", _resp(200, 7, cached=True), "openai")
    ledger.record("summary", "seg0", _resp(300, 40), "openai")
    ledger.add_wall("answer", 2.0)
    d = ledger.to_dict()
    assert d["roles"]["answer"] == {"calls": 1, "cached": 1, "input_tokens": 100, "output_tokens": 5,
                                    "estimated_token_calls": 0, "latency_s": 0.25, "wall_s": 2.0, "gpu_seconds": 0.0,
                                    "errors": 0}
    assert d["roles"]["summary"]["calls"] == 1 and d["roles"]["summary"]["output_tokens"] == 40
    assert d["roles"]["judge"]["calls"] == 0
    assert d["answer_calls"] == 2 and d["answer_keys"] == ["q1", "q2"]
    # gpt-4o-mini: 0.15 / 0.60 USD per 1M tokens; 400 in, 45 out over backend calls only.
    assert d["cost"]["usd"] == pytest.approx(400 * 0.15e-6 + 45 * 0.60e-6)
    assert json.loads(ledger.to_json()) == d
    assert Ledger.from_dict(d).to_dict() == d


@pytest.mark.parametrize(("content", "field", "reason"), [
    (b'["roles"]', None, "expected a JSON object, got list"),
    (b'{"models": {}}', "'roles'", "missing"),
    (b'{"roles": []}', "'roles'", "expected dict, got list"),
    (b'{"roles": {"answer": 3}}', "'roles.answer'", "expected a mapping, got int"),
    (b'{"roles": {"answer": {"calls": "12"}}}', "'roles.answer.calls'", "expected a number, got '12'"),
    (b'{"roles": {"answer": {"calls": true}}}', "'roles.answer.calls'", "expected a number, got True"),
    (b'{"roles": {"answer": {"cals": 12}}}', "'roles.answer.cals'", "not a field of a ledger"),
    (b'{"roles": {}, "models": {"m": {"backend": 1, "model": "x"}}}', "'models.m.backend'", "expected text"),
    (b'{"roles": {}, "models": {"m": {"model": "x", "calls": 2}}}', "'models.m.backend'", "missing"),
    (b'{"roles": {}, "answer_keys": 5}', "'answer_keys'", "expected a list, got int"),
    (b'{"roles": {"answer": {"calls": 1}}}\xff', None, "not UTF-8"),
])
def test_a_ledger_that_is_not_one_is_a_data_error_naming_the_field(tmp_path: Path, content: bytes, field: str | None,
                                                                   reason: str) -> None:
    """ledger.json read back (`read_ledger`: efficiency, report, tables; Ledger.load: a live memory, the judge audit;
    a resumed run's load_ledger): a file of another shape counted zero calls (a missing role), or stopped with a
    traceback."""
    path = tmp_path / "ledger.json"
    path.write_bytes(content)
    for read in (read_ledger, Ledger.load):
        with pytest.raises(DataError):
            read(path)
    with pytest.raises(DataError) as info:
        Ledger.load(path)
    message = str(info.value)
    assert message.startswith(f"{path}, " if field else f"{path}: ") and reason in message, message
    if field:
        assert f"field {field}" in message, message
    path.write_text(Ledger().to_json())  # what memfit writes reads back
    assert Ledger.load(path).roles["answer"].calls == 0


def test_local_models_cost_nothing_unknown_models_make_the_cost_unknown() -> None:
    """A hosted model without a price was left out of `usd`: a run whose judge is unpriced cost 0.0 in the report,
    `memfit efficiency` and the paper tables. The total is unknown (None); the priced part and the models are said."""
    ledger = Ledger()
    ledger.record("answer", "q1", _resp(1000, 10, model="HuggingFaceTB/SmolLM2-135M-Instruct"), "vllm")
    ledger.add_gpu_seconds("answer", 12.5)
    ledger.record("judge", "q1", _resp(1000, 10, model="my-private-model"), "openai")
    cost = ledger.cost()
    assert cost["usd"] is None and cost["priced_usd"] == 0.0
    assert cost["by_model"] == {"vllm|HuggingFaceTB/SmolLM2-135M-Instruct": 0.0, "openai|my-private-model": None}
    assert cost["unpriced_models"] == ["my-private-model"]
    assert cost["gpu_seconds"] == 12.5
    # a priced hosted model beside it: its part is kept, the whole stays unknown
    ledger.record("summary", "s1", _resp(1_000_000, 0), "openai")  # gpt-4o-mini: 0.15 USD per 1M input tokens
    cost = ledger.to_dict()["cost"]
    assert (cost["usd"], cost["priced_usd"], cost["unpriced_models"]) == (None, pytest.approx(0.15), ["my-private-model"])
    assert recorded_cost(ledger.to_dict()) == {"usd": None, "priced_usd": pytest.approx(0.15),
                                               "unpriced_models": ["my-private-model"]}
    assert usd_text(recorded_cost(ledger.to_dict())) == (
        "n/a (partial: 0.1500 USD priced; unpriced, no price in configs/prices.yaml: my-private-model)")
    # a ledger.json written before: its `usd` summed the priced models alone, and is read as that part
    old = {"cost": {"usd": 0.15, "by_model": {}, "unpriced_models": ["my-private-model"], "gpu_seconds": 0.0}}
    assert recorded_cost(old) == {"usd": None, "priced_usd": 0.15, "unpriced_models": ["my-private-model"]}
    # every model priced (or local): the whole cost, as before
    priced = Ledger()
    priced.record("answer", "q1", _resp(1_000_000, 0), "openai")
    assert priced.cost()["usd"] == priced.cost()["priced_usd"] == pytest.approx(0.15)
    assert usd_text(recorded_cost(priced.to_dict())) == "0.1500"
    assert usd_text(recorded_cost({"roles": {}})) == "-"  # a ledger without a cost
    # what the readers show is checked where it is read: damage is one error naming the field
    for cost_field, value, said in (("usd", "abc", "expected a number or null, got 'abc'"),
                                    ("unpriced_models", "gpt-x", "expected a list of model names, got 'gpt-x'")):
        with pytest.raises(DataError) as info:
            check_ledger({"roles": {}, "cost": {cost_field: value}}, "ledger.json")
        assert str(info.value) == f"ledger.json, field 'cost.{cost_field}': {said}"


def test_one_answer_per_question_check() -> None:
    ledger = Ledger()
    for key in ["q1", "q2", "q3"]:
        ledger.record("answer", key, _resp(1, 1), "openai")
    ledger.record("judge", "q1", _resp(1, 1), "openai")  # judge calls do not count as answers
    ledger.check_one_answer_per_question(["q3", "q1", "q2"])
    with pytest.raises(LedgerCheckError, match=r"1 questions without an answer call: \['q4'\]"):
        ledger.check_one_answer_per_question(["q1", "q2", "q3", "q4"])
    with pytest.raises(LedgerCheckError, match=r"answer calls for ids that are not questions: \['q3'\]"):
        ledger.check_one_answer_per_question(["q1", "q2"])
    ledger.record("answer", "q2", _resp(1, 1, cached=True), "openai")
    with pytest.raises(LedgerCheckError, match=r"more than one answer call: \['q2 x2'\]"):
        ledger.check_one_answer_per_question(["q1", "q2", "q3"])


def test_prices_file(tmp_path: Path) -> None:
    assert load_prices()["gpt-4o"] == {"input": 2.5, "output": 10.0}
    bad = tmp_path / "prices.yaml"
    bad.write_text("models:\n  m: {input: 1.0}\n")
    with pytest.raises(DataError, match=r"field 'models.m': needs 'input' and 'output'"):
        load_prices(bad)
    # each was a traceback (ValueError, AttributeError, a YAML error) or, for NaN and -1, an estimate of nan
    for text, field, says in (("models:\n  m: {input: abc, output: 1}\n", "models.m.input", "'abc' is no price"),
                              ("models:\n  m: {input: .nan, output: 1}\n", "models.m.input", "nan is no price"),
                              ("models:\n  m: {input: 1, output: -1}\n", "models.m.output", "-1 is no price"),
                              ("models: [1, 2]\n", "models", "expected a mapping of models"),
                              ("- 1\n", None, "a mapping of keys"), ("models: {m: [\n", None, "YAML")):
        bad.write_text(text)
        with pytest.raises(DataError) as refused:
            load_prices(bad)
        assert refused.value.field == field and says in str(refused.value), text
    with pytest.raises(FileNotFoundError, match="nowhere.yaml"):
        load_prices(tmp_path / "nowhere.yaml")


@pytest.mark.slow  # builds the wheel (a few seconds)
def test_an_installed_memfit_reads_its_prices_and_prompts_as_package_data(tmp_path: Path, shared_data: Path) -> None:
    """A non-editable install has no configs/ folder: the price table and the prompts are package data read
    with importlib.resources, whatever the working directory (the wheel is built from a copy of the tree,
    so no build/ folder is left in the checkout)."""
    source = tmp_path / "source"
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for folder in ("memfit_gpu", "kernels"):
        shutil.copytree(REPO / folder, source / folder, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "wheel"), str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "wheel").glob("memfit_gpu-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(tmp_path / "site")  # a pure-Python wheel unpacked is an install
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = ("import json; from memfit_gpu.readers import ledger, prompts; "
            "print(json.dumps([ledger.__file__, ledger.load_prices(), prompts.load_prompt('answer.txt')]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(tmp_path / "site")})
    assert done.returncode == 0, done.stderr[-2000:]
    module, prices, answer_prompt = json.loads(done.stdout)
    assert module == str(tmp_path / "site" / "memfit_gpu" / "readers" / "ledger.py")
    assert prices == load_prices() and prices["gpt-4o"] == {"input": 2.5, "output": 10.0}
    assert answer_prompt == (REPO / "memfit_gpu" / "prompts" / "answer.txt").read_text(encoding="utf-8")
    # every package of the tree is in the wheel (pyproject lists them by hand), the kernels included
    packages = {p.parent.relative_to(REPO).as_posix() for p in (REPO / "memfit_gpu").rglob("__init__.py")
                if "__pycache__" not in p.parts}
    installed = {p.parent.relative_to(tmp_path / "site").as_posix()
                 for p in (tmp_path / "site" / "memfit_gpu").rglob("__init__.py")}
    assert packages <= installed, f"missing from the wheel: {sorted(packages - installed)}"
    # and the smoke run works from that install, in another folder (prices, prompts, kernels as package data;
    # two of its questions: the answers' cost adds nothing to what the install is checked for)
    run = subprocess.run([sys.executable, "-m", "memfit_gpu.cli", "run", "--config", str(REPO / "configs" / "smoke.yaml"),
                          "--out", str(elsewhere / "run"), "--quiet", "data.limit_questions=2"], cwd=elsewhere,
                         capture_output=True, text=True,
                         timeout=900, env={**os.environ, "PYTHONPATH": str(tmp_path / "site"),
                                           "MEMFIT_DATA_DIR": str(shared_data)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert (elsewhere / "run" / "DONE").exists() and json.loads((elsewhere / "run" / "metrics.json").read_text())["questions"] == 2


def test_request_validation_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"key='q9'.*role 'reader'"):
        Request([{"role": "user", "content": "x"}], "reader", key="q9")
    with pytest.raises(ValueError, match=r"messages\[0\] lacks"):
        Request([{"content": "x"}], "answer", key="q9")


def test_chat_template_kwargs_are_part_of_the_cache_key():
    request = Request([{"role": "user", "content": "When?"}], role="answer", max_new_tokens=8, temperature=0.0, key="q")
    plain = request_key("vllm", "Qwen/Qwen3-8B", request)
    assert request_key("vllm", "Qwen/Qwen3-8B", request, {}) == plain  # no option: the key made before it existed
    no_think = request_key("vllm", "Qwen/Qwen3-8B", request, {"enable_thinking": False})
    assert no_think != plain
    assert request_key("vllm", "Qwen/Qwen3-8B", request, {"enable_thinking": True}) not in (plain, no_think)


class _Echo(Backend):
    """An in-process backend that answers with the question (the Reader's batching under test, no model)."""

    name = "echo"
    chunk_size = 64

    def __init__(self) -> None:
        super().__init__(ReaderConfig(model="echo"))
        self.calls: list[int] = []

    def generate(self, requests):  # noqa: ANN001, ANN201
        self.calls.append(len(requests))
        return [Response(r.messages[-1]["content"], 3, 1, 0.0, False, "echo") for r in requests]


def test_an_in_process_backend_generates_one_flush_at_a_time(tmp_path: Path) -> None:
    """reader.flush_every is what a killed run can lose: an in-process backend is asked for one batch per
    call (not its whole chunk_size), each batch is cached and in the ledger before it is handed out, and
    a repeated request is generated once and served to both positions."""
    backend = _Echo()
    reader = Reader(backend, ResponseCache(tmp_path / "cache.sqlite"), Ledger(), 8, 0.0, progress=False)
    requests = [_req(f"q{i}?", key=f"k{i}") for i in range(9)] + [_req("q0?", key="again")]
    batches = []
    for batch in reader.generate_batches(requests, batch_size=3):
        batches.append([i for i, _ in batch])
        assert len(reader.cache) == len({i for b in batches for i in b} - {9})
        assert set(reader.ledger.answer_keys) >= {requests[i].key for i in batches[-1]}
    assert backend.calls == [3, 3, 3]
    assert batches == [[0, 1, 2], [9], [3, 4, 5], [6, 7, 8]]  # the repeat comes with the call that made it
    assert reader.ledger.roles["answer"].calls == 9 and reader.ledger.roles["answer"].cached == 1


class _Loading(_Echo):
    """_Echo with a model to load (`Backend.load`), counted; loading takes 100 s of the reader's clock."""

    gpus = 1

    def __init__(self, clock: list[float]) -> None:
        super().__init__()
        self.clock = clock
        self.loads = 0

    def load(self) -> None:
        self.loads += 1
        self.clock[0] += 100.0


def test_the_model_loads_for_the_first_request_the_cache_cannot_serve_and_its_load_is_no_role_s_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rerun that the response cache serves entirely never loads the model (a vLLM engine takes minutes on a
    GPU server); the first request it cannot serve loads it, once, before generating; the load's seconds count
    in neither the role's wall time nor its GPU-seconds, as when the reader loaded it before its first call."""
    clock = [0.0]

    class Clock:  # the reader's clock: 1 s per reading, plus what loading adds
        @staticmethod
        def perf_counter() -> float:
            clock[0] += 1.0
            return clock[0]

    monkeypatch.setattr("memfit_gpu.readers.reader.time", Clock)
    first = _Loading(clock)
    reader = Reader(first, ResponseCache(tmp_path / "cache.sqlite"), Ledger(), 8, 0.0, progress=False)
    asked = [_req(f"q{i}?", key=f"k{i}") for i in range(3)]
    assert reader.generate([]) == [] and first.loads == 0
    assert [r.text for r in reader.generate(asked)] == ["q0?", "q1?", "q2?"] and first.loads == 1
    answer = reader.ledger.roles["answer"]
    assert answer.wall_s < 100 and 0 < answer.gpu_seconds < 100
    reader.generate([_req("q3?", key="k3")])
    assert first.loads == 1  # once per reader
    reader.close()
    # the rerun: everything cached, nothing loaded, however often asked
    again = _Loading(clock)
    rerun = Reader(again, ResponseCache(tmp_path / "cache.sqlite"), Ledger(), 8, 0.0, progress=False)
    served = rerun.generate(asked)
    assert [r.text for r in served] == ["q0?", "q1?", "q2?"] and all(r.cached for r in served)
    assert [r.text for b in rerun.generate_batches(asked, 2) for _, r in b] == ["q0?", "q1?", "q2?"]
    assert again.loads == 0 and again.calls == []
    assert rerun.generate([*asked, _req("new?", key="k4")])[-1].text == "new?"
    assert again.loads == 1 and again.calls == [1]
    rerun.close()


def test_two_threads_that_need_the_model_at_once_load_it_once(tmp_path: Path) -> None:
    """The live memory answers beside its consolidation: two first calls at once load one model."""
    started = threading.Barrier(2)

    class Slow(_Echo):
        loads = 0

        def load(self) -> None:
            Slow.loads += 1
            threading.Event().wait(0.2)  # long enough for the other thread to arrive

    reader = Reader(Slow(), ResponseCache(tmp_path / "cache.sqlite"), Ledger(), 8, 0.0, progress=False)

    def ask(i: int) -> None:
        started.wait()
        for _ in reader.generate_batches([_req(f"q{i}?", key=f"k{i}")], 1):
            pass

    workers = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert Slow.loads == 1 and len(reader.cache) == 2
    reader.close()


class _Gated(_Echo):
    """_Echo with chunks of 2 that records which prompts each call held, and holds its first call until
    `release` is set (so a test can see who goes next while it runs; a provoked delay, no reported number)."""

    chunk_size = 2

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[list[str]] = []
        self.inside, self.release = threading.Event(), threading.Event()

    def generate(self, requests):  # noqa: ANN001, ANN201
        self.asked.append([r.messages[-1]["content"] for r in requests])
        if len(self.asked) == 1:
            self.inside.set()
            assert self.release.wait(10)
        return super().generate(requests)


def test_background_work_goes_a_chunk_at_a_time_and_lets_a_waiting_answer_go_first(tmp_path: Path) -> None:
    """A live memory's consolidation (background_calls) held the reader for all its calls: one user adding
    many turns kept every other user's answer waiting until its summaries were done. Background work now
    goes one chunk per turn, and an answer waiting goes before its next chunk, all committed as before."""
    backend = _Gated()
    reader = Reader(backend, ResponseCache(tmp_path / "cache.sqlite"), Ledger(), 8, 0.0, progress=False)
    summaries = [Request([{"role": "user", "content": f"s{i}"}], "summary", max_new_tokens=8, temperature=0.0,
                         key=f"s{i}") for i in range(6)]
    made: list[list[str]] = []

    def consolidate() -> None:
        with background_calls():
            made.append([r.text for r in reader.generate(summaries)])

    worker = threading.Thread(target=consolidate)
    worker.start()
    assert backend.inside.wait(10)  # the consolidation's first chunk is being generated
    answering = threading.Thread(target=lambda: made.append([r.text for r in reader.generate([_req("a?")])]))
    answering.start()
    for _ in range(1000):  # until the answer waits for the reader
        if reader._waiting:
            break
        threading.Event().wait(0.01)
    backend.release.set()
    worker.join(10)
    answering.join(10)
    assert backend.asked == [["s0", "s1"], ["a?"], ["s2", "s3"], ["s4", "s5"]]
    assert sorted(made) == [["a?"], [f"s{i}" for i in range(6)]]  # every response to its own caller, in order
    assert reader.ledger.roles["summary"].calls == 6 and len(reader.cache) == 7
    with background_calls():  # a lone caller's background work: every chunk, no turn waited for
        assert [r.text for r in reader.generate(summaries)] == [f"s{i}" for i in range(6)]
    reader.close()


class _FailsAfter(_Echo):
    """_Echo that raises on its `fail_on`-th call, after answering the calls before it."""

    def __init__(self, fail_on: int) -> None:
        super().__init__()
        self.fail_on = fail_on

    def generate(self, requests):  # noqa: ANN001, ANN201
        if len(self.calls) + 1 == self.fail_on:
            self.calls.append(len(requests))
            raise RuntimeError("the reader died")
        return super().generate(requests)


def _paid(ledger: Ledger) -> tuple[int, int, int, int]:
    answer = ledger.roles["answer"]
    return answer.calls, answer.cached, answer.input_tokens, answer.output_tokens


def test_the_ledger_is_rebuilt_from_what_was_committed_whatever_stopped_the_run(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A kill after a batch's cache commit and before ledger.json, a reader failure after some
    answers, or a full disk at the ledger save lost calls the reader had made (a rerun reported them as
    cache hits). Each response's ledger entry is committed with it; `load_ledger` rebuilds from those."""
    from memfit_gpu import faults
    from memfit_gpu.faults import IO_FAULT_ENV
    from memfit_gpu.files import StorageError
    from memfit_gpu.readers.reader import load_ledger

    requests = [_req(f"q{i}?", key=f"k{i}") for i in range(6)]
    cache_path = tmp_path / "cache.sqlite"

    # a kill after the first batch's commit, before anything saved ledger.json
    reader = Reader(_Echo(), ResponseCache(cache_path), load_ledger(tmp_path), 8, 0.0, progress=False)
    first = next(reader.generate_batches(requests, batch_size=2))
    assert [i for i, _ in first] == [0, 1]
    reader.cache.close()  # type: ignore[union-attr]
    assert not (tmp_path / "ledger.json").exists()
    assert _paid(load_ledger(tmp_path)) == (2, 0, 6, 2)

    # a reader that fails after answering one more batch
    reader = Reader(_FailsAfter(2), ResponseCache(cache_path), load_ledger(tmp_path), 8, 0.0, progress=False)
    with pytest.raises(RuntimeError, match="the reader died"):
        list(reader.generate_batches(requests, batch_size=2))
    reader.cache.close()  # type: ignore[union-attr]
    rebuilt = load_ledger(tmp_path)
    assert _paid(rebuilt) == (4, 0, 12, 4)  # k0, k1 re-served (accounted), k2, k3 answered, then the failure
    assert rebuilt.answer_keys == ["k0", "k1", "k2", "k3"]

    # a full disk at the ledger save: the save fails naming the file, and nothing is lost
    monkeypatch.setenv(IO_FAULT_ENV, "ledger.json:ENOSPC")
    faults.reset()
    with pytest.raises(StorageError, match=r"ledger\.json: writing failed: No space left on device .*\(ENOSPC\); "
                                           r"free space on its file system, then rerun the same command"):
        rebuilt.save(tmp_path / "ledger.json")
    monkeypatch.delenv(IO_FAULT_ENV)
    assert not (tmp_path / "ledger.json").exists() and not temporaries(tmp_path / "ledger.json")

    # the rerun: what was committed is served again without counting, the rest is answered
    backend = _Echo()
    reader = Reader(backend, ResponseCache(cache_path), load_ledger(tmp_path), 8, 0.0, progress=False)
    out = reader.generate(requests)
    assert [r.cached for r in out] == [True] * 4 + [False] * 2 and backend.calls == [2]
    assert _paid(reader.ledger) == (6, 0, 18, 6)
    reader.ledger.check_one_answer_per_question([r.key for r in requests])
    reader.ledger.save(tmp_path / "ledger.json")
    reader.cache.close()  # type: ignore[union-attr]
    assert _paid(load_ledger(tmp_path)) == (6, 0, 18, 6)
    # a question answered twice within one process is still one too many, in the live and the rebuilt ledger
    reader = Reader(_Echo(), ResponseCache(cache_path), load_ledger(tmp_path), 8, 0.0, progress=False)
    reader.generate(requests[:1])
    reader.generate(requests[:1])
    for ledger in (reader.ledger, load_ledger(tmp_path)):
        with pytest.raises(LedgerCheckError, match=r"more than one answer call: \['k0 x2'\]"):
            ledger.check_one_answer_per_question([r.key for r in requests])


def test_a_cache_without_entries_starts_from_the_ledger_json_it_had(tmp_path: Path) -> None:
    """A directory an older memfit wrote (or whose damaged cache was deleted): its ledger.json's counts are
    the base, kept in the new cache, and new calls add to them."""
    from memfit_gpu.readers.reader import load_ledger

    old = Ledger()
    old.record("answer", "k0", Response("x", 40, 4, 0.5, False, "echo"), backend="echo")
    old.add_wall("answer", 3.0)
    old.save(tmp_path / "ledger.json")
    reader = Reader(_Echo(), ResponseCache(tmp_path / "cache.sqlite"), load_ledger(tmp_path), 8, 0.0, progress=False)
    reader.generate([_req("q1?", key="k1")])
    reader.cache.close()  # type: ignore[union-attr]
    rebuilt = load_ledger(tmp_path)
    assert _paid(rebuilt) == (2, 0, 43, 5) and rebuilt.answer_keys == ["k0", "k1"]
    assert rebuilt.roles["answer"].wall_s == 3.0  # wall time comes from the last ledger.json saved
