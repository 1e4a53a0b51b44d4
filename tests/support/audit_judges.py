"""Scripted judges for the judge audit's tests, added with one module and two registry calls.

`audit_accept_all` replies CORRECT to every request; `audit_exact_gold` replies CORRECT only when the answer
under judgement is the gold answer exactly as written (read from the paper judge's prompt lines). They check
the audit's machinery (probes, counting, cache, ledger), never what a judge is worth; no reported number
comes from them. Loaded into a `memfit` process with MEMFIT_PLUGINS=support.audit_judges (tests/ on PYTHONPATH).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from memfit_gpu.readers.registry import BackendEntry, register_backend
from memfit_gpu.readers.types import Backend, Request, Response

_GOLD = re.compile(r"^Gold answer: (.*)$", re.MULTILINE)
_ANSWER = re.compile(r"^Answer to grade: (.*)$", re.MULTILINE)


def _reply(verdict: str) -> str:
    return json.dumps({"verdict": verdict, "reason": "scripted"})


class AcceptAll(Backend):
    name = "audit_accept_all"

    def generate(self, requests: Sequence[Request]) -> list[Response]:
        return [Response(_reply("CORRECT"), 1, 1, 0.0, model=self.model) for _ in requests]


class ExactGold(Backend):
    name = "audit_exact_gold"

    def generate(self, requests: Sequence[Request]) -> list[Response]:
        out = []
        for request in requests:
            prompt = str(request.messages[-1]["content"])
            gold, answer = _GOLD.search(prompt), _ANSWER.search(prompt)
            same = gold is not None and answer is not None and gold.group(1).strip() == answer.group(1).strip()
            out.append(Response(_reply("CORRECT" if same else "WRONG"), 1, 1, 0.0, model=self.model))
        return out


for _name, _cls in (("audit_accept_all", "AcceptAll"), ("audit_exact_gold", "ExactGold")):
    register_backend(_name, BackendEntry(f"support.audit_judges:{_cls}", "json", "(the standard library)", local=True,
                                         plan="nothing", weights=False, context="none"))
