"""The episode text of SPEC Units: what the store encodes, indexes and shows, one definition for all.

    DATE: {date_text} | Speaker {speaker} says: {[Image {id}: {caption}] ...}{text}

The prefix carries the session date and the speaker; the body is what was said, image captions first.
"""

from __future__ import annotations

from collections.abc import Sequence

from memfit_gpu.data.schema import Turn


def episode_prefix(date_text: str, speaker: str) -> str:
    """`DATE: {date_text} | Speaker {speaker} says: ` (the part `EpisodeStore.body` drops)."""
    return f"DATE: {date_text} | Speaker {speaker} says: "


def episode_body(turn: Turn) -> str:
    """What the speaker said: image captions first (SPEC Units), then the text."""
    images = "".join(
        f"[Image {image.image_id}: {image.caption}] " if image.image_id else f"[Image: {image.caption}] "
        for image in turn.images
    )
    return images + turn.text


def episode_text(turn: Turn) -> str:
    """SPEC Units: `DATE: {date} | Speaker {name} says: {[Image ...] }{text}`."""
    return episode_prefix(turn.date_text, turn.speaker) + episode_body(turn)


def split_images(body: str, parts: Sequence[tuple[str | None, int]]) -> tuple[list[tuple[str | None, str]], str] | None:
    """`episode_body`'s exact inverse from the parts its images were logged with ((image id or None, caption
    characters), in order): the (image id, caption) pairs and the text. None when the body does not hold those
    parts (a record of another body)."""
    images, at = [], 0
    for image_id, length in parts:
        head = f"[Image {image_id}: " if image_id else "[Image: "
        end = at + len(head) + length
        if not body.startswith(head, at) or not body.startswith("] ", end):
            return None
        images.append((image_id, body[at + len(head):end]))
        at = end + 2
    return images, body[at:]


def split_body(body: str, image_ids: tuple[str, ...] | list[str]) -> tuple[list[tuple[str, str]], str]:
    """`episode_body`'s inverse for a turn whose images all had ids (`image_ids`, in order): the
    (image id, caption) pairs and the text; a body that does not start with exactly those images (an
    image without an id, whose caption is only in the text) comes back whole as the text, so that
    `episode_body` of the result is `body` either way."""
    images, rest = [], body
    for image_id in image_ids:
        head = f"[Image {image_id}: "
        end = rest.find("] ", len(head)) if rest.startswith(head) else -1
        if end < 0:
            return [], body
        images.append((image_id, rest[len(head):end]))
        rest = rest[end + 2:]
    return images, rest
