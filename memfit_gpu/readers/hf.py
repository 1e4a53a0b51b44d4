"""transformers backend: batched `generate` with any Hugging Face causal LM.

Prompts go through the model's chat template, are sorted by length so each batch pads little, are
left-padded (generation continues from the right edge), and come back in the caller's order.
Temperature 0 is greedy decoding.

A vision-language checkpoint (its config has a `vision_config`) is loaded with AutoProcessor +
AutoModelForImageTextToText instead; a request's images (local files) go into its last user message as
`{"type": "image"}` parts before the text, in order, and the processor expands them into image tokens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from memfit_gpu.devices import first_device, reader_dtype
from memfit_gpu.readers.base import Backend, PromptTokenLimit, Request, Response

logger = logging.getLogger(__name__)


def _param_groups(requests: Sequence[Request]) -> dict[tuple[int, float], list[int]]:
    """Request positions grouped by (max_new_tokens, temperature): one generate call shares both."""
    groups: dict[tuple[int, float], list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault((int(r.max_new_tokens or 64), float(r.temperature or 0.0)), []).append(i)
    return groups


def _generate_kwargs(max_new: int, temperature: float, pad_token_id: int) -> dict[str, Any]:
    """`generate` arguments: greedy at temperature 0 (sampling knobs cleared so no config default applies)."""
    kwargs: dict[str, Any] = {"max_new_tokens": max_new, "pad_token_id": pad_token_id}
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature)
    else:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    return kwargs


def _until_eos(row: list[int], eos_ids: set[int] | Sequence[int]) -> tuple[list[int], int]:
    """Generated ids up to the first stop token, and the output token count (the stop token counts too)."""
    kept: list[int] = []
    for tok in row:
        if tok in eos_ids:
            break
        kept.append(tok)
    return kept, len(kept) + (1 if len(kept) < len(row) else 0)


class TransformersBackend(Backend):
    name = "transformers"

    def __init__(self, cfg: Any, device: str | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from memfit_gpu import models

        self.model = cfg.model
        self.template_kwargs = dict(cfg.chat_template_kwargs)
        self.resolved = models.resolve("reader", cfg.model)
        self.device = device or str(first_device("auto"))
        self.gpus = 1 if self.device.startswith("cuda") else 0
        self.batch_size = max(1, int(cfg.batch_size))
        self.chunk_size = self.batch_size * 4
        start = time.perf_counter()
        from transformers import AutoConfig

        self.vision = getattr(AutoConfig.from_pretrained(self.resolved.path), "vision_config", None) is not None
        dtype = reader_dtype(cfg.dtype, self.device)
        if self.vision:
            from transformers import AutoModelForImageTextToText, AutoProcessor

            self.processor = AutoProcessor.from_pretrained(self.resolved.path)
            self.tokenizer = self.processor.tokenizer
            self.net = AutoModelForImageTextToText.from_pretrained(self.resolved.path, dtype=dtype).to(self.device)
        else:
            self.processor = None
            self.tokenizer = AutoTokenizer.from_pretrained(self.resolved.path)
            self.net = AutoModelForCausalLM.from_pretrained(self.resolved.path, dtype=dtype).to(self.device)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.net.eval()
        self.load_s = time.perf_counter() - start
        self._torch = torch
        logger.info("transformers reader %s loaded from %s on %s in %.1f s", cfg.model, self.resolved.path,
                    self.device, self.load_s)

    def _prompt_ids(self, request: Request) -> list[int]:
        if request.images:
            raise ValueError(
                f"request {request.key!r} has images, but {self.model} is a text-only model; "
                "use a vision-language model (its config has a vision_config)"
            )
        return self._chat_ids(request.messages)

    def _chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 **self.template_kwargs)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def prompt_token_limit(self) -> PromptTokenLimit | None:
        """The model's trained context (max_position_embeddings): a longer prompt is cut before it is sent,
        instead of running past the positions the model knows (and allocating attention for all of them)."""
        context = getattr(self.net.config, "max_position_embeddings", None)
        if self.vision or not context:
            return None
        return int(context), lambda messages: len(self._chat_ids(messages))

    def generate(self, requests: Sequence[Request]) -> list[Response]:
        if self.vision:
            return self._generate_vision(requests)
        torch = self._torch
        prompts = [self._prompt_ids(r) for r in requests]
        out: list[Response | None] = [None] * len(requests)
        eos_ids = self._eos_ids()
        # within a group, sort by length so padding is small
        for (max_new, temperature), members in _param_groups(requests).items():
            members = sorted(members, key=lambda i: len(prompts[i]))
            for b in range(0, len(members), self.batch_size):
                batch = members[b:b + self.batch_size]
                width = max(len(prompts[i]) for i in batch)
                pad = self.tokenizer.pad_token_id
                input_ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in batch])
                attention = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in batch])
                kwargs = _generate_kwargs(max_new, temperature, pad)
                start = time.perf_counter()
                with torch.inference_mode():
                    generated = self.net.generate(input_ids=input_ids.to(self.device),
                                                  attention_mask=attention.to(self.device), **kwargs)
                share = (time.perf_counter() - start) / len(batch)
                new_tokens = generated[:, width:].tolist()
                for row, i in zip(new_tokens, batch, strict=True):
                    kept, n_out = _until_eos(row, eos_ids)
                    text = self.tokenizer.decode(kept, skip_special_tokens=True).strip()
                    out[i] = Response(text, len(prompts[i]), n_out, share, False, self.model)
        return [r for r in out if r is not None]

    def _vision_text(self, request: Request) -> str:
        last_user = max((i for i, m in enumerate(request.messages) if m["role"] == "user"), default=None)
        if request.images and last_user is None:
            raise ValueError(f"request {request.key!r}: images need a user message to carry them")
        messages = []
        for i, m in enumerate(request.messages):
            parts: list[dict[str, Any]] = [{"type": "image"} for _ in request.images] if i == last_user else []
            parts.append({"type": "text", "text": m["content"]})
            messages.append({"role": m["role"], "content": parts})
        return self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                  **self.template_kwargs)

    def _load_images(self, request: Request) -> list[Any]:
        from PIL import Image

        images = []
        for path in request.images:
            if path.startswith(("http://", "https://", "data:")):
                raise ValueError(f"request {request.key!r}: the transformers reader reads local image files, not {path[:40]}")
            try:
                with Image.open(path) as img:
                    images.append(img.convert("RGB"))
            except FileNotFoundError:
                raise FileNotFoundError(f"request {request.key!r}: image {path} does not exist") from None
        return images

    def _generate_vision(self, requests: Sequence[Request]) -> list[Response]:
        torch = self._torch
        texts = [self._vision_text(r) for r in requests]
        out: list[Response | None] = [None] * len(requests)
        eos_ids = self._eos_ids()
        for (max_new, temperature), members in _param_groups(requests).items():
            members = sorted(members, key=lambda i: (len(requests[i].images), len(texts[i])))
            for b in range(0, len(members), self.batch_size):
                batch = members[b:b + self.batch_size]
                images = [img for i in batch for img in self._load_images(requests[i])]
                inputs = self.processor(text=[texts[i] for i in batch], images=images or None, padding=True,
                                        return_tensors="pt").to(self.device)
                kwargs = _generate_kwargs(max_new, temperature, self.tokenizer.pad_token_id)
                start = time.perf_counter()
                with torch.inference_mode():
                    generated = self.net.generate(**inputs, **kwargs)
                share = (time.perf_counter() - start) / len(batch)
                width = inputs["input_ids"].shape[1]
                n_prompt = inputs["attention_mask"].sum(dim=1).tolist()
                for row, i, n_in in zip(generated[:, width:].tolist(), batch, n_prompt, strict=True):
                    kept, n_out = _until_eos(row, eos_ids)
                    text = self.tokenizer.decode(kept, skip_special_tokens=True).strip()
                    out[i] = Response(text, int(n_in), n_out, share, False, self.model)
        return [r for r in out if r is not None]

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.net.generation_config.eos_token_id, self.tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(source)
        return ids
