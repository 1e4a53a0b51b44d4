"""Cost ledger: calls, cache hits, tokens, latency and GPU-seconds per role, and the one-answer check.

SPEC Evaluation: "exactly one answer call per question must hold and be checked". Every answer request
(whether served by the backend or the cache) records its key; `check_one_answer_per_question` compares
them with the question ids and fails loudly, naming the offending ids.

What was paid is durable before anything reports it: every response the reader hands out becomes one
ledger entry (`Ledger.entry`: a backend call with its tokens, latency and GPU-seconds, or a cache hit),
committed in cache.sqlite in the same transaction as the response it accounts for (readers/cache.py),
and `Ledger.rebuilt` replays those entries when a run resumes. ledger.json is a report of the ledger,
rewritten after each batch; losing it (a kill, a full disk) loses nothing, and no kill, reader failure
or full disk can count a paid call twice or not at all.

Entries are applied in one way, live and on replay (`apply`): a run that resumes after a kill re-serves
from the cache the answers whose predictions it lost, and such an answer is no second answer call
(`accounted_keys`: the answer keys of earlier processes, each entry naming its process's `session`);
a question answered twice within one process still is, and fails the check.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

from memfit_gpu.data.schema import DataError
from memfit_gpu.files import atomic_write_text, is_finite_number, read_json_object, read_yaml_mapping
from memfit_gpu.readers.registry import is_local
from memfit_gpu.readers.types import PHASES, ROLE_PHASES, ROLES, Response

# Package data, so an installed (non-editable) memfit finds it too; configs/prices.yaml links to it.
DEFAULT_PRICES = resources.files(__package__).joinpath("prices.yaml")


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
    errors: int = 0  # backend calls that failed on their own (answered empty, or no answer: asked again)


@dataclass
class ModelStats:
    backend: str
    model: str
    calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0


# One ledger entry, as cache.sqlite's `calls` table stores it (readers/cache.py), in this order.
ENTRY_FIELDS = ("session", "served", "role", "key", "backend", "model", "input_tokens", "output_tokens",
                "latency_s", "tokens_estimated", "gpu_seconds", "error", "created", "owner")


@dataclass
class Ledger:
    roles: dict[str, RoleStats] = field(default_factory=lambda: {r: RoleStats() for r in ROLES})
    models: dict[str, ModelStats] = field(default_factory=dict)
    answer_keys: list[str] = field(default_factory=list)
    # Answer keys of earlier processes (the ledger this one was rebuilt from), until this process re-serves
    # them: that call is accounted already. A key repeated within one process is still counted (and fails
    # the check).
    accounted_keys: set[str] = field(default_factory=set, repr=False, compare=False)
    # This process's entries carry it; `apply` starts a new process's accounting when it changes.
    session: str = field(default_factory=lambda: uuid.uuid4().hex, repr=False, compare=False)
    _applying: str | None = field(default=None, repr=False, compare=False)
    # The answer reader and the judge (on its own thread, pipelined behind the answers) share one ledger.
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)
    # A run keeps every answer's key (its one-answer-per-question check); a live memory counts calls only:
    # its answers are no benchmark's questions, and a key per answer would grow without end (and name users)
    per_question: bool = field(default=True, compare=False)
    # The phase of each role as the process that wrote ledger.json knew it (a plugin method's own roles are
    # registered only where its module is loaded): a later reader totals the phases without that module.
    role_phases: dict[str, str] = field(default_factory=dict, compare=False)

    def entry(self, role: str, key: str, response: Response, backend: str, gpu_seconds: float = 0.0,
              owner: str | None = None) -> dict[str, Any]:
        """The ledger entry of one response handed out: a backend call (`served` "call": paid, with its
        tokens, latency and share of GPU-seconds) or a cache hit ("hit"); `owner`: the user whose data
        the call carried (Request.owner), so erasing the user drops its entries."""
        return {"session": self.session, "served": "hit" if response.cached else "call", "role": role, "key": key,
                "backend": backend, "model": response.model, "input_tokens": int(response.input_tokens),
                "output_tokens": int(response.output_tokens), "latency_s": float(response.latency_s),
                "tokens_estimated": int(response.tokens_estimated), "gpu_seconds": float(gpu_seconds),
                "error": response.error, "created": time.time(), "owner": owner}

    def record(self, role: str, key: str, response: Response, backend: str) -> None:
        """Account one response (a reader without a response cache; the caching reader commits the entry
        with the response first, then applies it)."""
        self.apply([self.entry(role, key, response, backend)])

    def apply(self, entries: Iterable[Mapping[str, Any]]) -> None:
        """Account entries in order: the same function live and when a resumed run replays cache.sqlite."""
        with self._lock:
            for entry in entries:
                self._apply(entry)

    def _apply(self, entry: Mapping[str, Any]) -> None:
        if entry["session"] != self._applying:  # another process's entries: what came before is accounted
            self._applying = entry["session"]
            self.accounted_keys = set(self.answer_keys)
        role, key, cached = entry["role"], entry["key"], entry["served"] == "hit"
        stats = self.roles.setdefault(role, RoleStats())
        stats.gpu_seconds += float(entry["gpu_seconds"])
        if role == "answer" and self.per_question:
            if key in self.accounted_keys:
                self.accounted_keys.discard(key)
                if cached:
                    return
                # Asked again (its earlier call failed, or the cache lost it): the call counts, the question
                # keeps its one answer.
            else:
                self.answer_keys.append(key)
        if cached:
            stats.cached += 1
            return
        n_in, n_out = int(entry["input_tokens"]), int(entry["output_tokens"])
        stats.calls += 1
        stats.errors += int(entry["error"] is not None)
        stats.input_tokens += n_in
        stats.output_tokens += n_out
        stats.estimated_token_calls += int(entry["tokens_estimated"])
        stats.latency_s += float(entry["latency_s"])
        m = self.models.setdefault(f"{entry['backend']}|{entry['model']}", ModelStats(entry["backend"], entry["model"]))
        m.calls += 1
        m.input_tokens += n_in
        m.output_tokens += n_out

    @classmethod
    def rebuilt(cls, entries: Iterable[Mapping[str, Any]], base: dict[str, Any] | None = None,
                wall_s: Mapping[str, float] | None = None) -> Ledger:
        """The ledger of a run directory from its committed entries (cache.sqlite, in commit order).

        Args:
            base: a ledger.json written before its directory's cache held entries (an older memfit, or a
                cache deleted since): its counts are the start the entries add to.
            wall_s: per role, the wall time the last ledger.json reported (time, not a paid count, is not
                in the entries).
        """
        ledger = cls.from_dict(base) if base else cls()
        ledger.apply(entries)
        for role, seconds in (wall_s or {}).items():
            ledger.roles.setdefault(role, RoleStats()).wall_s = float(seconds)
        ledger.accounted_keys = set(ledger.answer_keys)
        ledger._applying = None
        return ledger

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
        """USD from per-model prices per 1M tokens; local backends cost 0 (their GPU-seconds are recorded).

        `usd` is the whole cost, or None when a hosted model has no price (`unpriced_models` names them): a total
        that left them out read as the run's cost, 0.0 for a run whose only hosted model is unpriced.
        `priced_usd` is what the priced models cost (the whole cost when every model has a price)."""
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
        return {"usd": None if unpriced else total, "priced_usd": total, "by_model": by_model,
                "unpriced_models": sorted(set(unpriced)), "gpu_seconds": gpu_seconds}

    def phase_of(self, role: str) -> str:
        """The role's phase: registered in this process, else as ledger.json recorded it, else the role's name."""
        return ROLE_PHASES.get(role) or self.role_phases.get(role) or role

    def phases(self) -> dict[str, RoleStats]:
        """The roles' stats summed per phase (ROLE_PHASES: write, read, eval); a role no phase names (from
        a ledger another version wrote) is summed under its own name."""
        out = {phase: RoleStats() for phase in PHASES}
        with self._lock:
            for role, stats in self.roles.items():
                total = out.setdefault(self.phase_of(role), RoleStats())
                for name, value in asdict(stats).items():
                    setattr(total, name, getattr(total, name) + value)
        return out

    def to_dict(self, prices_path: str | Path | None = None) -> dict[str, Any]:
        with self._lock:
            return {
                "roles": {r: asdict(s) for r, s in self.roles.items()},
                "phases": {p: asdict(s) for p, s in self.phases().items()},  # derived from roles; never read back
                "role_phases": {r: self.phase_of(r) for r in self.roles if self.phase_of(r) in PHASES},
                "models": {k: asdict(m) for k, m in self.models.items()},
                "answer_calls": len(self.answer_keys) if self.per_question else
                self.roles["answer"].calls + self.roles["answer"].cached,
                **({"answer_keys": list(self.answer_keys)} if self.per_question else {}),
                "cost": self.cost(prices_path),
            }

    def to_json(self, prices_path: str | Path | None = None) -> str:
        return json.dumps(self.to_dict(prices_path), indent=1)

    def save(self, path: str | Path, prices_path: str | Path | None = None) -> None:
        atomic_write_text(path, self.to_json(prices_path))

    @classmethod
    def from_dict(cls, data: dict[str, Any], per_question: bool = True, source: str = "ledger") -> Ledger:
        """A ledger from what to_json wrote; DataError naming `source` (its file) and the field otherwise."""
        check_ledger(data, source)
        ledger = cls(per_question=per_question)
        for role, stats in data.get("roles", {}).items():
            ledger.roles[role] = RoleStats(**stats)
        for key, m in data.get("models", {}).items():
            ledger.models[key] = ModelStats(**m)
        ledger.role_phases = dict(data.get("role_phases", {}))
        ledger.answer_keys = list(data.get("answer_keys", [])) if per_question else []
        ledger.accounted_keys = set(ledger.answer_keys)
        return ledger

    @classmethod
    def load(cls, path: str | Path, per_question: bool = True) -> Ledger:
        """A ledger.json read back; per_question=False (a live memory) keeps its counts and drops any
        answer keys an older file holds. DataError naming the file and the field when it is not a ledger
        (check_ledger): read as it is, it would count zero calls, or stop with a traceback."""
        return cls.from_dict(read_json_object(path, fields={"roles": dict}), per_question, str(path))  # checks it


def read_ledger(path: str | Path) -> dict[str, Any]:
    """A ledger.json's content, checked (check_ledger; its `roles` required): what efficiency, the report and the
    tables read, and Ledger.load builds on. DataError naming the file and the field otherwise."""
    data = read_json_object(path, fields={"roles": dict})
    check_ledger(data, str(path))
    return data


def check_ledger(data: Mapping[str, Any], source: str) -> None:
    """DataError naming `source` and the field when `data` is not what Ledger.to_json writes: per role (model) a
    mapping of RoleStats (ModelStats) fields, each count a number (a model's backend and model named), the answer
    keys a list of ids, the role phases a mapping of names, the cost's USD a number or null and its unpriced models a
    list of names."""
    if not isinstance(data, Mapping):
        raise DataError(source, None, None, f"expected a ledger (a mapping), got {type(data).__name__}")
    for section, kind in (("answer_keys", list), ("role_phases", dict)):
        if not isinstance(data.get(section, kind()), kind):
            raise DataError(source, None, section, f"expected a {kind.__name__}, got {type(data[section]).__name__}")
    if not all(isinstance(k, str) for k in data.get("answer_keys", [])):
        raise DataError(source, None, "answer_keys", "expected question ids (text)")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in data.get("role_phases", {}).items()):
        raise DataError(source, None, "role_phases", "expected role names and phase names (text)")
    cost = data.get("cost", {})  # what the report and the tables show as the run's USD (recorded_cost)
    if not isinstance(cost, Mapping):
        raise DataError(source, None, "cost", f"expected a mapping, got {type(cost).__name__}")
    for key in ("usd", "priced_usd"):
        if cost.get(key) is not None and not is_finite_number(cost[key]):
            raise DataError(source, None, f"cost.{key}", f"expected a number or null, got {cost[key]!r:.40}")
    unpriced = cost.get("unpriced_models", [])
    if not isinstance(unpriced, list) or not all(isinstance(m, str) for m in unpriced):
        raise DataError(source, None, "cost.unpriced_models", f"expected a list of model names, got {unpriced!r:.40}")
    for section, kind in (("roles", RoleStats), ("models", ModelStats)):
        entries = data.get(section, {})
        if not isinstance(entries, dict):
            raise DataError(source, None, section, f"expected a mapping, got {type(entries).__name__}")
        known = {f.name: f.type for f in fields(kind)}
        for name, stats in entries.items():
            if not isinstance(stats, dict):
                raise DataError(source, None, f"{section}.{name}", f"expected a mapping, got {type(stats).__name__}")
            missing = [f.name for f in fields(kind) if f.default is MISSING and f.name not in stats]
            if missing:
                raise DataError(source, None, f"{section}.{name}.{missing[0]}", "missing")
            for key, value in stats.items():
                if key not in known:
                    raise DataError(source, None, f"{section}.{name}.{key}", "not a field of a ledger")
                text = known[key] == "str"
                if (not isinstance(value, str)) if text else (isinstance(value, bool) or not isinstance(
                        value, (int, float))):
                    raise DataError(source, None, f"{section}.{name}.{key}",
                                    f"expected {'text' if text else 'a number'}, got {value!r:.40}")


def recorded_cost(data: Mapping[str, Any]) -> dict[str, Any]:
    """A ledger.json's `cost` as the tables and the report show it: {"usd": the whole cost, None when it is
    unknown, "priced_usd": what the priced models cost, "unpriced_models": [hosted models without a price]}; all
    None and [] for a ledger without a cost. A ledger written before `usd` was None for an unpriced model holds the
    priced models' sum there: it is read as the priced part, the whole unknown."""
    cost = data.get("cost")
    if not isinstance(cost, Mapping) or cost.get("usd") is None and "unpriced_models" not in cost:
        return {"usd": None, "priced_usd": None, "unpriced_models": []}
    unpriced = list(cost.get("unpriced_models") or [])
    priced = cost.get("priced_usd", cost.get("usd"))
    return {"usd": None if unpriced else cost.get("usd"), "priced_usd": priced, "unpriced_models": unpriced}


def usd_text(cost: Mapping[str, Any], digits: int = 4) -> str:
    """recorded_cost's USD in words: the amount, "-" when the ledger has none, or "n/a (partial: X USD priced;
    unpriced, no price in configs/prices.yaml: MODELS)" when a hosted model has no price there."""
    if cost["unpriced_models"]:
        priced = "" if cost["priced_usd"] is None else f"partial: {cost['priced_usd']:.{digits}f} USD priced; "
        return f"n/a ({priced}unpriced, no price in configs/prices.yaml: {', '.join(cost['unpriced_models'])})"
    return "-" if cost["usd"] is None else f"{cost['usd']:.{digits}f}"


def load_prices(path: str | Path | None = None) -> dict[str, dict[str, float]]:
    """{model: {"input": usd_per_1m, "output": usd_per_1m}} from the package's prices.yaml (or `path`)."""
    source = Path(path) if path is not None else DEFAULT_PRICES
    if not source.is_file():
        raise FileNotFoundError(f"price table {source} does not exist")
    data = read_yaml_mapping(source)  # DataError naming the file: not YAML, or no mapping
    models = data.get("models", {})
    if not isinstance(models, dict):
        raise DataError(str(source), None, "models", f"expected a mapping of models, got {type(models).__name__}")
    out: dict[str, dict[str, float]] = {}
    for name, price in models.items():
        if not isinstance(price, dict) or not {"input", "output"} <= set(price):
            raise DataError(str(source), None, f"models.{name}", "needs 'input' and 'output' (USD per 1M tokens)")
        for key in ("input", "output"):  # a price of "abc", NaN or -1 gave a traceback or an estimate of nan
            if not is_finite_number(price[key]) or price[key] < 0:
                raise DataError(str(source), None, f"models.{name}.{key}",
                                f"{price[key]!r:.40} is no price: a number >= 0 (USD per 1M tokens)")
        out[str(name)] = {"input": float(price["input"]), "output": float(price["output"])}
    return out
