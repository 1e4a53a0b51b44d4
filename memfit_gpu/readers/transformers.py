"""transformers backend: batched `generate` with any Hugging Face causal LM.

Prompts go through the model's chat template, are sorted by length so each batch pads little, are
left-padded (generation continues from the right edge), and come back in the caller's order.
Temperature 0 is greedy decoding.

A vision-language checkpoint (its config has a `vision_config`) is loaded with AutoProcessor +
AutoModelForImageTextToText instead; a request's images (local files) go into its last user message as
`{"type": "image"}` parts before the text, in order, and the processor expands them into image tokens.

A request whose leading system message is long (`reader.prefix_cache_min_tokens`, 1,024 tokens by default:
mem0 sends its 8,530-token extraction prompt with every add) is generated alone, from a copy of that
message's keys and values, which are computed once and kept for the two latest such messages: only the rest
of the prompt is read per request. Whether a request goes this way depends on the request only, never on
what came before, so a resumed run computes exactly what an uninterrupted one did.

`reader.device_map: auto` hands placement to accelerate (`from_pretrained(device_map="auto")`): the
layers are spread over every visible GPU (then the CPU) so a reader too large for one GPU still loads;
inputs go to the device of the first layer. Unset (the default), the model sits whole on one device.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
)
from transformers.cache_utils import DynamicCache, DynamicLayer

from memfit_gpu import models, onednn
from memfit_gpu.config import ReaderConfig
from memfit_gpu.devices import first_device, reader_dtype
from memfit_gpu.readers import cpu_attention
from memfit_gpu.readers.images import is_remote
from memfit_gpu.readers.registry import require
from memfit_gpu.readers.types import Backend, PromptTokenLimit, Request, Response

logger = logging.getLogger(__name__)


def _param_groups(requests: Sequence[Request],
                  sampling: Callable[[Request], tuple[int, float]]) -> dict[tuple[int, float], list[int]]:
    """Request positions grouped by (max_new_tokens, temperature): one generate call shares both."""
    groups: dict[tuple[int, float], list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault(sampling(r), []).append(i)
    return groups


# The long system prompts whose keys and values are kept (prefix_cache_min_tokens): the latest this many.
PREFIX_CACHE_ENTRIES = 2


# On the CPU a padded token costs what a real one does (prefill is compute-bound, and a padded batch takes
# SDPA's masked path instead of its causal one), while a batch only saves decode steps' weight reads: a batch
# there holds prompts of similar length, at most this many padded-width tokens per real token.
CPU_PADDED_PER_REAL = 1.25


def length_batches(lengths: Sequence[int], order: Sequence[int], batch_size: int,
                   padded_per_real: float | None) -> list[list[int]]:
    """`order` (positions sorted by ascending length) cut into generate batches of at most `batch_size`;
    with `padded_per_real`, a batch also ends before its rows x width would exceed that many times its real
    tokens (None: by count only, as on a GPU, where a wider batch is nearly free)."""
    batches: list[list[int]] = []
    for i in order:
        batch = batches[-1] if batches else None
        if batch is not None and len(batch) < batch_size and (
                padded_per_real is None
                or (len(batch) + 1) * lengths[i] <= padded_per_real * (sum(lengths[j] for j in batch) + lengths[i])):
            batch.append(i)
        else:
            batches.append([i])
    return batches


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

    def __init__(self, cfg: ReaderConfig, device: str | None = None) -> None:
        """Read `cfg.model`'s config and tokenizer; its weights load on `device` (default: the first GPU, else
        the CPU), or where accelerate places them when `cfg.device_map` is set (then `device` must be None),
        at `load`, which the caching reader calls before the first request its cache cannot serve."""
        super().__init__(cfg)
        if cfg.device_map is not None and device is not None:
            raise ValueError(f"reader.device_map={cfg.device_map!r} places the model itself: pass no device")
        self.resolved = models.resolve("reader", cfg.model)
        self.batch_size = max(1, int(cfg.batch_size))
        self.chunk_size = self.batch_size * 4
        self.model_config = AutoConfig.from_pretrained(self.resolved.path)
        self.vision = getattr(self.model_config, "vision_config", None) is not None
        if self.vision:
            self.processor = AutoProcessor.from_pretrained(self.resolved.path)
            self.tokenizer = self.processor.tokenizer
        else:
            self.processor = None
            self.tokenizer = AutoTokenizer.from_pretrained(self.resolved.path)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self._device = device
        self.net: Any = None  # the model, once `load` has run
        # prompt ids of a long system message -> its keys and values (prefix_cache_min_tokens); and how many
        # requests were generated from such a prefix and how many prefixes were read (the tests, the log)
        self._prefixes: OrderedDict[tuple[int, ...], DynamicCache] = OrderedDict()
        self.prefix_served = 0
        self.prefix_reads = 0

    def load(self) -> None:
        """Load the weights (once) and decide how they run: placement, attention, linear layers, row prefill."""
        if self.net is not None:
            return
        cfg = self.cfg
        start = time.perf_counter()
        device = self._device or str(first_device("auto"))
        # With a device map the layers land on the GPUs when there are any: the dtype is chosen for them.
        dtype = reader_dtype(cfg.dtype, device)
        placement: dict[str, Any] = {}
        if cfg.device_map is not None:
            require("accelerate", "transformers", "reader.device_map needs accelerate: pip install accelerate")
            placement["device_map"] = cfg.device_map
        if self.vision:
            net = AutoModelForImageTextToText.from_pretrained(self.resolved.path, dtype=dtype, **placement)
        else:
            net = AutoModelForCausalLM.from_pretrained(self.resolved.path, dtype=dtype, **placement)
        if cfg.device_map is None:
            net = net.to(device)
        # Where inputs go: the whole model's device, or (device map) the device of its first layer.
        self.device = str(net.device)
        # module -> device ("" = the whole model); GPU-seconds count every GPU that holds a part
        self.placement: dict[str, str] = {name: _device_of(str(where)) for name, where in
                                          (getattr(net, "hf_device_map", None) or {"": self.device}).items()}
        self.gpus = len({where for where in self.placement.values() if where.startswith("cuda")})
        net.eval()
        # bf16/fp16 on the CPU: one new token's attention without SDPA's slow reduced-precision CPU kernel
        if not self.vision:
            cpu_attention.use_for(net)
        self.attention = str(net.config._attn_implementation)
        # bf16 on the CPU: the linear layers through oneDNN with their weights packed once (memfit_gpu.onednn;
        # F.linear re-lays each weight out on every call, which a decode step pays for every token)
        self.linear = "torch"
        if not self.vision and self.device == "cpu" and net.dtype == torch.bfloat16:
            packed, why = onednn.pack_linears(net)
            if packed:
                self.linear = f"oneDNN, packed weights ({packed} layers)"
            else:
                logger.info("transformers reader: linear layers through torch's F.linear: %s", why)
        # On the CPU the prompts of a padded batch are read row by row (_prefilled_rows), where the model's
        # cache is plain per-layer keys and values (not a sliding window, say): decided once, here
        self.rows_alone = self.device == "cpu" and not self.vision and all(
            type(layer) is DynamicLayer for layer in DynamicCache(config=net.config).layers)
        self.net = net  # last: a load that failed part way is tried again whole
        self.load_s = time.perf_counter() - start
        logger.info("transformers reader %s loaded from %s on %s in %s (attention %s, linear %s) in %.1f s",
                    cfg.model, self.resolved.path, ", ".join(sorted(set(self.placement.values()))),
                    str(net.dtype).removeprefix("torch."), self.attention, self.linear, self.load_s)

    def _prompt_ids(self, request: Request) -> list[int]:
        if request.images:
            raise ValueError(
                f"request {request.key!r} has images, but {self.model} is a text-only model; "
                "use a vision-language model (its config has a vision_config)"
            )
        return self._chat_ids(request.messages)

    def _chat_ids(self, messages: list[dict[str, Any]], generation_prompt: bool = True) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                                 **self.template_kwargs)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def prompt_token_limit(self) -> PromptTokenLimit | None:
        """The model's trained context (max_position_embeddings): a longer prompt is cut before it is sent,
        instead of running past the positions the model knows (and allocating attention for all of them)."""
        context = getattr(self.model_config, "max_position_embeddings", None)
        if self.vision or not context:
            return None
        return int(context), lambda messages: len(self._chat_ids(messages))

    def generate(self, requests: Sequence[Request]) -> list[Response]:
        self.load()
        if self.vision:
            return self._generate_vision(requests)
        prompts = [self._prompt_ids(r) for r in requests]
        out: list[Response | None] = [None] * len(requests)
        eos_ids = self._eos_ids()
        lengths = [len(p) for p in prompts]
        slack = CPU_PADDED_PER_REAL if self.device == "cpu" else None
        prefixes = [self._system_prefix(r, p) for r, p in zip(requests, prompts, strict=True)]
        for i, prefix in enumerate(prefixes):
            if prefix:
                out[i] = self._generate_from_prefix(requests[i], prompts[i], prefix, eos_ids)
        # within a group, sort by length so padding is small (on the CPU, batches of similar lengths only)
        for (max_new, temperature), members in _param_groups(requests, self.sampling).items():
            members = sorted((i for i in members if not prefixes[i]), key=lambda i: lengths[i])
            if not members:
                continue
            for batch in length_batches(lengths, members, self.batch_size, slack):
                width = max(len(prompts[i]) for i in batch)
                pad = self.tokenizer.pad_token_id
                input_ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in batch])
                attention = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in batch])
                kwargs = _generate_kwargs(max_new, temperature, pad)
                if temperature > 0:  # each sampled batch from reader.seed: a rerun samples the same
                    torch.manual_seed(self.cfg.seed)
                start = time.perf_counter()
                with torch.inference_mode():
                    if self.rows_alone and len(batch) > 1 and min(lengths[i] for i in batch) > 1:
                        kwargs["past_key_values"] = self._prefilled_rows([prompts[i] for i in batch], width)
                    generated = self.net.generate(input_ids=input_ids.to(self.device),
                                                  attention_mask=attention.to(self.device), **kwargs)
                share = (time.perf_counter() - start) / len(batch)
                new_tokens = generated[:, width:].tolist()
                for row, i in zip(new_tokens, batch, strict=True):
                    kept, n_out = _until_eos(row, eos_ids)
                    text = self.tokenizer.decode(kept, skip_special_tokens=True)
                    out[i] = Response(text, len(prompts[i]), n_out, share, False, self.model)
        return [r for r in out if r is not None]

    def _system_prefix(self, request: Request, ids: list[int]) -> tuple[int, ...]:
        """The prompt ids of the request's leading system message when it is long enough to be kept
        (prefix_cache_min_tokens) and the prompt starts with them; () otherwise."""
        least = int(self.cfg.prefix_cache_min_tokens)
        messages = request.messages
        if least <= 0 or len(messages) < 2 or messages[0].get("role") != "system" \
                or len(str(messages[0].get("content", ""))) < least:  # fewer characters than tokens: too short
            return ()
        prefix = self._chat_ids(messages[:1], generation_prompt=False)
        if len(prefix) < least or len(prefix) >= len(ids) or ids[:len(prefix)] != prefix:
            return ()
        return tuple(prefix)

    def _prefix_cache(self, prefix: tuple[int, ...]) -> DynamicCache:
        """The keys and values of `prefix`: read once, the latest PREFIX_CACHE_ENTRIES kept."""
        cache = self._prefixes.get(prefix)
        if cache is None:
            cache = DynamicCache(config=self.net.config)
            with torch.inference_mode():
                self.net(input_ids=torch.tensor([prefix], device=self.device), past_key_values=cache, use_cache=True,
                         logits_to_keep=1)
            self.prefix_reads += 1
            self._prefixes[prefix] = cache
            while len(self._prefixes) > PREFIX_CACHE_ENTRIES:
                self._prefixes.popitem(last=False)
        self._prefixes.move_to_end(prefix)
        return cache

    def _generate_from_prefix(self, request: Request, ids: list[int], prefix: tuple[int, ...],
                              eos_ids: set[int]) -> Response:
        """One request generated alone from a copy of its system prefix's keys and values (generate reads the
        rest of the prompt, then decodes)."""
        max_new, temperature = self.sampling(request)
        start = time.perf_counter()
        cache = copy.deepcopy(self._prefix_cache(prefix))
        kwargs = _generate_kwargs(max_new, temperature, self.tokenizer.pad_token_id)
        if temperature > 0:  # from reader.seed, as a batch is: a rerun samples the same
            torch.manual_seed(self.cfg.seed)
        with torch.inference_mode():
            generated = self.net.generate(input_ids=torch.tensor([ids], device=self.device),
                                          attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=self.device),
                                          past_key_values=cache, **kwargs)
        self.prefix_served += 1
        kept, n_out = _until_eos(generated[0, len(ids):].tolist(), eos_ids)
        return Response(self.tokenizer.decode(kept, skip_special_tokens=True), len(ids), n_out,
                        time.perf_counter() - start, False, self.model)

    def _prefilled_rows(self, batch_prompts: list[list[int]], width: int) -> DynamicCache:
        """On the CPU (`rows_alone`): each prompt of a batch but its last token read on its own (no padded
        token computed, SDPA's causal path instead of the masked one: half the attention), the caches
        left-padded into one for `generate`, which reads the last column and decodes the rows together."""
        caches = [self.net(input_ids=torch.tensor([ids[:-1]], device=self.device), use_cache=True,
                           logits_to_keep=1).past_key_values for ids in batch_prompts]
        merged = DynamicCache(config=self.net.config)
        for index in range(len(caches[0].layers)):
            parts = [(c.layers[index].keys, c.layers[index].values) for c in caches]
            # left padding, as the batch's input ids: the padded positions are masked out by `attention`
            keys = torch.cat([F.pad(k, (0, 0, width - 1 - k.shape[-2], 0)) for k, _ in parts])
            values = torch.cat([F.pad(v, (0, 0, width - 1 - v.shape[-2], 0)) for _, v in parts])
            merged.update(keys, values, index)
        return merged

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

    def _load_images(self, request: Request) -> list[Image.Image]:
        images = []
        for path in request.images:
            if is_remote(path):
                raise ValueError(f"request {request.key!r}: the transformers reader reads local image files, not {path[:40]}")
            try:
                with Image.open(path) as img:
                    images.append(img.convert("RGB"))
            except FileNotFoundError:
                raise FileNotFoundError(f"request {request.key!r}: image {path} does not exist") from None
        return images

    def _generate_vision(self, requests: Sequence[Request]) -> list[Response]:
        texts = [self._vision_text(r) for r in requests]
        out: list[Response | None] = [None] * len(requests)
        eos_ids = self._eos_ids()
        for (max_new, temperature), members in _param_groups(requests, self.sampling).items():
            members = sorted(members, key=lambda i: (len(requests[i].images), len(texts[i])))
            for b in range(0, len(members), self.batch_size):
                batch = members[b:b + self.batch_size]
                images = [img for i in batch for img in self._load_images(requests[i])]
                inputs = self.processor(text=[texts[i] for i in batch], images=images or None, padding=True,
                                        return_tensors="pt").to(self.device)
                kwargs = _generate_kwargs(max_new, temperature, self.tokenizer.pad_token_id)
                if temperature > 0:  # each sampled batch from reader.seed: a rerun samples the same
                    torch.manual_seed(self.cfg.seed)
                start = time.perf_counter()
                with torch.inference_mode():
                    generated = self.net.generate(**inputs, **kwargs)
                share = (time.perf_counter() - start) / len(batch)
                width = inputs["input_ids"].shape[1]
                n_prompt = inputs["attention_mask"].sum(dim=1).tolist()
                for row, i, n_in in zip(generated[:, width:].tolist(), batch, n_prompt, strict=True):
                    kept, n_out = _until_eos(row, eos_ids)
                    text = self.tokenizer.decode(kept, skip_special_tokens=True)
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


def _device_of(placed: str) -> str:
    """accelerate writes a GPU as its index (0, 1, ...), the CPU and disk by name: as torch spells devices."""
    return f"cuda:{placed}" if placed.isdigit() else placed
