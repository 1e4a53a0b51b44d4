"""A test-only reader backend, `echo`, added from tests/ with one module and one registry call.

It answers every request with the first line of the request's last message (or, with
MEMFIT_TEST_ECHO_PREFIX set, the first line that starts with it; a JSON-mode request holding a
`## New Messages` section, mem0's extraction, with that section's first line as mem0's one fact), at once: the tests that use
it check the machinery around a reader (registry, preflight, plan, ledger, cache, predictions), never
what a reader says, and no reported number comes from it. Loaded into a `memfit` process with
MEMFIT_PLUGINS=seam_echo_backend (tests/ on PYTHONPATH).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence

from memfit_gpu.readers.registry import BackendEntry, register_backend
from memfit_gpu.readers.types import Backend, Request, Response


class EchoBackend(Backend):
    name = "echo"

    def generate(self, requests: Sequence[Request]) -> list[Response]:
        out = []
        for request in requests:
            lines = str(request.messages[-1]["content"]).strip().splitlines()
            prefix = os.environ.get("MEMFIT_TEST_ECHO_PREFIX")  # reply with the first line that starts so
            text = next((line for line in lines if prefix and line.startswith(prefix)), lines[0])
            if request.response_format == "json_object" and "## New Messages" in lines:
                # a JSON reply, as a peer's extraction prompt asks (mem0): the first new message as its fact
                rest = lines[lines.index("## New Messages") + 1:]
                text = json.dumps({"memory": [{"text": next((line for line in rest if line.strip()), "")}]})
            words = sum(len(str(m["content"]).split()) for m in request.messages)
            out.append(Response(text, input_tokens=words, output_tokens=len(text.split()), latency_s=0.0,
                                model=self.model))
        return out


register_backend("echo", BackendEntry("seam_echo_backend:EchoBackend", "json", "(the standard library)", local=True,
                                      plan="nothing", weights=False, context="none"))


class SlowEchoBackend(EchoBackend):
    """`slow-echo`: the echo reader, after MEMFIT_TEST_READER_SLEEP_S seconds (default 8) for a batch in
    which a prompt holds the word SLOWLY (else at once), so a test can see what else a server does while an
    answer is being generated (a provoked delay, never a reported number)."""

    name = "slow-echo"

    def generate(self, requests: Sequence[Request]) -> list[Response]:
        if any("SLOWLY" in str(m["content"]) for r in requests for m in r.messages):
            time.sleep(float(os.environ.get("MEMFIT_TEST_READER_SLEEP_S", "8")))
        return super().generate(requests)


register_backend("slow-echo", BackendEntry("seam_echo_backend:SlowEchoBackend", "json", "(the standard library)",
                                           local=True, plan="nothing", weights=False, context="none"))
