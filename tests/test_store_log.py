"""RecordLog alone (no model): framing, torn tails, garbage, corruption, append-only bytes."""

from __future__ import annotations

import logging
import zlib

from memfit_gpu.store.log import RecordLog, encode_record


def test_record_framing_is_length_crc_json_line():
    blob = encode_record({"t": "x", "v": "é"})
    payload = '{"t":"x","v":"é"}'.encode()
    assert blob == b"%08x %08x " % (len(payload), zlib.crc32(payload)) + payload + b"\n"
    assert blob.startswith(b"00000012 ")  # 18 bytes: the é is two


def test_append_reopen_and_prefix_property(tmp_path):
    path = tmp_path / "log.jsonl"
    log = RecordLog(path)
    assert log.append([{"i": 0}, {"i": 1}]) == 2
    before = path.read_bytes()
    log.append([{"i": 2}])
    after = path.read_bytes()
    assert after.startswith(before) and len(after) > len(before)
    assert log.fingerprint(2)["bytes"] == len(before)
    log.close()
    again = RecordLog(path)
    assert again.records == [{"i": 0}, {"i": 1}, {"i": 2}]
    assert again.ends[-1] == len(after) and again.dropped_bytes == 0
    assert again.fingerprint(3) == log.fingerprint(3)


def test_every_truncation_point_keeps_exactly_the_whole_records(tmp_path, caplog):
    path = tmp_path / "log.jsonl"
    log = RecordLog(path)
    log.append([{"i": i, "text": "x" * i} for i in range(4)])
    log.close()
    full = path.read_bytes()
    ends = log.ends
    for cut in range(len(full) + 1):
        path.write_bytes(full[:cut])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="memfit_gpu.store.log"):
            reopened = RecordLog(path)
        whole = sum(1 for end in ends if end <= cut)
        assert [r["i"] for r in reopened.records] == list(range(whole))
        good = ends[whole - 1] if whole else 0
        assert path.read_bytes() == full[:good]
        if cut == good:
            assert caplog.text == ""
        else:
            assert f"dropping the last {cut - good} bytes (1 partial or corrupt record line)" in caplog.text
        reopened.append([{"i": "next"}])  # later appends start on a clean boundary
        reopened.close()
        assert [r["i"] for r in RecordLog(path).records] == [*range(whole), "next"]


def test_corrupt_record_drops_it_and_everything_after(tmp_path, caplog):
    path = tmp_path / "log.jsonl"
    log = RecordLog(path)
    log.append([{"i": 0}, {"i": 1}, {"i": 2}])
    log.close()
    data = bytearray(path.read_bytes())
    flip = log.ends[0] + 20  # a byte inside record 1's JSON
    data[flip] ^= 0x01
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="memfit_gpu.store.log"):
        reopened = RecordLog(path)
    assert f"checksum mismatch at byte {log.ends[0]} after 1 good records" in caplog.text
    assert "(2 partial or corrupt record lines)" in caplog.text
    assert reopened.records == [{"i": 0}] and path.read_bytes() == bytes(data[: log.ends[0]])
