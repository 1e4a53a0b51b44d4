"""One vLLM offline engine in its own process, driven over pipes (run as `python -m memfit_gpu.readers.vllm_worker`).

Protocol, one JSON object per line. stdin: first the engine settings, then batches
`{"requests": [{"messages", "images", "max_new_tokens", "temperature"}]}`; EOF ends the worker.
The protocol channel is a private copy of the original stdout; fd 1 is pointed at stderr before vLLM is
imported, so vLLM's own prints (and those of the processes it spawns) cannot corrupt the protocol.
Replies: `{"ready": true, "load_s"}` once, then `{"responses": [{"text", "input_tokens", "output_tokens"}],
"wall_s"}` per batch, or `{"error": "..."}`.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any


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
    if settings.get("max_images"):
        kwargs["limit_mm_per_prompt"] = {"image": settings["max_images"]}
    if settings.get("gpu_memory_utilization"):
        kwargs["gpu_memory_utilization"] = settings["gpu_memory_utilization"]
    return LLM(**kwargs)


def _answer(llm: Any, batch: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    from vllm import SamplingParams

    from memfit_gpu.readers.base import with_image_parts

    conversations = [with_image_parts(r["messages"], r.get("images") or []) for r in batch]
    params = [
        SamplingParams(max_tokens=int(r["max_new_tokens"]), temperature=float(r["temperature"]), seed=0)
        for r in batch
    ]
    outputs = llm.chat(conversations, sampling_params=params, use_tqdm=False,
                       chat_template_kwargs=template_kwargs or None)
    replies = []
    for out in outputs:
        completion = out.outputs[0]
        replies.append({
            "text": completion.text.strip(),
            "input_tokens": len(out.prompt_token_ids or []),
            "output_tokens": len(completion.token_ids),
        })
    return replies


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
            replies = _answer(llm, batch, settings.get("chat_template_kwargs"))
        except Exception as exc:  # noqa: BLE001 - the parent decides; the engine stays up for the next batch
            traceback.print_exc()
            send({"error": f"{type(exc).__name__}: {exc}"})
            continue
        send({"responses": replies, "wall_s": time.perf_counter() - start})


if __name__ == "__main__":
    main()
