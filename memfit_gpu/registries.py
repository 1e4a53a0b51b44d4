"""The one shape of memfit's registries (methods, read-path stages, reader backends, benchmarks): entries by name
for a registry-backed config key, where registering a name also lets the key take it (config.register_choice).

    METHODS = Registry("method", {"memfit": MethodEntry(MemFit), ...}, unknown=lambda name, known: ...)
    METHODS.register("recency", MethodEntry(Recency))      # one call adds an extension
    METHODS.get("recency")                                  # the entry, or the registry's own error
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from memfit_gpu.config import choices, register_choice

Entry = TypeVar("Entry")


class Registry(Generic[Entry]):
    def __init__(self, key: str, entries: dict[str, Entry],
                 unknown: Callable[[str, Sequence[str]], Exception]) -> None:
        self.key = key  # the config key whose values are this registry's names
        self.entries = entries  # the table itself (the registry module's REGISTRY)
        self._unknown = unknown  # the error for a name nobody registered, given the name and the known ones

    def register(self, name: str, entry: Entry) -> None:
        """Add (or replace) `name`; the config key takes it from now on."""
        self.entries[name] = entry
        register_choice(self.key, name)

    def get(self, name: str) -> Entry:
        entry = self.entries.get(name)
        if entry is None:
            raise self._unknown(name, choices(self.key))
        return entry
