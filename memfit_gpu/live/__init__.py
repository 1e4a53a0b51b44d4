"""The live memory: `memfit_gpu.Memory`, an agent's memory written turn by turn (memory.py).
The server over it is memfit_gpu/serve/ (`memfit serve`)."""

from __future__ import annotations

from memfit_gpu.live.memory import (
    Added,
    Answer,
    Memory,
    TurnConflictError,
    UnknownUserError,
    UserFullError,
    live_methods,
)
from memfit_gpu.methods.base import Hit

__all__ = ["Added", "Answer", "Hit", "Memory", "TurnConflictError", "UnknownUserError", "UserFullError", "live_methods"]
