"""One vLLM offline engine in its own process, driven over pipes (run as `python -m memfit_gpu.readers.vllm_worker`).

Protocol, one JSON object per line. stdin: first the engine settings, then batches
`{"requests": [{"messages", "images", "max_new_tokens", "temperature"}]}`; EOF ends the worker.
The protocol channel is a private copy of the original stdout; fd 1 is pointed at stderr before vLLM is
imported, so vLLM's own prints (and those of the processes it spawns) cannot corrupt the protocol.
Replies: `{"ready": true, "load_s"}` once, then `{"responses": [...], "wall_s"}` per batch, one item per
request: `{"text", "input_tokens", "output_tokens", "notes"}` or `{"error": "..."}`, or `{"error": "..."}`
for the whole batch when the engine itself failed.

One bad request never fails its batch: before generation each prompt is cut to fit the context
(`max_model_len - max_tokens`: the middle of its longest message goes, head and tail stay, and the
count of tokens cut is in `notes.truncated_tokens`) and its images are capped at the engine's
`max_images` (the first ones kept: the question's image leads; `notes.images_dropped`). A batch that
vLLM still refuses is split in halves until the refused requests stand alone; they get an error item
and the others their answers (vLLM validates a whole batch before generating any of it, so the
split costs no repeated generation).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

from memfit_gpu.readers.images import with_image_parts


def _engine(settings: dict[str, Any]) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = {
        "model": settings["model_path"],
        "dtype": settings["dtype"],
        "max_model_len": settings["max_model_len"],
        "tensor_parallel_size": settings["tensor_parallel_size"],
        "enforce_eager": settings["enforce_eager"],
        "seed": settings.get("seed", 0),
    }
    if settings.get("served_model_name"):
        kwargs["served_model_name"] = settings["served_model_name"]
    kwargs.update(engine_multimodal_kwargs(settings))
    if settings.get("gpu_memory_utilization"):
        kwargs["gpu_memory_utilization"] = settings["gpu_memory_utilization"]
    return LLM(**kwargs)


def engine_multimodal_kwargs(settings: dict[str, Any]) -> dict[str, Any]:
    """Always a limit: 0 images in text mode keeps a vision model (Gemma-3, Qwen2.5-VL) from reserving
    memory for its vision tower; text-only models ignore it. `max_pixels` bounds Qwen2.5-VL's image size."""
    out: dict[str, Any] = {"limit_mm_per_prompt": {"image": int(settings.get("max_images") or 0), "video": 0}}
    if settings.get("max_pixels"):
        out["mm_processor_kwargs"] = {"max_pixels": int(settings["max_pixels"])}
    return out


def fit_prompt(tokenizer: Any, messages: list[dict[str, Any]], limit: int,
               template_kwargs: dict[str, Any] | None = None) -> tuple[list[dict[str, Any]], int]:
    """(messages whose chat prompt has at most `limit` tokens, tokens cut). Text content only; the cut
    removes the middle of the longest message and marks the place, so instructions (head) and the
    question (tail) survive."""
    def length(msgs: list[dict[str, Any]]) -> int:
        ids = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True,
                                            **(template_kwargs or {}))
        return len(ids["input_ids"] if hasattr(ids, "keys") else ids)

    original = current = length(messages)
    if original <= limit:
        return messages, 0
    longest = max(range(len(messages)), key=lambda i: len(str(messages[i]["content"])))
    content_ids = tokenizer.encode(str(messages[longest]["content"]), add_special_tokens=False)
    marker = " [... cut to fit the context ...] "
    out = messages
    for _ in range(4):  # token boundaries shift a little when re-encoded: shrink until it fits
        excess = current - limit
        keep = max(0, len(content_ids) - excess - 4)
        head, tail = content_ids[: keep // 2], content_ids[len(content_ids) - (keep - keep // 2):] if keep else []
        out = [dict(m) for m in messages]
        out[longest]["content"] = tokenizer.decode(head) + marker + tokenizer.decode(tail)
        current = length(out)
        if current <= limit or keep == 0:
            break
        content_ids = head + tail
    if current > limit:
        raise ValueError(f"prompt of {original} tokens cannot be cut to {limit}: its other messages alone are longer")
    return out, original - current


def _chat_isolated(llm: Any, conversations: list[Any], params: list[Any], template_kwargs: dict[str, Any] | None,
                   ) -> list[Any]:
    """`llm.chat` over the batch; where vLLM refuses it, halves until each refused request stands alone.
    Items are RequestOutputs or the exception of a request that failed alone."""
    try:
        return list(llm.chat(conversations, sampling_params=params, use_tqdm=False,
                             chat_template_kwargs=template_kwargs or None))
    except Exception as exc:  # noqa: BLE001 - isolated below, reported per request
        if len(conversations) == 1:
            traceback.print_exc()
            return [exc]
        mid = len(conversations) // 2
        return (_chat_isolated(llm, conversations[:mid], params[:mid], template_kwargs)
                + _chat_isolated(llm, conversations[mid:], params[mid:], template_kwargs))


def _answer(llm: Any, batch: list[dict[str, Any]], settings: dict[str, Any]) -> list[dict[str, Any]]:
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    template_kwargs = settings.get("chat_template_kwargs")
    tokenizer = llm.get_tokenizer()
    max_images = int(settings.get("max_images") or 0)
    items: list[dict[str, Any] | None] = [None] * len(batch)
    conversations, params, where, notes_of = [], [], [], {}
    for i, r in enumerate(batch):
        max_tokens = int(r["max_new_tokens"])
        images = list(r.get("images") or [])
        notes: dict[str, int] = {}
        if len(images) > max_images:
            notes["images_dropped"] = len(images) - max_images
            images = images[:max_images]
        try:
            messages, cut = fit_prompt(tokenizer, r["messages"], int(settings["max_model_len"]) - max_tokens,
                                       template_kwargs)
            if cut:
                notes["truncated_tokens"] = cut
            conversations.append(with_image_parts(messages, images))
        except Exception as exc:  # noqa: BLE001 - this request alone cannot be served
            items[i] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        json_object = r.get("response_format") == "json_object"  # JSON mode: decoding held to one JSON object
        params.append(SamplingParams(max_tokens=max_tokens, temperature=float(r["temperature"]),
                                     seed=int(settings.get("seed", 0)),
                                     structured_outputs=StructuredOutputsParams(json_object=True) if json_object else None))
        where.append(i)
        notes_of[i] = notes
    outputs = _chat_isolated(llm, conversations, params, template_kwargs) if conversations else []
    for i, out in zip(where, outputs, strict=True):
        if isinstance(out, Exception):
            items[i] = {"error": f"{type(out).__name__}: {out}"}
            continue
        completion = out.outputs[0]
        items[i] = {
            "text": completion.text,
            "input_tokens": len(out.prompt_token_ids or []),
            "output_tokens": len(completion.token_ids),
            "notes": notes_of[i],
        }
    return items  # type: ignore[return-value]


def main() -> None:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(obj: dict[str, Any]) -> None:
        protocol.write(json.dumps(obj) + "\n")
        protocol.flush()

    line = sys.stdin.readline()
    if not line:
        return
    settings = json.loads(line)
    start = time.perf_counter()
    try:
        llm = _engine(settings)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises with the log path
        traceback.print_exc()
        send({"error": f"engine failed to start: {type(exc).__name__}: {exc}"})
        return
    send({"ready": True, "load_s": time.perf_counter() - start})
    for line in sys.stdin:
        if not line.strip():
            continue
        batch = json.loads(line)["requests"]
        start = time.perf_counter()
        try:
            replies = _answer(llm, batch, settings)
        except Exception as exc:  # noqa: BLE001 - the parent decides; the engine stays up for the next batch
            traceback.print_exc()
            send({"error": f"{type(exc).__name__}: {exc}"})
            continue
        send({"responses": replies, "wall_s": time.perf_counter() - start})


if __name__ == "__main__":
    main()
