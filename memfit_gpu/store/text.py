"""The episode text of SPEC Units: what the store encodes, indexes and shows, one definition for all.

    DATE: {date_text} | Speaker {speaker} says: {[Image {id}: {caption}] ...}{text}

The prefix carries the session date and the speaker; the body is what was said, image captions first.
"""

from __future__ import annotations

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
