"""The execution plan both packed encoders share (`BatchedEncoder`).

- all inputs are tokenised once, unpadded, then sorted by their exact token count (longest first, so
  an out-of-memory shows up on the first batch, not the last);
- each batch is padded only to its own longest row, so a length-sorted batch wastes almost no work
  (a subclass may go further and skip padding altogether: see packed_bert.py);
- on the CPU a batch is also capped at `max_batch_tokens` (rows x padded width): activations that
  stay in cache run faster than large batches (measured: 16-32 rows of ~64 tokens beat 256 rows);
- one model replica per visible device; batches are handed to the devices from a shared queue by one
  thread per device (the GIL is released inside kernels);
- on CUDA out-of-memory the device halves its batch size and retries the same rows;
- results are written back in the caller's order.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from memfit_gpu.models import ResolvedModel

logger = logging.getLogger(__name__)

# Rows x padded width per forward on the CPU; ~2k tokens keeps MiniLM's activations cache-resident.
CPU_BATCH_TOKENS = 2048

# Allocation failures surface from cuBLAS / cuDNN handles as plain RuntimeErrors with these texts.
_OOM_TEXTS = ("out of memory", "cublas_status_alloc_failed", "cudnn_status_alloc_failed",
              "cudnn_status_not_initialized", "cuda error: out of memory")

Tokens = dict[str, list[list[int]]]
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


def padding_mask(lengths: Sequence[int], width: int, right: bool) -> torch.Tensor:
    """Attention mask [len(lengths), width] (long): 1 on real tokens, padded on the right or the left."""
    positions = torch.arange(width).unsqueeze(0)
    n = torch.tensor(lengths).unsqueeze(1)
    mask = positions < n if right else positions >= (width - n)
    return mask.long()


def is_oom(exc: BaseException) -> bool:
    """Whether `exc` is a device running out of memory (torch's own error or a CUDA library's)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(t in text for t in _OOM_TEXTS)


class BatchedEncoder(torch.nn.Module):
    """Shared plan: tokenise once, sort by length, pad per batch, spread batches over replicas.

    Subclasses say whether their packed path reproduces `model` (`_fast_path_supported`) and give the
    forward that `_run` calls per batch."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, max_length: int,
                 devices: Sequence[torch.device], dtype: torch.dtype,
                 loaded_from: ResolvedModel | None) -> None:
        super().__init__()
        self.model = model.to(device=devices[0], dtype=dtype).eval()
        self.tokenizer = tokenizer
        self.max_length = int(max_length)
        self.devices = list(devices)
        self.dtype = dtype
        self.loaded_from = loaded_from
        # Replicas live in a plain list: registering them would duplicate every parameter in state_dict.
        self._replicas: list[torch.nn.Module] = [self.model] + [
            copy.deepcopy(self.model).to(d).eval() for d in self.devices[1:]
        ]
        self._input_names = [n for n in tokenizer.model_input_names if n in ("input_ids", "attention_mask",
                                                                                "token_type_ids")]
        pad = tokenizer.pad_token_id
        self._pad_id = 0 if pad is None else int(pad)
        self._padding_right = getattr(tokenizer, "padding_side", "right") != "left"
        # The packed path (no work on padding) when the architecture is one it reproduces exactly;
        # other architectures run through their own transformers forward.
        self.fast_path = bool(self._padding_right and self._fast_path_supported(self.model))
        # GPUs want the largest batch that fits (OOM halves it); CPUs want cache-sized ones.
        self.max_batch_tokens: int | None = (
            CPU_BATCH_TOKENS if all(d.type == "cpu" for d in self.devices) else None
        )

    def _fast_path_supported(self, model: torch.nn.Module) -> bool:
        return False

    @property
    def device(self) -> torch.device:
        return self.devices[0]

    def info(self) -> dict[str, Any]:
        """What encoded: the weights that loaded, the compute dtype, the devices (recorded in outputs)."""
        weights = self.loaded_from.to_dict() if self.loaded_from is not None else {}
        return {**weights, "dtype": str(self.dtype).removeprefix("torch."),
                "devices": [str(d) for d in self.devices], "packed_bert": self.fast_path}

    # -- tokenisation --------------------------------------------------------------------------
    def _tokenize(self, first: list[str], second: list[str] | None) -> Tokens:
        encoded = self.tokenizer(
            first, second, padding=False, truncation="longest_first" if second is not None else True,
            max_length=self.max_length, return_attention_mask=False,
            return_token_type_ids="token_type_ids" in self._input_names,
        )
        return {k: encoded[k] for k in ("input_ids", "token_type_ids") if k in encoded}

    def _collate(self, tokens: Tokens, rows: Sequence[int], device: torch.device) -> dict[str, torch.Tensor]:
        """Pad the rows to their own longest length (one tensor build per field)."""
        ids = tokens["input_ids"]
        lengths = [len(ids[r]) for r in rows]
        width = max(lengths)

        def padded(field: list[list[int]], fill: int) -> torch.Tensor:
            if self._padding_right:
                rows_out = [field[r] + [fill] * (width - n) for r, n in zip(rows, lengths, strict=True)]
            else:
                rows_out = [[fill] * (width - n) + field[r] for r, n in zip(rows, lengths, strict=True)]
            return torch.tensor(rows_out, dtype=torch.long)

        batch = {"input_ids": padded(ids, self._pad_id)}
        batch["attention_mask"] = padding_mask(lengths, width, self._padding_right)
        if "token_type_ids" in tokens and "token_type_ids" in self._input_names:
            batch["token_type_ids"] = padded(tokens["token_type_ids"], 0)
        non_blocking = device.type == "cuda"
        return {k: v.to(device, non_blocking=non_blocking) for k, v in batch.items()}

    # -- execution -----------------------------------------------------------------------------
    def _run(self, tokens: Tokens, batch_size: int, forward: Forward, out: torch.Tensor, progress: bool,
             desc: str) -> torch.Tensor:
        """Fill `out[row]` for every row, longest inputs first, one worker per replica."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        n = len(tokens["input_ids"])
        if n == 0:
            return out
        order = sorted(range(n), key=lambda r: -len(tokens["input_ids"][r]))
        batches = plan_batches(order, [len(ids) for ids in tokens["input_ids"]], batch_size,
                               self.max_batch_tokens)
        bar = tqdm(total=n, desc=desc, disable=not progress, unit="item")
        lock = threading.Lock()

        def work(replica: torch.nn.Module, device: torch.device, rows: list[int], size: list[int]) -> None:
            start = 0
            while start < len(rows):
                chunk = rows[start:start + size[0]]
                try:
                    with torch.inference_mode():
                        result = forward(replica, self._collate(tokens, chunk, device))
                except Exception as exc:
                    if not (device.type == "cuda" and is_oom(exc)) or size[0] == 1:
                        raise
                    del exc
                    torch.cuda.empty_cache()
                    size[0] = max(1, size[0] // 2)
                    logger.warning("CUDA out of memory on %s: batch size halved to %d", device, size[0])
                    continue
                out[torch.tensor(chunk)] = result.float().cpu()
                start += len(chunk)
                with lock:
                    bar.update(len(chunk))

        try:
            if len(self._replicas) == 1:
                size = [batch_size]
                for rows in batches:
                    work(self._replicas[0], self.devices[0], rows, size)
            else:
                self._run_threads(batches, batch_size, work)
        finally:
            bar.close()
        return out

    def _run_threads(self, batches: list[list[int]], batch_size: int,
                     work: Callable[[torch.nn.Module, torch.device, list[int], list[int]], None]) -> None:
        pending: queue.Queue[list[int]] = queue.Queue()
        for rows in batches:
            pending.put(rows)
        errors: list[BaseException] = []

        def worker(replica: torch.nn.Module, device: torch.device) -> None:
            size = [batch_size]  # each device halves its own size on OOM
            if device.type == "cuda":
                torch.cuda.set_device(device)
            try:
                while not errors:
                    try:
                        rows = pending.get_nowait()
                    except queue.Empty:
                        return
                    work(replica, device, rows, size)
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
