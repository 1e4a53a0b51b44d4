"""A test-only reader backend, `echo`, added from tests/ with one module and one registry call (issue 21).

It answers every request with the first line of the request's last message, at once: the tests that use
it check the machinery around a reader (registry, preflight, plan, ledger, cache, predictions), never
what a reader says, and no reported number comes from it. Loaded into a `memfit` process with
MEMFIT_PLUGINS=seam_echo_backend (tests/ on PYTHONPATH).
"""

from __future__ import annotations

from collections.abc import Sequence

from memfit_gpu.readers.registry import BackendEntry, register_backend
from memfit_gpu.readers.types import Backend, Request, Response


class EchoBackend(Backend):
    name = "echo"

    def generate(self, requests: Sequence[Request]) -> list[Response]:
        out = []
        for request in requests:
            text = str(request.messages[-1]["content"]).strip().splitlines()[0]
            words = sum(len(str(m["content"]).split()) for m in request.messages)
            out.append(Response(text, input_tokens=words, output_tokens=len(text.split()), latency_s=0.0,
                                model=self.model))
        return out


register_backend("echo", BackendEntry("seam_echo_backend:EchoBackend", "json", "(the standard library)", local=True,
                                      plan="nothing", weights=False, context="none"))
