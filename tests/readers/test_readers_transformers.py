"""The transformers reader on the real SmolLM2-135M-Instruct weights, behind the real cache and ledger."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from memfit_gpu import onednn
from memfit_gpu.config import ConfigError, ReaderConfig, load_config
from memfit_gpu.readers.cache import ResponseCache
from memfit_gpu.readers.ledger import Ledger
from memfit_gpu.readers.prompts import bounded_answer_messages, build_answer_messages
from memfit_gpu.readers.reader import Reader, make_reader
from memfit_gpu.readers.registry import REGISTRY, BackendEntry, backend_class, make_backend, require
from memfit_gpu.readers.types import Backend, MissingBackendError, Request, Response

SMOKE = Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml"
QUESTIONS = [
    "What is the capital of France?",
    "Answer in one word. Which planet do we live on? Please keep the answer very short and do not explain.",
    "What is the capital of France?",  # the same request twice: generated once
    "Say hello.",
]


class Counting(Backend):
    """The real backend, counting the requests that reach it; optionally dying after some calls (a kill)."""

    def __init__(self, inner: Backend, die_after_calls: int | None = None) -> None:
        super().__init__(inner.cfg)
        self.inner = inner
        self.name, self.model, self.gpus = inner.name, inner.model, inner.gpus
        self.chunk_size = inner.chunk_size
        self.requests_seen = 0
        self.calls = 0
        self.die_after_calls = die_after_calls

    def generate(self, requests: Sequence[Request]) -> list[Response]:
        if self.die_after_calls is not None and self.calls >= self.die_after_calls:
            raise KeyboardInterrupt("run killed")
        self.calls += 1
        self.requests_seen += len(requests)
        return self.inner.generate(requests)


def _requests() -> list[Request]:
    return [Request([{"role": "user", "content": q}], "answer", max_new_tokens=8, key=f"q{i}")
            for i, q in enumerate(QUESTIONS)]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("run")


@pytest.fixture(scope="module")
def smollm_reader(run_dir: Path) -> Reader:
    import torch

    # On a shared 2-core machine two OpenMP threads spin against other processes (10x slower here).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    reader = make_reader(ReaderConfig(backend="transformers", batch_size=2, max_new_tokens=8), run_dir,
                         progress=False)
    yield reader
    reader.close()
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_killed_run_resumes_and_rerun_makes_no_calls(smollm_reader: Reader, run_dir: Path) -> None:
    backend = smollm_reader.backend
    cache_path = run_dir / "cache.sqlite"
    assert smollm_reader.cache is not None and smollm_reader.cache.path == cache_path

    # 1. A run killed after its first chunk: that chunk (2 calls) is committed, nothing else.
    dying = Counting(backend, die_after_calls=1)
    dying.chunk_size = 2
    killed = Reader(dying, ResponseCache(cache_path), Ledger(), 8, 0.0, progress=False)
    with pytest.raises(KeyboardInterrupt):
        killed.generate(_requests())
    killed.cache.close()  # type: ignore[union-attr]
    with sqlite3.connect(cache_path) as conn:
        assert conn.execute("SELECT COUNT(*) FROM responses").fetchone()[0] == 2

    # 2. The resumed run generates only what is missing; the repeated question is generated once at most.
    resumed_backend = Counting(backend)
    resumed = Reader(resumed_backend, ResponseCache(cache_path), Ledger(), 8, 0.0, progress=False)
    out = resumed.generate(_requests())
    assert resumed_backend.requests_seen == 1 and resumed_backend.calls == 1
    assert [r.cached for r in out] == [True, True, True, False]
    # Answers come back in the caller's order despite length-sorted batches.
    assert "Paris" in out[0].text and out[2].text == out[0].text
    assert "Paris" not in out[1].text and "Paris" not in out[3].text
    for r in out:
        assert 1 <= r.output_tokens <= 8 and r.model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    ids = backend.tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        [{"role": "user", "content": QUESTIONS[3]}], add_generation_prompt=True)
    assert out[3].input_tokens == len(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert resumed.ledger.roles["answer"].calls == 1 and resumed.ledger.roles["answer"].cached == 3
    resumed.cache.close()  # type: ignore[union-attr]

    # 3. A rerun through make_reader's own reader (config defaults fill max_new_tokens=8, so the keys match):
    #    zero backend calls, identical texts, every answer counted once.
    rerun_requests = [Request(r.messages, r.role, key=r.key) for r in _requests()]
    counted = Counting(backend)
    smollm_reader.backend = counted
    try:
        again = smollm_reader.generate(rerun_requests)
    finally:
        smollm_reader.backend = backend
    assert counted.requests_seen == 0
    assert [r.text for r in again] == [r.text for r in out]
    assert all(r.cached for r in again)
    assert smollm_reader.ledger.roles["answer"].calls == 0 and smollm_reader.ledger.roles["answer"].cached == 4
    smollm_reader.ledger.check_one_answer_per_question(["q0", "q1", "q2", "q3"])

    # 4. A new process's reader (the fixture's configuration) over the same run: every answer from the cache,
    #    the weights never loaded; the prompt limit is known without them.
    fresh = make_reader(ReaderConfig(backend="transformers", batch_size=2, max_new_tokens=8), run_dir, progress=False)
    try:
        assert [r.text for r in fresh.generate(rerun_requests)] == [r.text for r in out]
        assert fresh.prompt_token_limit()[0] == 8192  # type: ignore[index]
        assert fresh.backend.net is None  # type: ignore[attr-defined]
    finally:
        fresh.close()


@pytest.mark.slow
def test_a_prompt_past_the_model_context_is_cut_to_fit(smollm_reader: Reader) -> None:
    """SmolLM2 knows 8,192 positions: excerpts of ~30k tokens are cut to the longest prefix that fits, counted with
    the model's own chat template, instead of sending a prompt it cannot read (nor allocate attention for)."""
    context, count = smollm_reader.prompt_token_limit()  # type: ignore[misc]
    assert context == 8192
    message = [{"role": "user", "content": QUESTIONS[3]}]
    assert count(message) == len(smollm_reader.backend._prompt_ids(Request(message)))  # type: ignore[attr-defined]
    excerpts = "\n".join(f"EXCERPT {i} (recorded 8 May 2023): Speaker Ann says: the blue heron flew over the "
                         f"lake at dawn number {i}." for i in range(1, 3001))
    messages, cut = bounded_answer_messages("What flew over the lake?", excerpts, None, "1",
                                            max_prompt_chars=1_000_000, token_limit=(context, count))
    kept = len(excerpts) - cut
    assert 0 < kept < len(excerpts) and count(messages) <= context
    note = (f"\n[... {cut:,} more characters of excerpts cut: the reader's context less reader.max_new_tokens "
            f"(8,192 prompt tokens)]")
    assert messages == build_answer_messages("What flew over the lake?", excerpts[:kept] + note, None, "1")
    longer = build_answer_messages("What flew over the lake?", excerpts[: kept + 1] + note, None, "1")
    assert count(longer) > context  # the longest prefix that fits was kept


@pytest.mark.slow
def test_transformers_reader_is_text_only(smollm_reader: Reader) -> None:
    with pytest.raises(ValueError, match="text-only"):
        smollm_reader.generate([Request([{"role": "user", "content": "x"}], "answer", images=["a.png"], key="q")])


def test_missing_backend_package_is_named() -> None:
    with pytest.raises(MissingBackendError, match="'vllm_not_installed_anywhere'.*pip install it"):
        require("vllm_not_installed_anywhere", "vllm", "pip install it")
    with pytest.raises(ValueError, match="base_urls"):
        make_backend(ReaderConfig(backend="openai", base_urls=[]))
    with pytest.raises(ValueError, match="'llama' is not one of transformers, vllm, openai"):
        make_backend(ReaderConfig(backend="llama"))


@pytest.mark.slow
def test_a_request_without_sampling_settings_gets_the_readers_config(smollm_reader: Reader) -> None:
    """Called directly (no Reader to fill it), the backend takes reader.max_new_tokens (8 in this config), the
    one default there is, not a number of its own: a long count stops at exactly 8 tokens."""
    backend = smollm_reader.backend
    ask = [{"role": "user", "content": "Count from 1 to 100, separated by commas."}]
    assert backend.sampling(Request(ask, "answer")) == (8, 0.0)
    assert backend.sampling(Request(ask, "answer", max_new_tokens=3, temperature=0.5)) == (3, 0.5)
    out = backend.generate([Request(ask, "answer", key="count")])
    assert out[0].output_tokens == 8
    assert out[0].text == backend.generate([Request(ask, "answer", max_new_tokens=8, temperature=0.0)])[0].text


@pytest.mark.slow
def test_sampled_answers_follow_reader_seed(smollm_reader: Reader) -> None:
    """temperature > 0 samples from reader.seed: the same seed gives the same texts whatever the global RNG
    did in between; the configured seed is what the backend uses."""
    backend = smollm_reader.backend
    asks = [Request([{"role": "user", "content": f"Write a word that rhymes with {w}."}], "answer",
                    max_new_tokens=12, temperature=1.5, key=w) for w in ("cat", "tree", "moon", "rain")]
    first = [r.text for r in backend.generate(asks)]
    torch.rand(1000)  # the global generator moves on
    assert [r.text for r in backend.generate(asks)] == first
    seeds = []
    for seed in (1, 2, 3):
        backend.cfg.seed = seed
        seeds.append([r.text for r in backend.generate(asks)])
    backend.cfg.seed = 0
    assert len({tuple(texts) for texts in [first, *seeds]}) > 1  # four seeds, one sampled text set: not sampling


@pytest.mark.slow
def test_a_bf16_reader_on_the_cpu_packs_its_linear_layers_once_and_answers_to_the_same_bits() -> None:
    """reader.dtype=bf16 on the CPU: every linear layer of SmolLM2 (7 in each of its 30 blocks, and the head)
    runs through oneDNN with its weight packed at load; the logits of a prompt and the greedy answers are
    those of the same model through F.linear, bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    backend = make_backend(ReaderConfig(backend="transformers", dtype="bf16", batch_size=2, max_new_tokens=12))
    try:
        backend.load()
        net = backend.net  # type: ignore[attr-defined]
        layers = [m for m in net.modules() if isinstance(m, torch.nn.Linear)]
        if not onednn.available(torch.bfloat16):  # this torch build cannot pack: F.linear, and the log says why
            assert backend.linear == "torch" and all(type(m) is torch.nn.Linear for m in layers)  # type: ignore[attr-defined]
            return
        assert backend.linear == "oneDNN, packed weights (211 layers)"  # type: ignore[attr-defined]
        assert len(layers) == 211 and all(type(m) is onednn.PackedLinear for m in layers)
        requests = _requests()
        ids = torch.tensor([backend._prompt_ids(requests[0])])  # type: ignore[attr-defined]
        with torch.inference_mode():
            packed_logits = net(input_ids=ids).logits
        packed = [(r.text, r.output_tokens) for r in backend.generate(requests)]
        assert onednn.unpack_linears(net) == 211 and all(type(m) is torch.nn.Linear for m in layers)
        with torch.inference_mode():
            assert torch.equal(net(input_ids=ids).logits, packed_logits)
        assert [(r.text, r.output_tokens) for r in backend.generate(requests)] == packed
    finally:
        backend.close()
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_device_map_auto_places_the_reader_with_accelerate_and_answers_the_same(smollm_reader: Reader) -> None:
    """reader.device_map=auto hands placement to accelerate (here, without a GPU, all of it lands on the CPU,
    so no dispatch hooks are needed); the greedy answers are those of the reader placed whole on one device."""
    mapped = make_backend(ReaderConfig(backend="transformers", batch_size=2, max_new_tokens=8, device_map="auto"))
    try:
        mapped.load()
        assert (mapped.placement, mapped.device, mapped.gpus) == ({"": "cpu"}, "cpu", 0)  # type: ignore[attr-defined]
        whole = smollm_reader.backend
        whole.load()
        assert (whole.placement, whole.device, whole.gpus) == ({"": "cpu"}, "cpu", 0)  # type: ignore[attr-defined]
        requests = _requests()
        assert [r.text for r in mapped.generate(requests)] == [r.text for r in whole.generate(requests)]
    finally:
        mapped.close()
    with pytest.raises(ValueError, match="places the model itself: pass no device"):
        make_backend(ReaderConfig(backend="transformers", device_map="auto"), device="cpu")


def test_device_map_is_a_checked_choice() -> None:
    assert load_config(SMOKE, ["reader.device_map=auto"]).reader.device_map == "auto"
    assert load_config(SMOKE).reader.device_map is None
    with pytest.raises(ConfigError, match=r"reader\.device_map='balanced' is not one of null, auto"):
        load_config(SMOKE, ["reader.device_map=balanced"])


def test_registry_imports_each_backend_by_name() -> None:
    for name in ("transformers", "vllm", "openai"):
        cls = backend_class(name)
        assert issubclass(cls, Backend) and cls.name == name and cls.__module__ == f"memfit_gpu.readers.{name}"


def test_choosing_a_backend_imports_only_its_module() -> None:
    """The registry is lazy: choosing openai loads neither torch, transformers, vLLM nor the other backends."""
    code = ("import sys; from memfit_gpu.readers.registry import backend_class; backend_class('openai'); "
            "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'vllm') "
            "or m.startswith('memfit_gpu.readers.'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == ["memfit_gpu.readers.images", "memfit_gpu.readers.openai",
                                   "memfit_gpu.readers.registry", "memfit_gpu.readers.types"]


def test_a_registered_backend_whose_library_is_missing_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(REGISTRY, "llama", BackendEntry("memfit_gpu.readers.llama:LlamaBackend",
                                                        "llama_cpp_not_installed", "pip install llama-cpp-python"))
    with pytest.raises(MissingBackendError, match=r"reader backend 'llama' needs the Python package "
                                                  r"'llama_cpp_not_installed', which is not installed: pip install "
                                                  r"llama-cpp-python"):
        make_backend(ReaderConfig(backend="llama"))


def test_a_backend_must_implement_generate() -> None:
    class NoGenerate(Backend):
        name = "none"

    with pytest.raises(TypeError, match="abstract method 'generate'|abstract methods? generate"):
        NoGenerate(ReaderConfig())  # type: ignore[abstract]


@pytest.mark.slow
def test_a_long_system_prompt_is_read_once_and_answers_as_without_the_prefix_cache() -> None:
    """mem0 sends its long extraction prompt with every add: with reader.prefix_cache_min_tokens the system
    message's keys and values are computed once and each request reads only the rest. In float32 the replies are
    those of the whole-prompt path; a request takes the prefix path by what it is, not by what came before it
    (a fresh backend given one request alone computes what the warm one did), and a short system message or
    a prompt without one goes the batched way."""
    from memfit_gpu.readers.transformers import TransformersBackend

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rules = " ".join(f"Rule {i}: keep every fact about the user's {word} short and in the third person."
                         for i, word in enumerate(["family", "work", "travel", "health", "hobbies", "friends"] * 3))
        asks = ["Caroline: I went to a support group yesterday.", "Melanie: I painted a lake at sunrise.",
                "Caroline: My mother gave me a necklace from Sweden."]
        long_system = [Request([{"role": "system", "content": rules}, {"role": "user", "content": ask}],
                               max_new_tokens=12) for ask in asks]
        others = [Request([{"role": "system", "content": "Be brief."}, {"role": "user", "content": asks[0]}],
                          max_new_tokens=12),
                  Request([{"role": "user", "content": asks[1]}], max_new_tokens=12)]
        cfg = ReaderConfig(dtype="float32", batch_size=4, prefix_cache_min_tokens=256)
        cached = TransformersBackend(cfg)
        assert len(cached._system_prefix(long_system[0], cached._prompt_ids(long_system[0]))) >= 256
        replies = cached.generate([long_system[0], others[0], long_system[1], others[1], long_system[2]])
        assert (cached.prefix_reads, cached.prefix_served) == (1, 3)
        whole = TransformersBackend(ReaderConfig(dtype="float32", batch_size=4, prefix_cache_min_tokens=0))
        plain = whole.generate([long_system[0], others[0], long_system[1], others[1], long_system[2]])
        assert (whole.prefix_reads, whole.prefix_served) == (0, 0)
        assert [(r.text, r.input_tokens, r.output_tokens) for r in replies] == \
            [(r.text, r.input_tokens, r.output_tokens) for r in plain]
        assert all(r.text for r in replies)
        fresh = TransformersBackend(cfg)
        alone = fresh.generate([long_system[2]])[0]
        assert (fresh.prefix_reads, fresh.prefix_served) == (1, 1)
        assert (alone.text, alone.output_tokens) == (replies[4].text, replies[4].output_tokens)
    finally:
        torch.set_num_threads(threads)
