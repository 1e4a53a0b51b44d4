"""RecordLog alone (no model): framing, torn tails (dropped), corruption (an error, file untouched), append-only bytes."""

from __future__ import annotations

import logging
import zlib

import pytest

import memfit_gpu.store.log as log_module
from memfit_gpu.data.schema import DataError
from memfit_gpu.store.log import RecordLog, StoreCorruptError, encode_record


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
            assert "torn last record" in caplog.text and f"dropping its {cut - good} bytes" in caplog.text
        reopened.append([{"i": "next"}])  # later appends start on a clean boundary
        reopened.close()
        assert [r["i"] for r in RecordLog(path).records] == [*range(whole), "next"]


def _four_records(path) -> tuple[bytes, list[int]]:
    log = RecordLog(path)
    log.append([{"i": i, "text": "x" * i} for i in range(4)])
    log.close()
    return path.read_bytes(), log.ends


def _record_at(ends: list[int], offset: int) -> int:
    """1-based number of the record holding byte `offset`."""
    return next(number for number, end in enumerate(ends, 1) if offset < end)


def test_a_flipped_byte_anywhere_is_an_error_naming_the_record_and_the_file_is_untouched(tmp_path):
    path = tmp_path / "log.jsonl"
    full, ends = _four_records(path)
    for offset in range(len(full)):
        damaged = bytearray(full)
        damaged[offset] ^= 0x01
        path.write_bytes(bytes(damaged))
        with pytest.raises(StoreCorruptError) as info:
            RecordLog(path)
        number = _record_at(ends, offset)
        start = ends[number - 2] if number > 1 else 0
        assert f"item record {number} (line {number}, byte {start})" in str(info.value), offset
        assert str(path) in str(info.value) and "not a record torn by a killed writer" in str(info.value)
        assert "\n" not in str(info.value)
        assert path.read_bytes() == bytes(damaged)  # the evidence is never rewritten


def test_corruption_is_a_data_error_with_the_reason(tmp_path):
    path = tmp_path / "log.jsonl"
    full, ends = _four_records(path)
    damaged = bytearray(full)
    damaged[ends[0] + 20] ^= 0x01  # a byte inside record 2's JSON
    path.write_bytes(bytes(damaged))
    with pytest.raises(DataError, match=rf"item record 2 \(line 2, byte {ends[0]}\): checksum mismatch, "
                                        rf"{len(full) - ends[0]} bytes before the end of the file"):
        RecordLog(path)


def test_five_bytes_cut_out_anywhere_but_the_end_is_an_error(tmp_path, caplog):
    path = tmp_path / "log.jsonl"
    full, ends = _four_records(path)
    for offset in range(len(full) - 4):
        cut = full[:offset] + full[offset + 5 :]
        path.write_bytes(cut)
        if offset + 5 == len(full):  # the last five bytes: a torn tail, dropped
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="memfit_gpu.store.log"):
                assert [r["i"] for r in RecordLog(path).records] == [0, 1, 2]
            assert "torn last record" in caplog.text and path.read_bytes() == full[: ends[2]]
            continue
        with pytest.raises(StoreCorruptError, match=rf"item record {_record_at(ends, offset)} "):
            RecordLog(path)
        assert path.read_bytes() == cut


def test_garbage_with_a_newline_after_the_last_record_is_an_error(tmp_path):
    path = tmp_path / "log.jsonl"
    full, _ = _four_records(path)
    path.write_bytes(full + b"garbage\nmore garbage")
    with pytest.raises(StoreCorruptError, match=rf"item record 5 \(line 5, byte {len(full)}\): malformed header"):
        RecordLog(path)
    assert path.read_bytes() == full + b"garbage\nmore garbage"


def test_a_tail_without_a_newline_is_torn_whatever_its_bytes(tmp_path, caplog):
    """Part of a record, or bytes that never reached the disk (zeros): nothing valid follows, so it goes."""
    path = tmp_path / "log.jsonl"
    full, ends = _four_records(path)
    for tail in (b"\0" * 300, b"0000001f 12345678 {\"i\":", b"garbage"):
        path.write_bytes(full + tail)
        with caplog.at_level(logging.WARNING, logger="memfit_gpu.store.log"):
            reopened = RecordLog(path)
        assert len(reopened.records) == 4 and reopened.dropped_bytes == len(tail)
        assert path.read_bytes() == full


def test_drop_records_cuts_back_to_whole_records_and_appends_follow(tmp_path):
    path = tmp_path / "log.jsonl"
    full, ends = _four_records(path)
    log = RecordLog(path)
    log.drop_records(2)
    assert [r["i"] for r in log.records] == [0, 1] and path.read_bytes() == full[: ends[1]]
    log.append([{"i": "next"}])
    log.close()
    assert [r["i"] for r in RecordLog(path).records] == [0, 1, "next"]


def test_records_are_streamed_from_the_file_not_held(tmp_path, monkeypatch):
    """The log keeps offsets and CRCs only; iter_records reads any range back, across read blocks."""
    monkeypatch.setattr(log_module, "_READ_BYTES", 64)  # records straddle the blocks the reader reads
    path = tmp_path / "log.jsonl"
    log = RecordLog(path)
    log.append([{"i": i, "text": "x" * (i % 50)} for i in range(300)])
    assert not hasattr(log, "_records") and "records" not in vars(log)
    assert [r["i"] for r in log.iter_records(295)] == [295, 296, 297, 298, 299]
    assert [r["i"] for r in log.iter_records(10, 13)] == [10, 11, 12]
    assert list(log.iter_records(300)) == []
    log.close()
    again = RecordLog(path)
    assert len(again) == 300 and [r["i"] for r in again.records] == list(range(300))
    assert again.fingerprint(300) == log.fingerprint(300) and again.ends[-1] == path.stat().st_size


def test_a_read_only_log_reads_every_whole_record_and_changes_no_byte(tmp_path, caplog):
    """`memfit store repair --dry-run` read the log as a writer opens it, which cuts a torn tail off: the
    report that promised to change nothing changed the log. Read-only, every cut of the file reads the same
    records as a writer's open would, and the file keeps every byte; writes are refused."""
    path = tmp_path / "log.jsonl"
    full, ends = _four_records(path)
    for cut in range(len(full) + 1):
        path.write_bytes(full[:cut])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="memfit_gpu.store.log"):
            reader = RecordLog(path, read_only=True)
        whole = sum(1 for end in ends if end <= cut)
        good = ends[whole - 1] if whole else 0
        assert [r["i"] for r in reader.records] == list(range(whole))
        assert len(reader) == whole and reader.dropped_bytes == cut - good
        assert path.read_bytes() == full[:cut]
        if cut != good:
            assert f"its {cut - good} bytes are left in place (read only" in caplog.text
        with pytest.raises(RuntimeError, match="opened read-only"):
            reader.append([{"i": "next"}])
        with pytest.raises(RuntimeError, match="opened read-only"):
            reader.drop_records(0)
        reader.close()
        assert path.read_bytes() == full[:cut]
        assert RecordLog(path).dropped_bytes == cut - good  # what a writer's open then cuts off
    with pytest.raises(FileNotFoundError, match="no record log there"):
        RecordLog(tmp_path / "missing" / "log.jsonl", read_only=True)
    assert not (tmp_path / "missing").exists()
