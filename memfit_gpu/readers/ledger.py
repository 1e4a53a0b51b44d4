"""Cost ledger: calls, cache hits, tokens, latency and GPU-seconds per role, and the one-answer check.

SPEC Evaluation: "exactly one answer call per question must hold and be checked". Every answer request
(whether served by the backend or the cache) records its key; `check_one_answer_per_question` compares
them with the question ids and fails loudly, naming the offending ids.

A resumed run loads the saved ledger. The pipeline saves it right after each batch of calls, before
the predictions of that batch are written, so a kill can leave answer calls on the books whose
predictions are lost; the rerun re-serves those questions from the response cache, and `record` does
not count such a question again (`accounted_keys`).
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from memfit_gpu.files import atomic_write_text
from memfit_gpu.readers.registry import is_local
from memfit_gpu.readers.types import ROLE_PHASES, ROLES, Response

# Package data, so an installed (non-editable) memfit finds it too; configs/prices.yaml links to it.
DEFAULT_PRICES = resources.files(__package__).joinpath("prices.yaml")
PHASES = ("write", "read", "eval")  # ROLE_PHASES' values: ledger.json totals its roles per phase


class LedgerCheckError(AssertionError):
    """The run broke an accounting invariant (e.g. a question answered twice or never)."""


@dataclass
class RoleStats:
    calls: int = 0  # requests the backend actually generated
    cached: int = 0  # requests served from the response cache
    input_tokens: int = 0  # over backend calls only: cached answers cost nothing again
    output_tokens: int = 0
    estimated_token_calls: int = 0  # calls whose token counts were estimated (server gave no usage)
    latency_s: float = 0.0  # sum of per-request latencies (concurrent HTTP calls overlap)
    wall_s: float = 0.0  # wall time spent inside Reader.generate for this role
    gpu_seconds: float = 0.0  # wall time x GPUs held by a local backend
    errors: int = 0  # backend calls that failed on their own (recorded, answered as empty)


@dataclass
class ModelStats:
    backend: str
    model: str
    calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0


@dataclass
class Ledger:
    roles: dict[str, RoleStats] = field(default_factory=lambda: {r: RoleStats() for r in ROLES})
    models: dict[str, ModelStats] = field(default_factory=dict)
    answer_keys: list[str] = field(default_factory=list)
    # Answer keys of the saved ledger this one was loaded from, until a rerun re-serves them: that call is
    # accounted already. A key repeated within one process is still counted (and fails the check).
    accounted_keys: set[str] = field(default_factory=set, repr=False, compare=False)
    # The answer reader and the judge (on its own thread, pipelined behind the answers) share one ledger.
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)

    def record(self, role: str, key: str, response: Response, backend: str) -> None:
        with self._lock:
            self._record(role, key, response, backend)

    def _record(self, role: str, key: str, response: Response, backend: str) -> None:
        stats = self.roles.setdefault(role, RoleStats())
        if role == "answer":
            if key in self.accounted_keys:
                self.accounted_keys.discard(key)
                if response.cached:
                    return
                # The cache lost the call (not a process kill): count what the backend did again, but the
                # question keeps its one answer.
            else:
                self.answer_keys.append(key)
        if response.cached:
            stats.cached += 1
            return
        stats.calls += 1
        stats.errors += int(response.error is not None)
        stats.input_tokens += response.input_tokens
        stats.output_tokens += response.output_tokens
        stats.estimated_token_calls += int(response.tokens_estimated)
        stats.latency_s += response.latency_s
        m = self.models.setdefault(f"{backend}|{response.model}", ModelStats(backend, response.model))
        m.calls += 1
        m.input_tokens += response.input_tokens
        m.output_tokens += response.output_tokens

    def add_wall(self, role: str, seconds: float) -> None:
        with self._lock:
            self.roles.setdefault(role, RoleStats()).wall_s += seconds

    def add_gpu_seconds(self, role: str, seconds: float) -> None:
        with self._lock:
            self.roles.setdefault(role, RoleStats()).gpu_seconds += seconds

    def check_one_answer_per_question(self, question_ids: Sequence[str]) -> None:
        """Exactly one answer request per question id, and none for anything else; else raise naming ids."""
        counts = Counter(self.answer_keys)
        expected = Counter(question_ids)
        repeated_questions = sorted(q for q, n in expected.items() if n > 1)
        if repeated_questions:
            raise LedgerCheckError(f"question ids listed more than once: {repeated_questions[:20]}")
        missing = sorted(q for q in expected if counts[q] == 0)
        repeated = sorted(f"{q} x{n}" for q, n in counts.items() if n > 1)
        extra = sorted(q for q in counts if q not in expected)
        if missing or repeated or extra:
            parts = []
            if missing:
                parts.append(f"{len(missing)} questions without an answer call: {missing[:20]}")
            if repeated:
                parts.append(f"{len(repeated)} questions with more than one answer call: {repeated[:20]}")
            if extra:
                parts.append(f"{len(extra)} answer calls for ids that are not questions: {extra[:20]}")
            raise LedgerCheckError("one answer call per question does not hold: " + "; ".join(parts))

    def cost(self, prices_path: str | Path | None = None) -> dict[str, Any]:
        """USD from per-model prices per 1M tokens; local backends cost 0 (their GPU-seconds are recorded)."""
        prices = load_prices(prices_path)
        by_model: dict[str, float | None] = {}
        unpriced: list[str] = []
        total = 0.0
        for name, m in self.models.items():
            if is_local(m.backend):  # the backend's registry entry: it ran on this node
                by_model[name] = 0.0
                continue
            price = prices.get(m.model)
            if price is None:
                by_model[name] = None
                unpriced.append(m.model)
                continue
            usd = m.input_tokens / 1e6 * price["input"] + m.output_tokens / 1e6 * price["output"]
            by_model[name] = usd
            total += usd
        gpu_seconds = sum(s.gpu_seconds for s in self.roles.values())
        return {"usd": total, "by_model": by_model, "unpriced_models": sorted(set(unpriced)),
                "gpu_seconds": gpu_seconds}

    def phases(self) -> dict[str, RoleStats]:
        """The roles' stats summed per phase (ROLE_PHASES: write, read, eval); a role no phase names (from
        a ledger another version wrote) is summed under its own name."""
        out = {phase: RoleStats() for phase in PHASES}
        with self._lock:
            for role, stats in self.roles.items():
                total = out.setdefault(ROLE_PHASES.get(role, role), RoleStats())
                for name, value in asdict(stats).items():
                    setattr(total, name, getattr(total, name) + value)
        return out

    def to_dict(self, prices_path: str | Path | None = None) -> dict[str, Any]:
        with self._lock:
            return {
                "roles": {r: asdict(s) for r, s in self.roles.items()},
                "phases": {p: asdict(s) for p, s in self.phases().items()},  # derived from roles; never read back
                "models": {k: asdict(m) for k, m in self.models.items()},
                "answer_calls": len(self.answer_keys),
                "answer_keys": list(self.answer_keys),
                "cost": self.cost(prices_path),
            }

    def to_json(self, prices_path: str | Path | None = None) -> str:
        return json.dumps(self.to_dict(prices_path), indent=1)

    def save(self, path: str | Path, prices_path: str | Path | None = None) -> None:
        atomic_write_text(path, self.to_json(prices_path))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Ledger:
        ledger = cls()
        for role, stats in data.get("roles", {}).items():
            ledger.roles[role] = RoleStats(**stats)
        for key, m in data.get("models", {}).items():
            ledger.models[key] = ModelStats(**m)
        ledger.answer_keys = list(data.get("answer_keys", []))
        ledger.accounted_keys = set(ledger.answer_keys)
        return ledger

    @classmethod
    def load(cls, path: str | Path) -> Ledger:
        return cls.from_dict(json.loads(Path(path).read_text()))


def load_prices(path: str | Path | None = None) -> dict[str, dict[str, float]]:
    """{model: {"input": usd_per_1m, "output": usd_per_1m}} from the package's prices.yaml (or `path`)."""
    source = Path(path) if path is not None else DEFAULT_PRICES
    if not source.is_file():
        raise FileNotFoundError(f"price table {source} does not exist")
    data = yaml.safe_load(source.read_text(encoding="utf-8")) or {}
    models = data.get("models", {})
    out: dict[str, dict[str, float]] = {}
    for name, price in models.items():
        if not isinstance(price, dict) or not {"input", "output"} <= set(price):
            raise ValueError(f"{source}: models.{name} needs 'input' and 'output' (USD per 1M tokens)")
        out[str(name)] = {"input": float(price["input"]), "output": float(price["output"])}
    return out
