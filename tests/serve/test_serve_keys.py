"""serve/keys.py: the keys file is read strictly (a bad line names the file, the line and the field) and
`memfit keys new` adds its line without rewriting the others."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from support.live_server import CHEAP, LiveServer

from memfit_gpu.cli import main
from memfit_gpu.data.schema import DataError
from memfit_gpu.serve.keys import KeyRing, new_key

SHA = "a" * 64


def _line(**fields: object) -> str:
    return json.dumps({"name": "ro", "sha256": SHA, "users": ["alice"], **fields})


@pytest.mark.parametrize(("fields", "field", "reason"), [
    ({"admin": "false"}, "admin", "must be true or false (a JSON boolean)"),  # a truthy string: read as admin
    ({"admin": 1}, "admin", "must be true or false (a JSON boolean)"),
    ({"name": 7}, "name", "must be a string"),
])
def test_a_key_whose_admin_or_name_has_the_wrong_type_is_refused(tmp_path: Path, capsys, fields: dict[str, object],
                                                                 field: str, reason: str) -> None:
    keys = tmp_path / "keys.jsonl"
    keys.write_text(_line().replace(SHA, "b" * 64) + "\n" + _line(**fields) + "\n")
    before = keys.read_bytes()
    with pytest.raises(DataError) as refused:
        KeyRing.load(keys)
    assert (refused.value.item, refused.value.field) == ("line 2", field) and reason in str(refused.value)
    assert main(["keys", "new", "--keys", str(keys), "--user", "bob"]) == 2
    assert "line 2" in capsys.readouterr().err and keys.read_bytes() == before  # refused, not rewritten


def test_keys_new_keeps_the_other_lines_as_they_were(tmp_path: Path) -> None:
    keys = tmp_path / "keys.jsonl"
    first = _line(admin=False, comment="read-only key of the dashboard")
    keys.write_text(first + "\n")
    new_key(keys, ["bob"], name="bob")
    lines = keys.read_text().splitlines()
    assert lines[0] == first and json.loads(lines[1])["users"] == ["bob"]
    assert [(k.name, k.admin) for k in KeyRing.load(keys).keys] == [("ro", False), ("bob", False)]


def test_a_keys_file_that_is_not_utf8_or_is_a_folder_is_one_line(tmp_path: Path, capsys) -> None:
    keys = tmp_path / "keys.jsonl"
    keys.write_bytes(b"\xff\n")
    with pytest.raises(DataError, match=r"not UTF-8 text \(byte 0\)"):
        KeyRing.load(keys)
    assert main(["keys", "new", "--keys", str(keys), "--user", "bob"]) == 2
    assert capsys.readouterr().err.strip().endswith("not UTF-8 text (byte 0): a keys file is JSON Lines")
    assert main(["keys", "new", "--keys", str(tmp_path), "--user", "bob"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"memfit keys: error: {tmp_path}: writing failed: Is a directory (EISDIR); it is a folder: give "
                   "the path of a file"]


def test_each_name_names_one_key(tmp_path: Path) -> None:
    """The server counts a key's requests in flight by the key itself, and errors name keys: a second key of
    the same name is refused, and `keys new` numbers past a key removed by hand instead of repeating a name."""
    keys = tmp_path / "keys.jsonl"
    for user in ("alice", "bob", "carol"):
        new_key(keys, [user])
    lines = keys.read_text().splitlines()
    keys.write_text("\n".join([lines[0], lines[2]]) + "\n")  # key2 revoked by hand: key1, key3 are left
    new_key(keys, ["dave"])
    assert [k.name for k in KeyRing.load(keys).keys] == ["key1", "key3", "key4"]
    with pytest.raises(DataError, match="'key1' is the name of another key in it"):
        new_key(keys, ["erin"], name="key1")
    keys.write_text(keys.read_text() + _line(name="key3") + "\n")
    with pytest.raises(DataError) as refused:
        KeyRing.load(keys)
    assert (refused.value.item, refused.value.field) == ("line 4", "name")


def test_revoking_a_key_moves_no_other_key_s_name(tmp_path: Path) -> None:
    """A hand-written key without a name is named by its line (`key<line>`). `memfit keys revoke` removed the
    revoked key's line, so the names of the keys after it moved: revoking key1, then key3, removed the fourth
    key, and the third (the one meant) kept working. The revoked key's line is now left empty."""
    keys = tmp_path / "keys.jsonl"
    shas = [f"{i:064x}" for i in range(1, 5)]
    keys.write_text("".join(json.dumps({"sha256": sha, "users": ["alice"]}) + "\n" for sha in shas))
    assert [k.name for k in KeyRing.load(keys).keys] == ["key1", "key2", "key3", "key4"]
    assert main(["keys", "revoke", "--keys", str(keys), "--name", "key1"]) == 0
    assert [k.name for k in KeyRing.load(keys).keys] == ["key2", "key3", "key4"]
    assert main(["keys", "revoke", "--keys", str(keys), "--name", "key3"]) == 0
    assert [(k.name, k.sha256) for k in KeyRing.load(keys).keys] == [("key2", shas[1]), ("key4", shas[3])]
    new_key(keys, ["bob"])  # a new key is named by its line: never a revoked key's name
    assert [k.name for k in KeyRing.load(keys).keys] == ["key2", "key4", "key5"]


def test_a_server_reads_its_keys_file_again_when_it_changes(tmp_path: Path, capsys) -> None:
    """The keys file was read once, at start: a revoked key (a leaked one) kept working, and a new one did not,
    until a restart. A running server reads the file again when it changes; a file that no longer reads refuses
    every key (the edit may have been a revocation) until it reads again."""
    keys = tmp_path / "keys.jsonl"
    first = new_key(keys, ["u1"], name="first")
    server = LiveServer(tmp_path / "memory", keys, CHEAP).start()
    try:
        def status(key: str) -> int:
            return httpx.get(f"{server.url}/v1/users/u1/turns", headers={"Authorization": f"Bearer {key}"},
                             timeout=30).status_code

        assert status(first) == 404  # known, bound to u1, who has no turns yet
        second = new_key(keys, ["u1"], name="second")
        assert status(second) == 404  # made while the server runs: served at once
        assert main(["keys", "revoke", "--keys", str(keys), "--name", "first"]) == 0
        assert "key 'first' (users u1) removed" in capsys.readouterr().out
        assert (status(first), status(second)) == (401, 404)
        text = keys.read_text()
        keys.write_text(text + "{not json\n")  # a hand edit gone wrong
        assert status(second) == 401
        keys.write_text(text)
        assert status(second) == 404
        assert main(["keys", "revoke", "--keys", str(keys), "--name", "first"]) == 2
        assert "no key named 'first' (the keys: second)" in capsys.readouterr().err
        assert server.stop() == 0
    finally:
        server.kill()


def test_an_empty_key_name_is_refused_not_stored_as_another_key_s(tmp_path: Path, capsys) -> None:
    """`memfit keys new --name ""` stored an empty name, which reads as `key<line>`: the name of a key already
    there. The file then no longer read, so a running server refused every user's key, and neither `keys new`
    nor `keys revoke` could mend it."""
    keys = tmp_path / "keys.jsonl"
    new_key(keys, ["alice"], name="key2")
    before = keys.read_bytes()
    for empty in ("", "  "):
        assert main(["keys", "new", "--keys", str(keys), "--user", "bob", "--name", empty]) == 2
        assert "field 'name': a key's name is a non-empty label" in capsys.readouterr().err
        assert keys.read_bytes() == before
    assert [k.name for k in KeyRing.load(keys).keys] == ["key2"]
