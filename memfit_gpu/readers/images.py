"""Images in reader requests: a request names each image by a local path or a URL (http(s) or data:).

Servers and vLLM take OpenAI content parts with data URLs; the transformers backend opens local files
itself; the response cache keys a local file by its bytes (`cache.image_fingerprint`).
"""

from __future__ import annotations

import base64
import mimetypes
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REMOTE_PREFIXES = ("http://", "https://", "data:")


def is_remote(image: str) -> bool:
    """True for a URL or data URL, False for what is read as a local file path."""
    return image.startswith(REMOTE_PREFIXES)


def image_data_url(image: str) -> str:
    """A local image file as a base64 data URL (servers and vLLM accept it); URLs pass through."""
    if is_remote(image):
        return image
    path = Path(image)
    if not path.is_file():
        raise FileNotFoundError(f"image {image} does not exist")
    mime = mimetypes.guess_type(path.name)[0] or "image/jpeg"
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}"


def with_image_parts(messages: list[dict[str, Any]], images: Sequence[str]) -> list[dict[str, Any]]:
    """Attach images to the last user message as OpenAI content parts: images first, in order, then text."""
    if not images:
        return messages
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last_user is None:
        raise ValueError("a request with images needs a user message to carry them")
    out = [dict(m) for m in messages]
    text = out[last_user]["content"]
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": image_data_url(i)}} for i in images]
    parts.append({"type": "text", "text": text})
    out[last_user]["content"] = parts
    return out
