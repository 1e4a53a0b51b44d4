"""The execution plan both packed encoders share (`BatchedEncoder`).

- all inputs are tokenised once into one flat id array with row offsets (no per-row Python lists), then
  sorted by their exact token count (longest first, so an out-of-memory shows up on the first batch);
- a batch holds at most `batch_size` rows and `max_batch_tokens` padded tokens (rows x its own longest
  row): 2,048 on a CPU (activations that stay in cache run faster than large batches: measured, 16-32
  rows of ~64 tokens beat 256 rows), 65,536 on a GPU (a MiniLM batch of 128 short texts is well under a
  millisecond of GPU work, less than the Python around it); padding is built with vectorised gathers;
- on a GPU the inputs go through pinned host memory with non-blocking copies, the packed path gets its
  token positions from the host (no `nonzero` sync), and a batch's result comes back through a pinned
  buffer while the next batch is collated and launched (one batch in flight per device);
- one model replica per device, fed from a shared queue: by one thread per device in this process
  (`workers="threads"`), or by one process per device (`workers="processes"`, workers.py), which takes
  the collation and dispatch of each device off this process's GIL; `auto` = processes for 2+ GPUs;
- on CUDA out-of-memory the device halves its batch size and retries the same rows;
- results are written back in the caller's order.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from enum import Enum
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from memfit_gpu.devices import is_oom
from memfit_gpu.index.encoders.packed_bert import FLAT_KEY
from memfit_gpu.index.encoders.tokens import Tokens
from memfit_gpu.index.encoders.workers import ProcessPool
from memfit_gpu.models import ResolvedModel

logger = logging.getLogger(__name__)

# Rows x padded width per forward on the CPU; ~2k tokens keeps MiniLM's activations cache-resident.
CPU_BATCH_TOKENS = 2048
# ... and on a GPU: enough work per launch sequence to hide the host side (memfit plan counts it).
GPU_BATCH_TOKENS = 65536

Forward = Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.Tensor]


def plan_batches(order: Sequence[int], lengths: Sequence[int], batch_size: int,
                 max_tokens: int | None) -> list[list[int]]:
    """Cut the longest-first `order` into batches of at most `batch_size` rows and `max_tokens` padded
    tokens (a batch's width is its first, longest row); a row longer than the budget goes alone."""
    batches: list[list[int]] = []
    current: list[int] = []
    for row in order:
        width = lengths[current[0]] if current else lengths[row]
        if current and (len(current) >= batch_size
                        or (max_tokens is not None and (len(current) + 1) * width > max_tokens)):
            batches.append(current)
            current = []
        current.append(row)
    if current:
        batches.append(current)
    return batches


def default_batch_tokens(devices: Sequence[torch.device]) -> int:
    """The token budget of a batch when none is configured: cache-sized on CPUs, large on GPUs."""
    return CPU_BATCH_TOKENS if all(d.type == "cpu" for d in devices) else GPU_BATCH_TOKENS


class Workers(str, Enum):
    """How replicas on several devices are fed (`index.encoder_workers`)."""

    AUTO = "auto"
    THREADS = "threads"
    PROCESSES = "processes"

    @classmethod
    def resolve(cls, value: str | Workers, devices: Sequence[torch.device]) -> Workers:
        """`auto`: one process per device for two or more GPUs (threads share one GIL for the collation
        and dispatch of every device), threads otherwise (one device needs neither)."""
        try:
            chosen = cls(value)
        except ValueError:
            raise ValueError(f"index.encoder_workers={value!r} is not one of "
                             f"{', '.join(w.value for w in cls)}") from None
        if chosen is cls.AUTO:
            gpus = sum(1 for d in devices if d.type == "cuda")
            return cls.PROCESSES if gpus >= 2 else cls.THREADS
        return chosen


class BatchedEncoder(torch.nn.Module):
    """Shared plan: tokenise once, sort by length, pad per batch, spread batches over replicas.

    Subclasses say whether their packed path reproduces `model` (`_fast_path_supported`), give the
    forward that `_run` calls per batch, and the constructor arguments a worker process needs to build
    the same encoder on its device (`_replica_kwargs`)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, max_length: int,
                 devices: Sequence[torch.device], dtype: torch.dtype,
                 loaded_from: ResolvedModel | None, batch_tokens: int = 0,
                 workers: str | Workers = Workers.AUTO) -> None:
        super().__init__()
        self.model = model.to(device=devices[0], dtype=dtype).eval()
        self.tokenizer = tokenizer
        self.max_length = int(max_length)
        self.devices = list(devices)
        self.dtype = dtype
        self.loaded_from = loaded_from
        self.workers = Workers.resolve(workers, self.devices)
        # Replicas live in a plain list: registering them would duplicate every parameter in state_dict.
        # With worker processes each process holds its own copy; this one keeps the first for forward().
        extra = self.devices[1:] if self.workers is Workers.THREADS else []
        self._replicas: list[torch.nn.Module] = [self.model] + [copy.deepcopy(self.model).to(d).eval() for d in extra]
        self._pool: ProcessPool | None = None  # started on the first multi-device encode
        self._input_names = [n for n in tokenizer.model_input_names if n in ("input_ids", "attention_mask",
                                                                                "token_type_ids")]
        pad = tokenizer.pad_token_id
        self._pad_id = 0 if pad is None else int(pad)
        self._padding_right = getattr(tokenizer, "padding_side", "right") != "left"
        # The packed path (no work on padding) when the architecture is one it reproduces exactly;
        # other architectures run through their own transformers forward.
        self.fast_path = bool(self._padding_right and self._fast_path_supported(self.model))
        if batch_tokens < 0:
            raise ValueError(f"batch_tokens must be >= 0 (0 = by device), got {batch_tokens}")
        self.max_batch_tokens: int | None = int(batch_tokens) or default_batch_tokens(self.devices)

    def _fast_path_supported(self, model: torch.nn.Module) -> bool:
        return False

    def _replica_kwargs(self) -> dict[str, Any]:
        """Constructor arguments beyond model, tokenizer, max_length, devices, dtype, loaded_from,
        batch_tokens and workers (a worker process builds `type(self)(...)` from them)."""
        return {}

    @property
    def device(self) -> torch.device:
        return self.devices[0]

    def info(self) -> dict[str, Any]:
        """What encoded: the weights that loaded, the compute dtype, the devices (recorded in outputs)."""
        weights = self.loaded_from.to_dict() if self.loaded_from is not None else {}
        return {**weights, "encoder_backend": "packed", "dtype": str(self.dtype).removeprefix("torch."),
                "devices": [str(d) for d in self.devices], "packed_bert": self.fast_path,
                "workers": self.workers.value, "batch_tokens": self.max_batch_tokens}

    def close(self) -> None:
        """Stop the worker processes, if any were started (they also stop when this process exits)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    # -- tokenisation --------------------------------------------------------------------------
    def _tokenize(self, first: list[str], second: list[str] | None) -> Tokens:
        encoded = self.tokenizer(
            first, second, padding=False, truncation="longest_first" if second is not None else True,
            max_length=self.max_length, return_attention_mask=False,
            return_token_type_ids="token_type_ids" in self._input_names,
        )
        # present only when asked for above
        return Tokens.from_lists(encoded["input_ids"], encoded.get("token_type_ids"))

    def _collate(self, tokens: Tokens, rows: Sequence[int], device: torch.device) -> dict[str, torch.Tensor]:
        """Pad the rows to their own longest length with vectorised gathers; on a GPU through pinned
        memory, copied without blocking; the packed path's token positions computed here."""
        rows = np.asarray(rows, dtype=np.int64)
        lengths = tokens.lengths[rows]
        width = int(lengths.max())
        columns = np.arange(width)[None, :]
        if self._padding_right:
            real = columns < lengths[:, None]
            source = tokens.offsets[rows][:, None] + columns
        else:
            real = columns >= (width - lengths)[:, None]
            source = tokens.offsets[rows][:, None] + columns - (width - lengths)[:, None]
        source = np.where(real, source, 0)

        def padded(field: np.ndarray, fill: int) -> torch.Tensor:
            return torch.from_numpy(np.where(real, field[source], fill))

        batch = {"input_ids": padded(tokens.ids, self._pad_id), "attention_mask": torch.from_numpy(real.astype(np.int64))}
        if tokens.types is not None:
            batch["token_type_ids"] = padded(tokens.types, 0)
        if self.fast_path:
            batch[FLAT_KEY] = torch.from_numpy(np.flatnonzero(real.reshape(-1)))
        if device.type == "cuda":
            return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}
        return {k: v.to(device) for k, v in batch.items()}

    # -- execution -----------------------------------------------------------------------------
    def _batches(self, tokens: Tokens, batch_size: int) -> list[list[int]]:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        lengths = tokens.lengths
        order = np.argsort(-lengths, kind="stable").tolist()
        return plan_batches(order, lengths.tolist(), batch_size, self.max_batch_tokens)

    def _forward_rows(self, replica: torch.nn.Module, device: torch.device, tokens: Tokens, rows: list[int],
                      size: list[int], forward: Forward) -> Iterator[tuple[list[int], torch.Tensor]]:
        """Forward `rows` in chunks of at most size[0] rows: (chunk, its result on `device`) each. On CUDA
        out-of-memory size[0] is halved (for the rest of this device's work) and the chunk retried."""
        start = 0
        while start < len(rows):
            chunk = rows[start:start + size[0]]
            try:
                with torch.inference_mode():
                    result = forward(replica, self._collate(tokens, chunk, device))
            except Exception as exc:
                if not (device.type == "cuda" and is_oom(exc)) or len(chunk) == 1:
                    raise
                del exc
                torch.cuda.empty_cache()
                size[0] = max(1, len(chunk) // 2)
                logger.warning("CUDA out of memory on %s: batch size halved to %d", device, size[0])
                continue
            yield chunk, result
            start += len(chunk)

    def _device_loop(self, replica: torch.nn.Module, device: torch.device, tokens: Tokens,
                     next_rows: Callable[[], list[int] | None], batch_size: int, forward: Forward,
                     deliver: Callable[[list[int], torch.Tensor], None]) -> None:
        """Run every batch `next_rows` hands out on one device; `deliver(chunk, float32 CPU result)`.

        On a GPU a result comes back through pinned memory without blocking, and is delivered only after
        the next chunk has been launched: the host collates while the device computes."""
        size = [batch_size]
        pending: tuple[list[int], torch.Tensor, torch.cuda.Event | None] | None = None

        def finish() -> None:
            chunk, host, event = pending
            if event is not None:
                event.synchronize()
            deliver(chunk, host)

        while (rows := next_rows()) is not None:
            for chunk, result in self._forward_rows(replica, device, tokens, rows, size, forward):
                if result.is_cuda:
                    host = torch.empty(result.shape, dtype=torch.float32, pin_memory=True)
                    host.copy_(result.float(), non_blocking=True)
                    event = torch.cuda.Event()
                    event.record()
                    current = (chunk, host, event)
                else:
                    current = (chunk, result.float().cpu(), None)
                if pending is not None:
                    finish()
                pending = current
        if pending is not None:
            finish()

    def _run(self, tokens: Tokens, batch_size: int, forward: Forward, out: torch.Tensor, progress: bool,
             desc: str) -> torch.Tensor:
        """Fill `out[row]` for every row, longest inputs first, one worker per replica."""
        batches = self._batches(tokens, batch_size)
        if not batches:
            return out
        bar = tqdm(total=len(tokens), desc=desc, disable=not progress, unit="item")
        lock = threading.Lock()

        def deliver(chunk: list[int], result: torch.Tensor) -> None:
            out[torch.as_tensor(chunk)] = result
            with lock:
                bar.update(len(chunk))

        try:
            if len(self.devices) > 1 and self.workers is Workers.PROCESSES:
                self._process_pool().run(tokens, batches, batch_size, forward.__name__, deliver)
            elif len(self._replicas) == 1:
                remaining = iter(batches)
                self._device_loop(self._replicas[0], self.devices[0], tokens, lambda: next(remaining, None),
                                  batch_size, forward, deliver)
            else:
                self._run_threads(tokens, batches, batch_size, forward, deliver)
        finally:
            bar.close()
        return out

    def _process_pool(self) -> ProcessPool:
        if self._pool is None:
            self._pool = ProcessPool(self)
        return self._pool

    def _run_threads(self, tokens: Tokens, batches: list[list[int]], batch_size: int, forward: Forward,
                     deliver: Callable[[list[int], torch.Tensor], None]) -> None:
        pending: queue.Queue[list[int]] = queue.Queue()
        for rows in batches:
            pending.put(rows)
        errors: list[BaseException] = []

        def next_rows() -> list[int] | None:
            if errors:
                return None
            try:
                return pending.get_nowait()
            except queue.Empty:
                return None

        def worker(replica: torch.nn.Module, device: torch.device) -> None:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            try:
                self._device_loop(replica, device, tokens, next_rows, batch_size, forward, deliver)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(r, d), daemon=True)
                   for r, d in zip(self._replicas, self.devices, strict=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
