"""`memfit serve` against a hostile but fair client, as a real process on 127.0.0.1 (tests/support/live_server.py).

What a probe of the server found, one test each (paths sent byte for byte with http.client, bodies as
raw JSON where they carry what a JSON library would not write): a key reaching another user through a
twice-decoded path; one add that made the memory unopenable for everyone; a poisoned request failing
the others of its batch; errors that gave 500 or named no field; concurrent `memfit keys new` losing
keys; a full disk stopping writes for good and a shutdown that could not snapshot exiting 0; one user's
answers stalling everyone's searches, and stalled connections never closed. Then a randomized test:
16 clients, ids and encodings from an adversarial alphabet, a share of poisoned requests, a SIGKILL and
a restart. MiniLM, reranker none, summaries off, the echo readers (tests/seam_echo_backend.py: the
machinery around a reader, never a reported number).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import httpx
import pytest
import seam_echo_backend  # noqa: F401  (registers reader.backend=echo for the in-process memory)
from support.gates import gate
from support.live_server import CHEAP, DEMO, REPO, LiveServer

from memfit_gpu.config import load_config
from memfit_gpu.data import load_benchmark
from memfit_gpu.live import Memory
from memfit_gpu.names import MAX_SPEAKERS, user_id_problem
from memfit_gpu.readers.types import Response
from memfit_gpu.serve.engine import Refused, ServedMemory, memory_worker
from memfit_gpu.serve.keys import KeyRing, new_key
from memfit_gpu.store import RecordLog

pytestmark = pytest.mark.slow  # real server processes with real MiniLM weights

SLOW = [*CHEAP[:-2], "reader.backend=slow-echo", "live.consolidate=manual"]


def call(server: LiveServer, method: str, path: str, key: str | None, body: bytes | str | None = None,
         timeout: float = 120.0) -> tuple[int, Any]:
    """One request with the path exactly as given (http.client sends it verbatim); (status, JSON or text)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    try:
        conn.request(method, path, body=body.encode("ascii") if isinstance(body, str) else body, headers=headers)
        reply = conn.getresponse()
        data = reply.read()
    finally:
        conn.close()
    try:
        return reply.status, json.loads(data)
    except ValueError:
        return reply.status, data.decode("utf-8", "replace")


def turn(owner: str, n: int, **extra: Any) -> dict[str, Any]:
    return {"speaker": "Ann", "text": f"owner {owner} note {n}: the lantern by the harbor", "turn_id": f"{owner}-{n}",
            **extra}


def add_body(*turns: dict[str, Any]) -> str:
    return json.dumps({"turns": list(turns)})  # ASCII: a lone surrogate goes out as its \ud800 escape


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("hostile")
    keys_file = root / "keys.jsonl"
    keys = {user: new_key(keys_file, [user], name=user) for user in ("u1", "u2", "u3", "u4", "u5")}
    server = LiveServer(root / "memory", keys_file, [*SLOW, "serve.batch_window_ms=300", "serve.read_timeout_s=2",
                                                     "serve.max_in_flight_per_key=2", "serve.max_turns_per_user=50",
                                                     "serve.max_text_mb_per_user=1"])
    os.environ["MEMFIT_TEST_ECHO_PREFIX"] = "Question date:"  # the echo reader answers with that line
    try:
        server.start()
    finally:
        del os.environ["MEMFIT_TEST_ECHO_PREFIX"]
    for user in ("u1", "u2", "u3"):
        status, reply = call(server, "POST", f"/v1/users/{user}/turns", keys[user], add_body(turn(user, 0), turn(user, 1)))
        assert status == 200, reply
    yield server, keys
    assert server.stop() == 0
    log = server.log.read_text(errors="replace")
    assert "Traceback" not in log, log[-4000:]  # bad input never reaches the log as a traceback


# ------------------------------------------------------------------------------ 1. path decoding
ROUTES = [("GET", "/turns", None), ("POST", "/turns", add_body(turn("x", 9))),
          ("POST", "/search", json.dumps({"queries": ["lantern"]})), ("POST", "/delete", json.dumps({"turn_ids": ["x-9"]})),
          ("DELETE", "", None)]


def test_a_twice_encoded_path_reaches_no_other_user(served) -> None:
    """`/v1/users/u%2531/...` with u1's key reached the user `u%31` (the guard decoded the path again):
    turns were read, added and deleted there. Now the id is the one the server decoded, once, and an id
    outside the user-id rule is refused (422 naming the rule) on every route, before anything is read."""
    server, keys = served
    for method, tail, body in ROUTES:
        status, reply = call(server, method, f"/v1/users/u%2531{tail}", keys["u1"], body)
        assert status == 422, (method, tail, status, reply)
        assert "is not valid: 1 to 128 characters, ASCII letters, digits" in reply["detail"]
        status, reply = call(server, method, f"/v1/users/u%252{tail}", keys["u1"], body)
        assert status == 422, (method, tail, status, reply)
    # the same user written with percent escapes is that user (decoded once, like any path)
    status, reply = call(server, "GET", "/v1/users/%75%31/turns", keys["u1"])
    assert status == 200 and reply["user_id"] == "u1"
    status, reply = call(server, "GET", "/v1/users/%75%32/turns", keys["u1"])
    assert status == 403, reply


def test_no_encoding_of_a_path_lets_a_key_reach_a_user_it_is_not_bound_to(served) -> None:
    """Random ids and encodings (percent, double percent, unicode, dot segments, encoded slashes), on
    every route: a request is served only when the id the server decodes is one its key is bound to."""
    server, keys = served
    rng = random.Random(33)
    pieces = ["u1", "u2", "u3", "%", "%25", "%2F", "/", "..", ".", "%2E", "u%31", "\u00fc", "\u202e", "@", ":",
              "-", "_", "u", "2", "%3F", "?", "#", "%00", ";", "%5C"]
    for _ in range(200):
        key_user = rng.choice(["u1", "u2"])
        if rng.random() < 0.3:  # the key's own id with some characters percent-encoded twice: u%2531
            raw = "".join(f"%25{ord(c):02X}" if rng.random() < 0.5 else c for c in key_user)
            encoded = raw if "%" in raw else f"%25{ord(key_user[0]):02X}{key_user[1:]}"
        else:
            raw = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 3)))
            encoded = raw if rng.random() < 0.5 else quote(raw, safe="")
            if rng.random() < 0.25:
                encoded = quote(encoded, safe="")  # twice
        segment = "".join(c if c.isascii() and c.isprintable() and c not in " " else quote(c) for c in encoded)
        method, tail, body = rng.choice(ROUTES)
        status, reply = call(server, method, f"/v1/users/{segment}{tail}", keys[key_user], body)
        decoded = unquote(segment.split("?")[0].split("#")[0])
        if status == 200:
            assert decoded == key_user, (segment, method, tail, reply)
            if method == "GET":
                assert all(t["turn_id"].startswith(f"{key_user}-") for t in reply["turns"])
        else:
            assert status in (400, 403, 404, 405, 409, 422), (segment, status, reply)
    # nobody's turns moved: the other users still have exactly theirs
    for user in ("u2", "u3"):
        status, reply = call(server, "GET", f"/v1/users/{user}/turns", keys[user])
        assert status == 200 and {t["turn_id"] for t in reply["turns"]} == {f"{user}-0", f"{user}-1"}


# ----------------------------------------------------------------------- 3 and 7. poisoned requests
def _concurrently(*calls: Any) -> list[tuple[int, Any]]:
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda c: c(), calls))


def test_a_poisoned_request_fails_alone_and_says_which_field(served) -> None:
    """A request that passed validation but failed inside the batched call (a lone surrogate in a turn id,
    a session id, a date text, an image caption or a query; a query of 70,000 known tokens) failed every
    request batched with it, with its error; now it is refused alone, naming its field (the long query:
    the request's word limit, before any batch), and the others of its batch get their own results."""
    server, keys = served
    poisons = [
        ("POST", "/turns", add_body(turn("u1", 50, turn_id="\ud800")), "turns.0.turn_id"),
        ("POST", "/turns", add_body(turn("u1", 51, session_id="s\udfff")), "turns.0.session_id"),
        ("POST", "/turns", add_body(turn("u1", 52, date_text="\ud83d")), "turns.0.date_text"),
        ("POST", "/turns", add_body(turn("u1", 53, images=[{"caption": "a \udc00 dog"}])), "turns.0.images.0.caption"),
        ("POST", "/search", json.dumps({"queries": ["lantern \ud800"]}), "queries.0"),
        ("POST", "/search", json.dumps({"queries": ["lantern harbor " * 35_000]}), "serve.max_query_words_per_request"),
    ]
    for n, (method, tail, body, field) in enumerate(poisons):
        good_add = add_body(turn("u2", 100 + n))
        results = _concurrently(
            lambda m=method, t=tail, b=body: call(server, m, f"/v1/users/u1{t}", keys["u1"], b),
            lambda b=good_add: call(server, "POST", "/v1/users/u2/turns", keys["u2"], b),
            lambda: call(server, "POST", "/v1/users/u3/search", keys["u3"], json.dumps({"queries": ["lantern"], "k": 2})))
        (bad_status, bad), (add_status, added), (search_status, found) = results
        assert bad_status == 422 and field in bad["detail"], (field, bad_status, bad)
        assert add_status == 200 and added["added"][0]["turn_id"] == f"u2-{100 + n}", added
        assert set(added["added"][0]) == {"user_id", "turn_id", "duplicate"}  # no store row: it counts others' turns
        assert search_status == 200 and len(found["results"][0]) == 2, found
    status, reply = call(server, "GET", "/v1/users/u2/turns", keys["u2"])
    assert {f"u2-{100 + n}" for n in range(len(poisons))} <= {t["turn_id"] for t in reply["turns"]}


@pytest.mark.parametrize(("body", "field"), [
    ('{"queries": ["lantern"], "k": NaN}', "k"),
    ('{"queries": ["lantern"], "k": Infinity}', "k"),
    ('{"queries": ["lantern"], "k": 1e309}', "k"),
    ('{"queries": ["lantern"], "k": "5"}', "k"),
    ('{"queries": ["lantern"], "k": true}', "k"),
    ('{"queries": ["lantern"], "k": 2.0}', "k"),
    ('{"queries": ["\\ud800"]}', "queries.0"),
])
def test_bad_search_bodies_are_422_naming_the_field(served, body: str, field: str) -> None:
    """`k` NaN, Infinity or 1e309 gave 500 (the 422 body echoed a value JSON cannot write); "5", true and
    2.0 were taken as k; a surrogate query gave a message from the tokenizer naming no field."""
    server, keys = served
    status, reply = call(server, "POST", "/v1/users/u1/search", keys["u1"], body)
    assert status == 422, reply
    assert reply["detail"].startswith(f"body.{field}") or reply["detail"].startswith(field), reply
    assert all("input" not in e for e in reply.get("errors", []))  # summarised, never echoed


@pytest.mark.parametrize("turn_fields", [{"text": "a \ud800 b"}, {"speaker": "\udfffAnn"}])
def test_a_lone_surrogate_in_a_turn_is_422_naming_the_field(served, turn_fields: dict[str, str]) -> None:
    server, keys = served
    status, reply = call(server, "POST", "/v1/users/u1/turns", keys["u1"], add_body({**turn("u1", 70), **turn_fields}))
    field = next(iter(turn_fields))
    assert status == 422 and reply["detail"].startswith(f"body.turns.0.{field}: "), reply
    assert "surrogate" in reply["detail"] or "unicode string" in reply["detail"], reply


@pytest.mark.parametrize("field", ["turn_id", "session_id", "speaker"])
def test_a_label_longer_than_256_characters_is_422(served, field: str) -> None:
    """Turn ids and session ids were unbounded and uncounted: with tiny texts and 200 KB ids one user stored
    31 MiB past its text share (every user's adds then stop when the disk fills); a 12 KB speaker name entered
    every LightMem prompt quoting its turns, past what a reader's server takes. A label is at most 256
    characters (names.LABEL_MAX)."""
    server, keys = served
    status, reply = call(server, "POST", "/v1/users/u1/turns", keys["u1"],
                         add_body({**turn("u1", 71), field: "x" * 257}))
    n = 71 + ["turn_id", "session_id", "speaker"].index(field)  # a turn of its own: the one above is refused
    assert status == 422, reply
    assert reply["detail"] == (f"add, item user 'u1' turn 0, field '{field}': 257 characters; a {field} is at most "
                               "256"), reply
    assert call(server, "POST", "/v1/users/u1/turns", keys["u1"],
                add_body({**turn("u1", n), field: "x" * 256}))[0] == 200


def test_a_date_text_that_names_the_session_is_422_past_256_characters(served) -> None:
    """A turn with neither session_id nor timestamp takes its date_text as its session id: a 100,000-character
    date_text stored a 100,000-character session id, past the bound a session_id has. Now it is refused, naming
    the field; beside a session id a long date_text is only the date the episode text writes."""
    server, keys = served
    status, reply = call(server, "POST", "/v1/users/u1/turns", keys["u1"],
                         add_body(turn("u1", 80, date_text="d" * 100_000)))
    assert status == 422, reply
    assert reply["detail"] == ("add, item user 'u1' turn 0, field 'date_text': 100,000 characters; a date_text is at "
                               "most 256 when it names the session (a turn without session_id or timestamp)"), reply
    assert call(server, "POST", "/v1/users/u1/turns", keys["u1"],
                add_body(turn("u1", 81, date_text="d" * 300, session_id="s-81")))[0] == 200
    listed = {t["turn_id"]: t["session_id"] for t in call(server, "GET", "/v1/users/u1/turns", keys["u1"])[1]["turns"]}
    assert "u1-80" not in listed and listed["u1-81"] == "s-81"


@pytest.mark.parametrize(("body", "why"), [
    ("[" * 5_000 + "]" * 5_000, "JSON nested too deeply to parse"),
    ('{"queries": [' * 2_000 + '"lantern"' + "]}" * 2_000, "JSON nested too deeply to parse"),
    ('{"queries": ["lantern"], "k": 1' + "0" * 5_000 + "}", "an integer of more than 4,300 digits"),
    (b'{"queries": ["lantern \xff"]}', "not UTF-8 text (invalid start byte at byte 22)"),
])
def test_json_the_server_cannot_parse_is_422_naming_the_body(served, body: str | bytes, why: str) -> None:
    """Valid JSON text that Python's parser will not take (nested past its recursion limit, an integer of more
    than 4,300 digits) and a body that is not UTF-8 got FastAPI's bare 400 "There was an error parsing the
    body"; malformed JSON is 422 naming the field, here the body."""
    server, keys = served
    status, reply = call(server, "POST", "/v1/users/u1/search", keys["u1"], body)
    assert (status, reply) == (422, {"detail": f"body: not read as JSON: {why}"})
    assert call(server, "POST", "/v1/users/u1/search", keys["u1"], json.dumps({"queries": ["lantern"]}))[0] == 200


def test_consolidate_takes_no_body_and_names_a_bad_user_id_by_its_place(served) -> None:
    """POST /v1/consolidate without a body was 422 "body: Field required", though its body is optional; a bad id
    in user_ids was refused as "path: ...", naming a path the request does not have."""
    server, keys = served
    admin = new_key(server.keys, ["u1", "u2"], name="admin", admin=True)  # the server reads its keys file again
    for body in (None, "{}", json.dumps({"user_ids": ["u1"]})):
        status, reply = call(server, "POST", "/v1/consolidate", admin, body)
        assert status == 200 and set(reply) == {"consolidated"}, (body, status, reply)
    status, reply = call(server, "POST", "/v1/consolidate", admin, json.dumps({"user_ids": ["u1", "../u2"]}))
    assert status == 422, reply
    assert reply["detail"] == ("body.user_ids.1: Value error, user id '../u2' is not valid: 1 to 128 characters, "
                               "ASCII letters, digits and _ - . @ : only, starting with a letter or digit"), reply
    status, reply = call(server, "POST", "/v1/consolidate", admin, json.dumps({"user_ids": ["u1", "u3"]}))
    assert (status, reply) == (403, {"detail": "key 'admin' is not bound to user 'u3'"})


def test_the_answer_route_passes_the_question_date(served) -> None:
    """The echo reader answers with the prompt's first line: the date the request gave is in it."""
    server, keys = served
    status, reply = call(server, "POST", "/v1/users/u1/answer", keys["u1"],
                         json.dumps({"questions": ["Where is the lantern?"], "question_date": "2031-02-03"}))
    assert status == 200, reply
    status, plain = call(server, "POST", "/v1/users/u1/answer", keys["u1"],
                         json.dumps({"questions": ["Where is the lantern?"]}))
    prompt_with, prompt_without = reply["answers"][0]["raw_output"], plain["answers"][0]["raw_output"]
    assert "2031" in prompt_with and "2031" not in prompt_without, (prompt_with, prompt_without)


# ------------------------------------------------------------------------------- 10. no stalls
def test_one_users_answers_do_not_stall_another_users_searches(served) -> None:
    """Every call ran on the memory's one worker, so another user's answer held searches for its whole
    generation (4,349 ms against ~20 ms with SmolLM2); now generation runs beside the worker. The slow-echo
    reader takes 8 s for this answer: u2's searches meanwhile come back one after another, the first long
    before the answer does. (How long a search takes beside a real model's generation is measured by
    experiments/bench_isolation.py: docs/benchmarks/history.md.)"""
    server, keys = served

    def search() -> float:
        status, _ = call(server, "POST", "/v1/users/u2/search", keys["u2"], json.dumps({"queries": ["lantern"]}))
        assert status == 200
        return time.monotonic()

    with ThreadPoolExecutor(1) as pool:
        asked = time.monotonic()
        answer = pool.submit(call, server, "POST", "/v1/users/u1/answer", keys["u1"],
                             json.dumps({"questions": ["Who keeps the lantern by the harbor, SLOWLY?"]}))
        time.sleep(1.0)  # the answer's batch window (0.3 s) and its read are behind it: it is generating
        done = []
        while not answer.done():
            done.append(search() - asked)
        status, _ = answer.result()
        answered = time.monotonic() - asked
    assert status == 200 and answered >= 8.0
    before = [t for t in done if t < answered - 0.5]
    assert len(before) >= 2 and before[0] < 5.0, (done, answered)


def test_one_key_takes_a_bounded_share_of_the_server(served) -> None:
    """A probe held the one worker for 5.9 s with one request (64 queries of 5,400 words, k=100), could keep
    64 such requests in flight from one key and could add turns until the disk was full for everyone. Now a
    request's queries hold at most serve.max_query_words_per_request words together (422), a key has at most
    serve.max_in_flight_per_key requests being served (2 here; 429 with Retry-After, other keys served
    meanwhile), and a user at most serve.max_turns_per_user turns (50 here; 507, nothing of the add stored)."""
    server, keys = served
    url = f"http://127.0.0.1:{server.port}"
    heavy = json.dumps({"queries": [" ".join(["lantern"] * 100)] * 41, "k": 100})  # 4,100 words
    status, reply = call(server, "POST", "/v1/users/u2/search", keys["u2"], heavy)
    assert status == 422 and reply["detail"] == ("4100 words of queries in one request; at most "
                                                 "serve.max_query_words_per_request=4096"), reply
    light = json.dumps({"queries": [" ".join(["lantern"] * 100)] * 40, "k": 100})  # 4,000 words
    assert call(server, "POST", "/v1/users/u2/search", keys["u2"], light)[0] == 200
    slow = json.dumps({"questions": ["Who lit the lantern by the harbor today, SLOWLY?"]})  # asked nowhere else
    with ThreadPoolExecutor(2) as pool:
        answers = [pool.submit(call, server, "POST", "/v1/users/u1/answer", keys["u1"], slow) for _ in range(2)]
        time.sleep(1.0)  # both are being served (generating for 8 s)
        third = httpx.post(f"{url}/v1/users/u1/search", json={"queries": ["lantern"]}, timeout=30,
                           headers={"Authorization": f"Bearer {keys['u1']}"})
        assert third.status_code == 429 and third.headers["retry-after"] == "1", third.text
        assert third.json()["detail"] == ("key 'u1' has 2 requests being served; at most "
                                          "serve.max_in_flight_per_key=2")
        other = call(server, "POST", "/v1/users/u2/search", keys["u2"], json.dumps({"queries": ["lantern"]}))
        assert other[0] == 200 and not any(a.done() for a in answers)  # another key, meanwhile
        assert [a.result()[0] for a in answers] == [200, 200]
    assert call(server, "POST", "/v1/users/u1/search", keys["u1"], json.dumps({"queries": ["lantern"]}))[0] == 200
    assert call(server, "POST", "/v1/users/u4/turns", keys["u4"], add_body(*(turn("u4", n) for n in range(50))))[0] == 200
    status, reply = call(server, "POST", "/v1/users/u4/turns", keys["u4"], add_body(turn("u4", 50), turn("u4", 51)))
    assert status == 507 and reply["detail"] == ("user 'u4' would hold 52 turns (deleted ones count until "
                                                 "compaction); at most 50: serve.max_turns_per_user"), reply
    assert call(server, "POST", "/v1/users/u4/turns", keys["u4"], add_body(turn("u4", 0)))[0] == 200  # a retry: stored
    assert len(call(server, "GET", "/v1/users/u4/turns", keys["u4"])[1]["turns"]) == 50


def test_a_question_too_long_for_the_reader_is_422(served) -> None:
    """A one-word question (or a question date) of 500,000 characters passes the word bound but makes an answer
    prompt longer than reader.max_prompt_chars even without excerpts: a 500 with a traceback in the log. It is
    the asker's input: 422 naming why."""
    server, keys = served
    for body in ({"questions": ["x" * 500_000]}, {"questions": ["When?"], "question_date": "z" * 500_000}):
        status, reply = call(server, "POST", "/v1/users/u1/answer", keys["u1"], json.dumps(body))
        assert status == 422, reply
        assert "the answer prompt without its excerpts is still too long" in reply["detail"], reply
    assert call(server, "POST", "/v1/users/u1/answer", keys["u1"], json.dumps({"questions": ["When?"]}))[0] == 200


def test_one_user_holds_a_bounded_share_of_the_disk(served) -> None:
    """Within its turn quota a user could still fill the disk that every user writes to (turns of up to a
    request body each). Now a user holds at most serve.max_text_mb_per_user of episode text (1 MiB here: 507,
    nothing of the add stored), and the other users' adds go on."""
    server, keys = served
    long = " ".join(["harbor"] * 90_000)  # 629,999 bytes of text, under serve.max_body_bytes
    assert call(server, "POST", "/v1/users/u5/turns", keys["u5"], add_body(turn("u5", 0, text=long)))[0] == 200
    stored = len(call(server, "GET", "/v1/users/u5/turns", keys["u5"])[1]["turns"][0]["text"])
    status, reply = call(server, "POST", "/v1/users/u5/turns", keys["u5"], add_body(turn("u5", 1, text=long)))
    assert status == 507, reply
    assert reply["detail"].startswith("user 'u5' would hold 1,260,") and reply["detail"].endswith(
        " bytes of turn text (deleted turns count until compaction); at most 1,048,576: serve.max_text_mb_per_user")
    assert len(call(server, "GET", "/v1/users/u5/turns", keys["u5"])[1]["turns"]) == 1 and stored == len(long)
    assert call(server, "POST", "/v1/users/u5/turns", keys["u5"], add_body(turn("u5", 2)))[0] == 200  # under it
    assert call(server, "POST", "/v1/users/u1/turns", keys["u1"], add_body(turn("u1", 7, text=long)))[0] == 200


def run_served(served: ServedMemory, requests: Callable[[], Awaitable[None]],
               release: threading.Event | None = None) -> None:
    """`requests()` against `served` between its start and its stop, which drains it and closes the memory and
    its worker (the stop must succeed); a gated generation (`gate`) is let go first if `requests` failed while
    it was held."""
    async def main() -> None:
        served.start()
        try:
            await requests()
        finally:
            if release is not None:
                release.set()
            assert await served.stop() is None

    asyncio.run(main())


def test_adds_stop_short_of_a_full_disk_while_reads_and_deletes_go_on(tmp_path: Path) -> None:
    """One client filling the disk stopped every user's adds; now adds stop while the store's disk has less
    than serve.min_free_disk_mb free (here more than any disk has: 507 naming the setting), and searches and
    deletes, which need no new space, are served."""
    cfg = load_config(DEMO, [*CHEAP, "serve.min_free_disk_mb=1000000000"])
    memory = Memory.open(tmp_path / "memory", cfg)
    memory.add("u1", [turn("u1", 0), turn("u1", 1)])  # the Python API has no serve.* limit
    served = ServedMemory(memory, cfg)

    async def requests() -> None:
        with pytest.raises(Refused) as refused:
            await served.add("u1", [turn("u1", 2)])
        assert refused.value.status == 507 and "adds stop below serve.min_free_disk_mb=1,000,000,000" in \
            refused.value.message
        assert str(tmp_path) not in refused.value.message  # no path of the server's to a client
        assert sorted(h.turn_ids[0] for h in (await served.search("u1", ["lantern"], 2))[0]) == ["u1-0", "u1-1"]
        assert (await served.delete("u1", ["u1-0"]))["episodes"] == 1

    run_served(served, requests)
    assert [t["turn_id"] for t in Memory.open(tmp_path / "memory", cfg).turns("u1")] == ["u1-1"]


def test_a_delete_rebuilding_a_summary_holds_no_other_user_s_search_on_the_server(
        tmp_path: Path, locomo_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The served delete ran on the one worker every search and add runs on: while its summary was rebuilt (an
    LLM call), every other user's search waited, even once the memory itself no longer held them. It runs on a
    thread of its own now, as consolidate does."""
    memory = load_benchmark("locomo", locomo_path).memories[0]
    turns = [{"speaker": t.speaker, "text": t.text, "timestamp": t.timestamp, "turn_id": t.turn_id,
              "session_id": s.session_id} for s in memory.sessions[:3] for t in s.turns]
    cfg = load_config(DEMO, [*CHEAP, "summary.enabled=true"])
    worker = memory_worker()
    live = worker.submit(Memory.open, tmp_path / "memory", cfg).result()
    worker.submit(live.add, "u1", turns).result()
    worker.submit(live.add, "u2", turns[:4]).result()
    assert worker.submit(live.consolidate, ["u1"]).result()["summaries"] > 0
    store = live.store
    covered = next(s for s in store.summaries.live_rows(store.memory_of("u1")) if len(store.summaries.members[s]) > 3)
    victim = str(store.turn_id[int(store.summaries.members[covered][1])])
    inside, release = gate(monkeypatch, live, lambda requests: any(r.role == "summary" for r in requests))
    served = ServedMemory(live, cfg, worker)

    async def requests() -> None:
        deleting = asyncio.create_task(served.delete("u1", [victim]))
        while not inside.is_set():
            await asyncio.sleep(0.05)
        hits = await asyncio.wait_for(served.search("u2", ["Caroline"], 2), 10)  # meanwhile
        assert hits and not deleting.done()
        release.set()
        assert await deleting == {"episodes": 1, "summaries_retired": 1, "summaries_rebuilt": 1}

    run_served(served, requests, release)


def test_a_compaction_waiting_for_the_reader_holds_no_other_user_s_search_on_the_server(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compaction drops the cached replies of users with deleted turns while no reader call commits, so it
    waits for an answer being generated. It waited holding the memory, on the one worker: every user's search
    stood still until that answer was done. Now the memory is held for the store's rewrite only, and the served
    compaction runs on a thread of its own."""
    cfg = load_config(DEMO, CHEAP)
    worker = memory_worker()
    live = worker.submit(Memory.open, tmp_path / "memory", cfg).result()
    worker.submit(live.add, "u1", [turn("u1", i) for i in range(4)]).result()
    worker.submit(live.add, "u2", [turn("u2", i) for i in range(4)]).result()
    worker.submit(live.answer, "u1", ["Where is the lantern?"], 2).result()  # a cached reply of u1
    worker.submit(live.delete, "u1", ["u1-0"]).result()
    inside, release = gate(monkeypatch, live, lambda requests: any(
        "SLOWLY" in str(m["content"]) for r in requests for m in r.messages))  # u2's answer
    served = ServedMemory(live, cfg, worker)

    async def requests() -> None:
        answering = asyncio.create_task(served.answer("u2", ["Where is the lantern, SLOWLY?"], 2))
        while not inside.is_set():
            await asyncio.sleep(0.05)
        compacting = asyncio.create_task(served.compact())
        await asyncio.sleep(0.5)  # the compaction has rewritten the store and waits for the reader
        hits = await asyncio.wait_for(served.search("u2", ["lantern"], 2), 10)  # meanwhile
        assert hits and not compacting.done() and not answering.done()
        release.set()
        compacted = await compacting
        assert compacted["users_with_deleted_turns"] == 1 and compacted["cache_responses_dropped"] >= 1, compacted
        assert (await answering)[0].answer

    run_served(served, requests, release)


def _served_with_a_failing_reader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, why: str,
                                  answered: bool) -> ServedMemory:
    """A served memory of user u1 (two turns) whose reader fails every request with `why`."""
    cfg = load_config(DEMO, CHEAP)
    worker = memory_worker()
    live = worker.submit(Memory.open, tmp_path / "memory", cfg).result()
    worker.submit(live.add, "u1", [turn("u1", i) for i in range(2)]).result()
    monkeypatch.setattr(live.reader().backend, "generate", lambda requests: [
        Response("", 0, 0, 0.0, False, "m", error=why, answered=answered) for _ in requests])
    return ServedMemory(live, cfg, worker)


def test_a_reader_without_an_answer_is_503_naming_no_endpoint_of_the_server(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader's error names its endpoint and quotes that server's reply; the client got both in its 503.
    The reply now says what happened; the server's log keeps the rest."""
    served = _served_with_a_failing_reader(
        tmp_path, monkeypatch, "http://10.0.0.7:8000/v1/chat/completions refused request 'k': HTTP 400: "
                               "{'detail': 'bad'}", answered=False)

    async def ask() -> None:
        with pytest.raises(Refused) as refused:
            await served.answer("u1", ["Where is the lantern?"], 2)
        assert refused.value.status == 503 and "10.0.0.7" not in refused.value.message, refused.value.message
        assert refused.value.message.startswith("the reader gave no answer to this request")

    run_served(served, ask)


def test_an_answer_the_reader_could_not_give_names_the_cause_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """vLLM answers a request it refused with "{exception}: {engine message}" (readers/vllm.py), which may name the
    model's path; the answer's `error` reached the client verbatim. It now says the reader could not answer; the
    server's log keeps the message."""
    why = "ValueError: /srv/models/private-70b prompt of 9,000 tokens is longer than max_model_len 8,192"
    served = _served_with_a_failing_reader(tmp_path, monkeypatch, why, answered=True)

    async def ask() -> None:
        found = await served.answer("u1", ["Where is the lantern?", "And the harbor?"], 2)
        assert [a.to_json()["error"] for a in found] == [
            "the reader could not answer this question (the memory server's log says why)"] * 2
        assert all(a.answer == "" and a.hits for a in found)

    with caplog.at_level("WARNING", logger="memfit_gpu.serve.engine"):
        run_served(served, ask)
    assert caplog.messages.count(f"memfit serve: the reader could not answer a question: {why}") == 2


def test_stalled_connections_are_closed(served) -> None:
    """A client that connects and sends nothing, part of its headers, or part of its body held its
    connection forever; now headers and body each have serve.read_timeout_s (2 s here): the first two
    are closed, the third gets 408 and is closed."""
    server, keys = served
    partial_body = (f"POST /v1/users/u1/search HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {keys['u1']}\r\n"
                    "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"que").encode()
    sockets = {}
    for name, data in [("nothing", b""), ("headers", b"GET /healthz HTTP/1.1\r\nHost: x\r\n"), ("body", partial_body)]:
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(data)
        sock.settimeout(10)
        sockets[name] = sock
    time.sleep(4)
    for name, sock in sockets.items():
        received = b""
        while True:
            chunk = sock.recv(4096)
            if not chunk:
                break
            received += chunk
        sock.close()
        if name == "body":
            assert received.startswith(b"HTTP/1.1 408"), received[:200]
        else:
            assert received == b"", (name, received[:200])


# ------------------------------------------------------------------------------ 2. speakers
def test_an_add_past_63_speakers_is_refused_whole_and_the_memory_reopens(tmp_path: Path) -> None:
    """One add with 64 speakers got 422 after its 66 records were logged, the rows of the next add
    collided with them, and replay then refused the log: the memory could not be opened for anyone.
    Growing a user to 64 speakers over several adds did the same. Now nothing is logged for the refused
    add, the others' adds go on, row numbers stay unique and the memory reopens."""
    keys_file = tmp_path / "keys.jsonl"
    keys = {user: new_key(keys_file, [user]) for user in ("u1", "u2")}
    server = LiveServer(tmp_path / "memory", keys_file, CHEAP).start()
    try:
        many = [{"speaker": f"s{i}", "text": f"hello from s{i}"} for i in range(MAX_SPEAKERS + 1)]
        status, reply = call(server, "POST", "/v1/users/u1/turns", keys["u1"], add_body(*many))
        assert status == 422 and "64th speaker" in reply["detail"] and "at most 63" in reply["detail"], reply
        assert call(server, "POST", "/v1/users/u2/turns", keys["u2"], add_body(turn("u2", 0)))[0] == 200
        for start in range(0, MAX_SPEAKERS, 21):  # 63 speakers over three adds: taken
            assert call(server, "POST", "/v1/users/u1/turns", keys["u1"], add_body(*many[start:start + 21]))[0] == 200
        status, reply = call(server, "POST", "/v1/users/u1/turns", keys["u1"], add_body(many[MAX_SPEAKERS]))
        assert status == 422 and "64th speaker" in reply["detail"]
        assert call(server, "POST", "/v1/users/u2/turns", keys["u2"], add_body(turn("u2", 1)))[0] == 200
        assert server.stop() == 0
        server.start()  # reopened: the log replays
        status, reply = call(server, "GET", "/v1/users/u1/turns", keys["u1"])
        assert status == 200 and len(reply["turns"]) == MAX_SPEAKERS
        status, reply = call(server, "GET", "/v1/users/u2/turns", keys["u2"])
        assert [t["turn_id"] for t in reply["turns"]] == ["u2-0", "u2-1"]
    finally:
        server.kill()
    rows = [r["row"] for r in RecordLog(tmp_path / "memory" / "store" / "log.jsonl").records if r.get("t") == "episode"]
    assert rows == list(range(MAX_SPEAKERS + 2))


# ------------------------------------------------------------------------------ 9. a full disk
def test_a_full_disk_stops_writes_only_while_it_is_full(tmp_path: Path) -> None:
    """Once the log append met ENOSPC every later add got 422 "write to closed file", also after space
    was freed; now the add that met the full disk gets 507 (the server's log names the file, the reply no path
    of the server's), and the next one is stored.
    (MEMFIT_IO_FAULT makes the 3rd log append fail with ENOSPC; the ones after it find space again.)"""
    keys_file = tmp_path / "keys.jsonl"
    key = new_key(keys_file, ["u1"])
    server = LiveServer(tmp_path / "memory", keys_file, CHEAP)
    os.environ["MEMFIT_IO_FAULT"] = "log.jsonl:ENOSPC:3"  # 1: the header, 2: the first add
    try:
        server.start()
    finally:
        del os.environ["MEMFIT_IO_FAULT"]
    try:
        assert call(server, "POST", "/v1/users/u1/turns", key, add_body(turn("u1", 0)))[0] == 200
        status, reply = call(server, "POST", "/v1/users/u1/turns", key, add_body(turn("u1", 1)))
        assert status == 507 and reply["detail"] == ("disk full: No space left on device; what was stored before is "
                                                     "kept (the server's log names the file)"), reply
        assert "log.jsonl" in server.log.read_text()  # the operator's log names the file; the client learns no path
        assert call(server, "POST", "/v1/users/u1/turns", key, add_body(turn("u1", 2)))[0] == 200
        assert call(server, "POST", "/v1/users/u1/turns", key, add_body(turn("u1", 1)))[0] == 200
        status, reply = call(server, "GET", "/v1/users/u1/turns", key)
        assert [t["turn_id"] for t in reply["turns"]] == ["u1-0", "u1-2", "u1-1"]
        assert server.stop() == 0
    finally:
        server.kill()
    records = RecordLog(tmp_path / "memory" / "store" / "log.jsonl").records
    assert [r["turn"] for r in records if r.get("t") == "episode"] == ["u1-0", "u1-2", "u1-1"]


def test_a_shutdown_that_cannot_snapshot_exits_non_zero_saying_so(tmp_path: Path) -> None:
    """With the disk full at SIGTERM the closing snapshot failed, and the process still exited 0 saying it
    drained; now it exits 2 with one line naming the file, and the next start replays the log."""
    keys_file = tmp_path / "keys.jsonl"
    key = new_key(keys_file, ["u1"])
    server = LiveServer(tmp_path / "memory", keys_file, [*CHEAP, "live.snapshot_after_turns=1000"])
    os.environ["MEMFIT_IO_FAULT"] = "meta.json:ENOSPC"  # the first snapshot's last file
    try:
        server.start()
    finally:
        del os.environ["MEMFIT_IO_FAULT"]
    try:
        assert call(server, "POST", "/v1/users/u1/turns", key, add_body(turn("u1", 0), turn("u1", 1)))[0] == 200
        assert server.stop() == 2
        log = server.log.read_text()
        assert "memfit serve: error: " in log and "drained, but closing the memory failed" in log
        assert "store/snapshots: writing failed: No space left on device" in log
        server.start()
        status, reply = call(server, "GET", "/v1/users/u1/turns", key)
        assert status == 200 and [t["turn_id"] for t in reply["turns"]] == ["u1-0", "u1-1"]
        assert server.stop() == 0
    finally:
        server.kill()


# ------------------------------------------------------------------------------ 8. keys
@pytest.mark.fresh_interpreter  # 16 small processes: cheaper fresh than forked from the test zygote
def test_sixteen_concurrent_keys_new_each_add_their_key(tmp_path: Path) -> None:
    """16 `memfit keys new` at once lost 1-3 printed keys and 9-13 failed on the shared keys.jsonl.tmp;
    now each adds its key under the file's lock, with a temporary file of its own."""
    keys_file = tmp_path / "keys.jsonl"
    procs = [subprocess.Popen([sys.executable, "-m", "memfit_gpu.cli", "keys", "new", "--keys", str(keys_file),
                               "--user", f"agent{i}", "--name", f"agent{i}"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=REPO) for i in range(16)]
    printed = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        printed.append(out.strip())
    ring = KeyRing.load(keys_file)
    assert len(ring.keys) == 16
    for i, key in enumerate(printed):
        found = ring.find(key)
        assert found is not None and found.users == {f"agent{i}"}
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".keys.jsonl.*.tmp"))


# ------------------------------------------------------------------------------ randomized
def test_randomized_hostile_clients_never_cross_users_and_lose_nothing_acknowledged(tmp_path: Path) -> None:
    """16 clients, each with a key for its own two users, send 2,000 requests: adds, searches and reads of
    their own users, the same for other clients' users through crafted ids (percent, double percent,
    unicode, dot segments, encoded slashes), and poisoned requests (lone surrogates, 64 speakers, NaN k, a
    70,000-token query). The server is SIGKILLed at request 1,600 and restarted. Then: no response ever
    served another client's user or held its text, every poisoned request was refused alone (4xx; every
    valid request beside it was served), every acknowledged add is stored exactly once, and the memory
    reopens."""
    rng = random.Random(3304)
    clients = 16
    users = {c: [f"c{c:02d}a", f"c{c:02d}.b"] for c in range(clients)}
    keys_file = tmp_path / "keys.jsonl"
    keys = {c: new_key(keys_file, users[c], name=f"client{c}") for c in range(clients)}
    owner_of = {u: c for c, us in users.items() for u in us}
    server = LiveServer(tmp_path / "memory", keys_file, [*CHEAP, "serve.batch_window_ms=20"]).start()
    acknowledged: dict[str, set[str]] = {u: set() for u in owner_of}
    sent: dict[str, set[str]] = {u: set() for u in owner_of}
    problems: list[str] = []
    lock = threading.Lock()
    killed = threading.Event()

    def crafted(target: str) -> str:
        kind = rng.random()
        if kind < 0.3:
            return quote(target, safe="")  # decodes to the target itself
        if kind < 0.5:
            return "".join(f"%{ord(c):02X}" for c in target)
        if kind < 0.65:
            return quote(quote(target, safe=""), safe="") + "%2531"
        if kind < 0.75:
            return target + "%2F..%2F" + target
        if kind < 0.85:
            return quote(target + "\u00fc", safe="")
        return rng.choice(["..", ".", "%2E%2E", target + "%00", target.upper()])

    def plan(n: int) -> tuple[int, str, str, str | None, str, str]:
        """(client, method, path, body, kind, user)"""
        client = rng.randrange(clients)
        own = rng.choice(users[client])
        roll = rng.random()
        if roll < 0.45:
            body = add_body(turn(own, n), *([turn(own, n * 10_000 + 1)] if rng.random() < 0.3 else []))
            return client, "POST", f"/v1/users/{own}/turns", body, "add", own
        if roll < 0.65:
            return client, "POST", f"/v1/users/{own}/search", json.dumps({"queries": ["lantern harbor note"], "k": 3}), "search", own
        if roll < 0.72:
            return client, "GET", f"/v1/users/{own}/turns", None, "read", own
        if roll < 0.92:
            other = rng.choice([u for u in owner_of if owner_of[u] != client])
            segment = crafted(other) if rng.random() < 0.7 else other
            method, tail, body = rng.choice(ROUTES)
            return client, method, f"/v1/users/{segment}{tail}", body, "attack", other
        poison = rng.choice([
            add_body(turn(own, n, text="x \ud800")),
            add_body(*[{"speaker": f"s{i}", "text": "hi"} for i in range(MAX_SPEAKERS + 1)]),
            '{"queries": ["lantern"], "k": NaN}',
            json.dumps({"queries": ["lantern harbor " * 35_000]}),
        ])
        tail = "/turns" if poison.startswith('{"turns"') else "/search"
        return client, "POST", f"/v1/users/{own}{tail}", poison, "poison", own

    for user, owner in owner_of.items():  # every user has a turn before the stream starts (reads are not 404)
        status, reply = call(server, "POST", f"/v1/users/{user}/turns", keys[owner], add_body(turn(user, -1)))
        assert status == 200, reply
        acknowledged[user].add(f"{user}--1")
        sent[user].add(f"{user}--1")
    requests = [plan(n) for n in range(2000)]

    def run(item: tuple[int, tuple[int, str, str, str | None, str, str]]) -> None:
        n, (client, method, path, body, kind, user) = item
        if n == 1600 and not killed.is_set():
            killed.set()
            server.kill()
        if killed.is_set() and n >= 1600:
            return
        if kind == "add":
            with lock:
                sent[user].update(t["turn_id"] for t in json.loads(body)["turns"])  # type: ignore[arg-type]
        try:
            status, reply = call(server, method, path, keys[client], body, timeout=60)
        except (OSError, http.client.HTTPException):
            if not killed.is_set():
                with lock:
                    problems.append(f"request {n} ({kind} {path}) got no reply before the kill")
            return
        text = json.dumps(reply)
        with lock:
            if status >= 500:
                problems.append(f"request {n} ({kind} {method} {path}): {status} {text[:200]}")
            if kind in ("add", "search", "read") and status != 200:
                problems.append(f"request {n} ({kind} {path}): a valid request got {status} {text[:200]}")
            if kind == "add" and status == 200:
                acknowledged[user].update(a["turn_id"] for a in reply["added"])
            if kind == "poison" and not 400 <= status < 500:
                problems.append(f"request {n}: a poisoned request got {status}")
            if kind == "attack" and status == 200:
                decoded = unquote(path.split("/")[3])
                if decoded not in users[client]:
                    problems.append(f"request {n}: client {client} reached {decoded!r} through {path}: {text[:200]}")
            if status == 200:  # no reply names another client's user in its text
                foreign = [u for u in owner_of if owner_of[u] != client and f"owner {u} " in text]
                if foreign:
                    problems.append(f"request {n} ({kind} {path}): client {client} got text of {foreign}")

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(run, enumerate(requests)))
    assert killed.is_set() and not problems, problems[:20]
    server.start()  # the memory reopens after the SIGKILL
    try:
        for user, owner in owner_of.items():
            status, reply = call(server, "GET", f"/v1/users/{user}/turns", keys[owner])
            stored = [t["turn_id"] for t in reply["turns"]] if status == 200 else []
            assert status == 200 or not acknowledged[user], (user, status, reply)
            assert len(stored) == len(set(stored)), f"{user}: a turn stored twice"
            assert acknowledged[user] <= set(stored), f"{user}: acknowledged adds missing after the kill"
            assert set(stored) <= sent[user], f"{user}: turns it never sent"
            assert all(t["text"].startswith(f"owner {user} ") for t in reply.get("turns", []))
        assert sum(map(len, acknowledged.values())) > 500
        assert server.stop() == 0
    finally:
        server.kill()
    assert not [u for u in owner_of if user_id_problem(u)]
