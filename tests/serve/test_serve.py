"""`memfit serve` as a real uvicorn process on 127.0.0.1 (tests/support/live_server.py).

One server for the tests that only read it or write their own users (keys, limits, isolation, batching,
metrics, answers, deletion); one more, killed with SIGKILL under 16 concurrent writers, restarted, compared
with a memory built offline from the same turns, then stopped with SIGTERM while writers are in flight.
MiniLM, reranker none, summaries off, the echo reader (tests/seam_echo_backend.py: the answer machinery,
never a reported number).
"""

from __future__ import annotations

import gc
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import seam_echo_backend  # noqa: F401  (reader.backend=echo in this process too: the offline reference)
from support.live_server import CHEAP, DEMO, LiveServer

from memfit_gpu.config import load_config
from memfit_gpu.readers.ledger import Ledger
from memfit_gpu.serve.app import SafeJSONResponse, json_bytes
from memfit_gpu.serve.keys import KeyRing, new_key
from memfit_gpu.serve.server import freeze_loaded_objects
from memfit_gpu.store import RecordLog

pytestmark = pytest.mark.slow  # starts real server processes with real MiniLM weights

USERS = [f"user{i:02d}" for i in range(12)]
WORDS = ["falcon", "harbor", "quartz", "meadow", "lantern", "cobalt", "willow", "ember", "glacier", "saffron",
         "orchid", "basalt"]


def turns_of(user: str, n: int = 4) -> list[dict[str, Any]]:
    """Turns that only `user` has: its own rare word in every turn (a cross-user hit would show it)."""
    word = WORDS[USERS.index(user)]
    return [{"speaker": "Ann" if i % 2 == 0 else "Bob", "text": f"The {word} project, part {i}: we talked about "
             f"the {word} for a while.", "timestamp": f"2024-03-0{1 + i % 3}T10:0{i}:00", "turn_id": f"{user}-{i}"}
            for i in range(n)]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    """A server with 12 users' turns and keys: one per user, 4 keys bound to random pairs, one admin."""
    root = tmp_path_factory.mktemp("serve")
    keys_file = root / "keys.jsonl"
    keys = {user: new_key(keys_file, [user], name=user) for user in USERS}
    rng = random.Random(22)
    shared = [(rng.sample(USERS, 2)) for _ in range(4)]
    pair_keys = [(pair, new_key(keys_file, pair, name="-".join(pair))) for pair in shared]
    admin = new_key(keys_file, ["admin-only"], name="admin", admin=True)
    server = LiveServer(root / "memory", keys_file, [*CHEAP, "serve.batch_window_ms=50"]).start()
    with httpx.Client(base_url=server.url, timeout=120) as client:
        def add(user: str) -> None:
            reply = client.post(f"/v1/users/{user}/turns", json={"turns": turns_of(user)},
                                headers={"Authorization": f"Bearer {keys[user]}"})
            assert reply.status_code == 200, reply.text
        with ThreadPoolExecutor(len(USERS)) as pool:
            list(pool.map(add, USERS))
        yield server, client, keys, pair_keys, admin
    assert server.stop() == 0


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_the_server_leaves_what_it_loaded_out_of_the_cyclic_gc(served) -> None:
    """serve.freeze_gc (default): the libraries, MiniLM and the store are frozen before the first request, so a
    full collection no longer walks them while requests wait (docs/benchmarks/history.md, "Online latency")."""
    server = served[0]
    found = re.search(r"(\d+) objects loaded at start left out of the cyclic garbage collector", server.log.read_text())
    assert found and int(found.group(1)) > 100_000


def test_freeze_gc_false_freezes_nothing() -> None:
    cfg = load_config(DEMO, ["serve.freeze_gc=false"])
    before = gc.get_freeze_count()
    freeze_loaded_objects(cfg)
    assert gc.get_freeze_count() == before


def test_the_keys_file_holds_hashes_only(served) -> None:
    server, _, keys, _, _ = served
    text = server.keys.read_text()
    assert all(key not in text for key in keys.values())
    assert len(KeyRing.load(server.keys).keys) == len(USERS) + 5


def test_a_wrong_or_missing_key_reads_nothing(served) -> None:
    _, client, keys, _, _ = served
    body = {"queries": ["falcon project"]}
    assert client.post("/v1/users/user00/search", json=body).status_code == 401
    refused = client.post("/v1/users/user00/search", json=body, headers=auth("mfk_not-a-key"))
    assert refused.status_code == 401 and "missing or unknown API key" in refused.json()["detail"]
    other = client.post("/v1/users/user00/search", json=body, headers=auth(keys["user01"]))
    assert other.status_code == 403 and other.json()["detail"] == "key 'user01' is not bound to user 'user00'"
    # refused before the body is read: a malformed body gets the same 401/403, a write stores nothing
    assert client.post("/v1/users/user00/search", content=b"{not json", headers=auth("x")).status_code == 401
    write = client.post("/v1/users/user00/turns", json={"turns": turns_of("user01", 1)}, headers=auth(keys["user01"]))
    assert write.status_code == 403
    assert client.post("/v1/compact", headers=auth(keys["user00"])).status_code == 403
    # an admin key runs the store-wide operations, but names only users it is bound to
    named = client.post("/v1/consolidate", json={"user_ids": ["admin-only", "user00"]}, headers=auth(served[4]))
    assert named.status_code == 403 and named.json()["detail"] == "key 'admin' is not bound to user 'user00'"
    listed = client.get("/v1/users/user00/turns", headers=auth(keys["user00"])).json()["turns"]
    assert [t["turn_id"] for t in listed] == [f"user00-{i}" for i in range(4)]


def test_bad_requests_get_a_4xx_with_a_message_and_the_server_keeps_serving(served) -> None:
    _, client, keys, _, _ = served
    key = auth(keys["user02"])
    url = "/v1/users/user02"
    malformed = client.post(f"{url}/search", content=b'{"queries": ["x"', headers={**key, "Content-Type": "application/json"})
    assert malformed.status_code == 422 and "JSON decode error" in malformed.json()["detail"]
    wrong = client.post(f"{url}/turns", json={"turns": [{"speaker": "Ann", "text": 5}]}, headers=key)
    assert wrong.status_code == 422 and wrong.json()["detail"] == "body.turns.0.text: Input should be a valid string"
    extra = client.post(f"{url}/turns", json={"turns": [{"speaker": "Ann", "text": "hi", "mood": 1}]}, headers=key)
    assert extra.status_code == 422 and "body.turns.0.mood" in extra.json()["detail"]
    huge = client.post(f"{url}/turns", content=b"x" * (50 << 20), headers={**key, "Content-Type": "application/json"})
    assert huge.status_code == 413 and "serve.max_body_bytes=1,048,576" in huge.json()["detail"]
    many = client.post(f"{url}/search", json={"queries": ["q"] * 65}, headers=key)
    assert many.status_code == 422 and "at most serve.max_queries_per_request=64" in many.json()["detail"]
    assert client.post(f"{url}/search", json={"queries": ["q"], "k": 101}, headers=key).status_code == 422
    conflict = client.post(f"{url}/turns", json={"turns": [{**turns_of("user02")[0], "text": "other words"}]}, headers=key)
    assert conflict.status_code == 409 and "already stored with other words" in conflict.json()["detail"]
    unknown_key = new_key(served[0].keys.parent / "spare.jsonl", ["nobody"])  # a key of another file: 401
    assert client.post("/v1/users/nobody/search", json={"queries": ["q"]}, headers=auth(unknown_key)).status_code == 401
    # an unknown user the key is bound to: 404 (admin key is bound to "admin-only", which has no turns)
    missing = client.post("/v1/users/admin-only/search", json={"queries": ["q"]}, headers=auth(served[4]))
    assert missing.status_code == 404 and missing.json()["detail"] == "user 'admin-only' has no turns in this memory"
    assert client.get("/healthz").json() == {"status": "ok", "method": "memfit"}
    found = client.post(f"{url}/search", json={"queries": ["quartz project"], "k": 2}, headers=key)
    assert found.status_code == 200 and found.json()["results"][0][0]["turn_id"].startswith("user02-")


def test_randomized_keys_and_users_find_no_other_users_turns(served) -> None:
    _, client, keys, pair_keys, _ = served
    rng = random.Random(7)
    cases = []
    for _ in range(48):
        if rng.random() < 0.3:
            pair, key = rng.choice(pair_keys)
            user = rng.choice(pair)
        else:
            user = rng.choice(USERS)
            key = keys[user]
        queries = [f"the {rng.choice(WORDS)} project" for _ in range(rng.randint(1, 3))]
        cases.append((user, key, queries, rng.randint(1, 8)))

    def ask(case: tuple[str, str, list[str], int]) -> tuple[str, Any]:
        user, key, queries, k = case
        reply = client.post(f"/v1/users/{user}/search", json={"queries": queries, "k": k}, headers=auth(key))
        assert reply.status_code == 200, reply.text
        return user, reply.json()["results"]

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, cases))
    crossing = [(user, hit["turn_id"]) for user, results in answers for hits in results for hit in hits
                if not hit["turn_id"].startswith(user + "-") or WORDS[USERS.index(user)] not in hit["text"]]
    assert crossing == [] and sum(len(h) for _, r in answers for h in r) > 48
    # and every key is refused for every user it is not bound to
    for user in USERS:
        for other, key in keys.items():
            if other != user and rng.random() < 0.2:
                assert client.post(f"/v1/users/{user}/search", json={"queries": ["x"]},
                                   headers=auth(key)).status_code == 403


def metric(client: httpx.Client, admin: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in client.get("/metrics", headers=auth(admin)).text.splitlines():
        if line.startswith(f"{name}{{{wanted}}}") or (not labels and line.startswith(name + " ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_concurrent_searches_and_adds_are_batched_and_metered(served) -> None:
    _, client, keys, _, admin = served
    # /metrics counts every user's activity: an admin key's only
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers=auth(keys["user00"])).status_code == 403
    searches_before = metric(client, admin, "memfit_batch_size_count", op="search")
    adds_before = metric(client, admin, "memfit_batch_size_count", op="add")
    barrier = threading.Barrier(16)

    def search(i: int) -> int:
        user = USERS[i % len(USERS)]
        barrier.wait()
        return client.post(f"/v1/users/{user}/search", json={"queries": ["project"], "k": 3},
                           headers=auth(keys[user])).status_code

    with ThreadPoolExecutor(16) as pool:
        assert set(pool.map(search, range(16))) == {200}
    searches = metric(client, admin, "memfit_batch_size_count", op="search") - searches_before
    assert 1 <= searches < 16  # 16 concurrent searches, fewer batched retrievals
    barrier = threading.Barrier(16)

    def add(i: int) -> int:
        user = USERS[i % len(USERS)]
        barrier.wait()
        return client.post(f"/v1/users/{user}/turns", json={"turns": [{"speaker": "Ann", "text": f"batch turn {i}",
                                                                       "turn_id": f"{user}-batch{i}"}]},
                           headers=auth(keys[user])).status_code

    with ThreadPoolExecutor(16) as pool:
        assert set(pool.map(add, range(16))) == {200}
    adds = metric(client, admin, "memfit_batch_size_count", op="add") - adds_before
    assert 1 <= adds < 16  # each batch is one log append and one encoder pass (Memory.add_batch)
    assert metric(client, admin, "memfit_turns_added_total") >= 16 + 4 * len(USERS)
    text = client.get("/metrics", headers=auth(admin)).text
    assert 'memfit_request_seconds_bucket{le="0.05",method="POST",route="/v1/users/{user_id}/search",status="200"}' in text
    # a client's own method names make no series of their own (the label set stays bounded): the HTTP parser
    # refuses them, and a method that reached the app would be counted as "other"
    statuses = {client.request(f"FETCH{n}", "/v1/users/user01/search", headers=auth(keys["user01"])).status_code
                for n in range(20)}
    assert statuses <= {400, 405} and "FETCH" not in client.get("/metrics", headers=auth(admin)).text


def test_one_keys_queued_searches_hold_another_keys_search_for_one_batch_at_most(served) -> None:
    """Key A queues 16 searches of 64 queries (1,024 in all); key B's one search, sent once A's are waiting,
    goes in the next batch (serve.max_batch_texts: 256 queries a batch, taken round-robin between keys), so
    it is answered before most of A's. In arrival order, with a batch of up to 64 requests, it waited for
    all of A's."""
    _, client, keys, _, _ = served
    finished: dict[str, float] = {}
    queries = [f"what about the falcon, part {i}?" for i in range(64)]

    def search(name: str, user: str, count: int) -> None:
        reply = client.post(f"/v1/users/{user}/search", json={"queries": queries[:count], "k": 3},
                            headers=auth(keys[user]))
        assert reply.status_code == 200, reply.text
        finished[name] = time.perf_counter()

    with ThreadPoolExecutor(17) as pool:
        many = [pool.submit(search, f"A{i}", "user00", 64) for i in range(16)]
        time.sleep(0.5)  # A's requests are queued (the first batch runs)
        one = pool.submit(search, "B", "user01", 1)
        for future in [*many, one]:
            future.result()
    before_b = sum(1 for name, at in finished.items() if name != "B" and at < finished["B"])
    # a batch holds 4 of A's searches; B's goes in the batch after the one running when it came (at most 3
    # of A's beside it), or one later if A's requests were still arriving then: at most 11 of A's before it
    assert before_b <= 11, f"{before_b} of A's 16 searches were answered before B's one"


def test_one_keys_reads_of_a_large_user_hold_another_keys_search_for_one_read_at_most(served) -> None:
    """A user's turns and its export are replies as large as the user: they ran unbatched, in arrival order, on
    the one worker, their JSON written on the event loop, so 60 exports by one key of a 40 MB user held another
    key's search for 11 s. Now a key's such reads are served one at a time (the next waits its turn), the
    worker runs them one at a time between search batches, and their JSON is written off the event loop.

    Key A keeps 24 of them in flight at a 20 MB user. Key B's one search waits for its batch window (50 ms) and
    at most the one read of A's on the worker: A's reads go on meanwhile, one at a time, a few of them answered
    before B's search is (2 to 5 on two busy cores); in arrival order B's search waited for all 24 that A had in
    flight."""
    server, client, keys, _, _ = served
    heavy = new_key(server.keys, ["heavy"], name="heavy")  # the server reads its keys file again
    words = "the heavy ledger of the lighthouse keeper " * 21_000  # 882,000 characters
    for i in range(24):
        added = client.post("/v1/users/heavy/turns", headers=auth(heavy), json={"turns": [
            {"speaker": "Ann", "text": f"{words}{i}", "turn_id": f"heavy-{i}"}]})
        assert added.status_code == 200, added.text
    search = {"json": {"queries": ["willow project"], "k": 1}, "headers": auth(keys["user01"])}
    assert client.post("/v1/users/user01/search", **search).status_code == 200  # the read caches, made again
    replies: list[tuple[int, float, int]] = []  # A's: status, when answered, bytes
    stop = threading.Event()

    def flood(n: int) -> None:
        path = f"/v1/users/heavy/{'export' if n % 2 else 'turns'}"
        with httpx.Client(base_url=server.url, timeout=120) as own:
            while not stop.is_set():
                reply = own.get(path, headers=auth(heavy))
                replies.append((reply.status_code, time.perf_counter(), len(reply.content)))

    with ThreadPoolExecutor(24) as pool:
        floods = [pool.submit(flood, n) for n in range(24)]
        time.sleep(3.0)  # A's flood is under way
        sent = time.perf_counter()
        found = client.post("/v1/users/user01/search", **search)
        answered = time.perf_counter()
        stop.set()
        for future in floods:
            future.result()
    assert found.status_code == 200 and found.json()["results"][0][0]["turn_id"].startswith("user01-"), found.text
    meanwhile = sum(1 for _, at, _ in replies if sent < at < answered)
    assert meanwhile <= 8, f"{meanwhile} of A's reads were answered while B's one search waited"
    assert {status for status, _, _ in replies} == {200} and min(size for _, _, size in replies) > 21_000_000
    listed = client.get("/v1/users/heavy/turns", headers=auth(heavy)).json()  # whole, once the flood is over
    assert [(t["turn_id"], t["text"]) for t in listed["turns"]] == [(f"heavy-{i}", f"{words}{i}") for i in range(24)]
    exported = client.get("/v1/users/heavy/export", headers=auth(heavy)).json()
    assert [t["text"] for s in exported["sessions"] for t in s["turns"]] == [f"{words}{i}" for i in range(24)]


@pytest.mark.parametrize("content", [
    {"user_id": "u1", "turns": [{"turn_id": f"t{i}", "text": "é\ud800" * (i * 9_000), "timestamp": None}
                                for i in range(40)]},
    {"sessions": [{"turns": [{"images": [{"caption": "c"}], "text": "x" * 70_000}] * 3, "date": "d"}, {"turns": []}],
     "speakers": ["Ann"], "n": 1.5, "summaries": [], "extra": {}},
    [[], [{}], [[1], 2, {"a": [3]}, 4], "s"], "text", None,
])
def test_a_large_reply_is_written_in_pieces_as_the_whole_would_be(content: Any) -> None:
    """The turns and export replies are written element by element off the event loop (app.json_bytes): the
    bytes are those one json.dumps of the whole writes (ASCII-escaped, compact)."""
    assert json_bytes(content) == SafeJSONResponse(None).render(content)


def test_answers_are_one_reader_call_per_question(served) -> None:
    server, client, keys, _, _ = served
    before = Ledger.load(server.store / "ledger.json").roles["answer"].calls if (server.store / "ledger.json").exists() else 0
    reply = client.post("/v1/users/user03/answer", json={"questions": ["What about the lantern?", "And then?"], "k": 2},
                        headers=auth(keys["user03"]))
    assert reply.status_code == 200
    answers = reply.json()["answers"]
    assert len(answers) == 2 and all(a["answer"] and len(a["hits"]) <= 2 for a in answers)
    assert Ledger.load(server.store / "ledger.json").roles["answer"].calls == before + 2


def test_deleting_a_user_removes_its_turns_from_every_index_and_then_the_disk(served) -> None:
    server, client, keys, _, admin = served
    key = auth(keys["user11"])
    assert client.post("/v1/users/user11/delete", json={"turn_ids": ["user11-0"]}, headers=key).json()["deleted"][
        "episodes"] == 1
    hits = client.post("/v1/users/user11/search", json={"queries": ["basalt"], "k": 10}, headers=key).json()["results"][0]
    assert "user11-0" not in {h["turn_id"] for h in hits}
    assert client.delete("/v1/users/user11", headers=key).status_code == 200
    assert client.post("/v1/users/user11/search", json={"queries": ["basalt"]}, headers=key).status_code == 404
    others = client.post("/v1/users/user10/search", json={"queries": ["orchid"], "k": 2},
                         headers=auth(keys["user10"])).json()["results"]
    assert client.post("/v1/compact", headers=auth(admin)).status_code == 200
    assert not any(b"basalt" in p.read_bytes() for p in (server.store / "store").rglob("*") if p.is_file())
    again = client.post("/v1/users/user10/search", json={"queries": ["orchid"], "k": 2},
                        headers=auth(keys["user10"])).json()["results"]
    assert [[h["turn_id"] for h in r] for r in again] == [[h["turn_id"] for h in r] for r in others]


# ------------------------------------------------------------------------------- kill, restart, drain
WRITERS = 16


def test_sigkill_under_16_writers_loses_no_acknowledged_add_and_sigterm_drains(tmp_path: Path) -> None:
    from memfit_gpu.live import Memory  # the offline reference, in this process

    keys_file = tmp_path / "keys.jsonl"
    users = [f"w{i:02d}" for i in range(WRITERS)]
    key = new_key(keys_file, users)
    server = LiveServer(tmp_path / "memory", keys_file, CHEAP).start()
    sent: dict[str, list[list[dict[str, Any]]]] = {u: [] for u in users}
    acked: dict[str, list[str]] = {u: [] for u in users}
    stop = threading.Event()

    def writer(user: str) -> None:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            n = 0
            while not stop.is_set():
                batch = [{"speaker": "Ann", "text": f"{user} says number {n + j} about topic {(n + j) % 7}",
                          "turn_id": f"{user}-{n + j}"} for j in range(1 + n % 3)]
                n += len(batch)
                sent[user].append(batch)
                try:
                    reply = client.post(f"/v1/users/{user}/turns", json={"turns": batch}, headers=auth(key))
                except httpx.HTTPError:
                    return  # the server is gone
                assert reply.status_code == 200, reply.text
                acked[user].extend(a["turn_id"] for a in reply.json()["added"])

    threads = [threading.Thread(target=writer, args=(u,)) for u in users]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    # 64 acknowledged turns in all, and every writer with some (a fast add, as with live.indexing=deferred,
    # can get 64 acknowledged before the last writer's first one)
    while (sum(map(len, acked.values())) < 64 or not all(acked.values())) and time.monotonic() < deadline:
        time.sleep(0.05)
    server.kill()
    stop.set()
    for thread in threads:
        thread.join()
    assert sum(map(len, acked.values())) >= 64

    server = LiveServer(tmp_path / "memory", keys_file, CHEAP).start()
    with httpx.Client(base_url=server.url, timeout=120) as client:
        held = {u: [t["turn_id"] for t in client.get(f"/v1/users/{u}/turns", headers=auth(key)).json()["turns"]]
                for u in users}
        for user in users:
            batches = [[t["turn_id"] for t in b] for b in sent[user]]
            assert len(held[user]) == len(set(held[user]))  # present once
            assert held[user][:len(acked[user])] == acked[user]  # every acknowledged add, in order
            # nothing half-written: what is held is whole adds, in the order they were sent
            whole = [sum(batches[:i], []) for i in range(len(batches) + 1)]
            assert held[user] in whole
        texts = {u: {t["turn_id"]: t for t in client.get(f"/v1/users/{u}/turns", headers=auth(key)).json()["turns"]}
                 for u in users}
        queries = [(u, f"{u} says number 3 about topic {i}") for i, u in enumerate(users[:6])]
        live = [client.post(f"/v1/users/{u}/search", json={"queries": [q], "k": 5}, headers=auth(key)).json()["results"][0]
                for u, q in queries]

        # the same turns written offline at once
        with Memory.open(tmp_path / "offline", config=DEMO, overrides=CHEAP) as offline:
            offline.add(users, [[{k: v for k, v in texts[u][t].items() if k in ("speaker", "text", "session_id")}
                                 | {"turn_id": t} for t in held[u]] for u in users])
            built = offline.search([u for u, _ in queries], [q for _, q in queries], k=5)
        assert [[h["turn_id"] for h in hits] for hits in live] == [[h.turn_ids[0] for h in hits] for hits in built]
        for a, b in zip(live, built, strict=True):
            assert [h["score"] for h in a] == pytest.approx([h.score for h in b], abs=1e-5)

        # SIGTERM while 16 writers are in flight: every request already accepted is answered, then it exits 0
        done: list[int] = []
        barrier = threading.Barrier(WRITERS + 1)

        def last_add(user: str) -> None:
            barrier.wait()
            try:
                reply = client.post(f"/v1/users/{user}/turns", json={"turns": [
                    {"speaker": "Bob", "text": f"{user} last words", "turn_id": f"{user}-last"}]}, headers=auth(key))
                done.append(reply.status_code)
                if reply.status_code == 200:
                    acked[user].append(f"{user}-last")
            except httpx.HTTPError:
                pass  # arrived after the listener closed: never accepted

        threads = [threading.Thread(target=last_add, args=(u,)) for u in users]
        for thread in threads:
            thread.start()
        barrier.wait()
        time.sleep(0.05)
        assert server.stop() == 0
        for thread in threads:
            thread.join()
    assert set(done) <= {200} and done  # none accepted was dropped
    log = RecordLog(tmp_path / "memory" / "store" / "log.jsonl")
    assert log.records[-1]["t"] == "commit"  # closed cleanly: no batch left without its commit
    snapshots = sorted(p.name for p in (tmp_path / "memory" / "store" / "snapshots").iterdir())
    assert snapshots and int(snapshots[-1]) == len(log)  # the drain snapshotted everything logged
    with Memory.open(tmp_path / "memory", config=DEMO, overrides=CHEAP) as reopened:
        for user in users:
            stored = [t["turn_id"] for t in reopened.turns(user)]
            assert set(acked[user]) <= set(stored) and len(stored) == len(set(stored))
