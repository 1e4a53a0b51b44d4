"""provenance.py's record logic on records of this machine: resume check, drift lines, hashes.

The records are `inputs.collect`'s for the smoke configuration over a copy of a small real LoCoMo file (a
retrieval-only record: the encoder's real packaged weights are hashed, no reader is loaded); the runs that
write them are tested in test_run_pipeline.py, test_retrieve_cli.py and test_run_crash_consistency.py.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from support.data import write_small_locomo

from memfit_gpu import digests, provenance
from memfit_gpu.config import load_config
from memfit_gpu.data import load_benchmark, select_from_config
from memfit_gpu.data.stats import quirk_counts, quirk_kind
from memfit_gpu.evaluate.judge import reader_config_for_judge
from memfit_gpu.run.inputs import collect, model_uses, resolve_inputs, with_weights

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "configs" / "smoke.yaml"


@pytest.fixture(scope="module")
def record(tmp_path_factory: pytest.TempPathFactory, shared_data: Path) -> dict:
    data = write_small_locomo(shared_data, tmp_path_factory.mktemp("data"), questions=4)
    cfg = load_config(SMOKE, [f"data.path={data}"])
    selected = select_from_config(load_benchmark("locomo", data), cfg.data)
    return collect(resolve_inputs(cfg, readers=False), selected, command="test")


def test_a_resume_under_the_same_provenance_keeps_the_first_record(record: dict, tmp_path: Path):
    first = provenance.reconcile(tmp_path, copy.deepcopy(record))
    later = {**copy.deepcopy(record), "written": "2030-01-01T00:00:00Z", "argv": ["elsewhere"]}
    assert provenance.reconcile(tmp_path, later) == first == provenance.read(tmp_path)
    # other devices (a requeued task on another node) are no refusal: the resume is recorded
    moved = copy.deepcopy(later)
    moved["devices"]["gpus"] = [{"index": 0, "name": "NVIDIA H200", "memory_bytes": 150_000_000_000,
                                 "capability": "9.0"}]
    kept = provenance.reconcile(tmp_path, moved)
    assert kept["written"] == first["written"] and kept["resumed_on"][0]["devices"]["gpus"][0]["name"] == "NVIDIA H200"
    # where things lie on this machine is no difference either
    elsewhere = copy.deepcopy(kept)
    elsewhere["models"]["encoder"]["path"] = "/elsewhere/model"
    elsewhere["data"]["root"] = "/elsewhere"
    assert provenance.differences(kept, elsewhere) == []


def test_a_resume_under_other_weights_is_refused_naming_the_field_unless_allowed(record: dict, tmp_path: Path):
    provenance.reconcile(tmp_path, copy.deepcopy(record))
    changed = copy.deepcopy(record)
    changed["models"]["encoder"]["weights"]["sha256"] = "0" * 64
    changed["code"]["source_sha256"] = "f" * 64
    encoder = record["models"]["encoder"]
    with pytest.raises(provenance.ProvenanceError) as refused:
        provenance.reconcile(tmp_path, changed)
    assert str(refused.value) == (
        f"{tmp_path / 'provenance.json'}: this run was started under different provenance: models.encoder.weights."
        f"sha256 was {encoder['weights']['sha256'][:12]}, now 000000000000 ({encoder['name']} at {encoder['path']}) "
        "(and 1 more: code.source_sha256); resume with --allow-provenance-change to continue anyway (recorded in "
        "provenance.json), or use a new --out directory")
    assert provenance.read(tmp_path) == record  # refused: nothing written
    allowed = provenance.reconcile(tmp_path, copy.deepcopy(changed), allow_change=True)
    assert allowed["models"] == changed["models"] and allowed["first_written"] == record["written"]
    assert list(allowed["changes"][0]["fields"]) == ["models.encoder.weights.sha256", "code.source_sha256"]
    assert allowed["changes"][0]["fields"]["code.source_sha256"] == {"before": record["code"]["source_sha256"],
                                                                     "after": "f" * 64}
    assert provenance.read(tmp_path) == allowed


def test_a_resume_from_another_commit_of_the_same_code_is_recorded_not_refused(record: dict, tmp_path: Path):
    """A commit of docs or tests, or an edit outside the code a run executes, changes the checkout's identity
    (code.commit, dirty, diff_sha256), not code.source_sha256: the resume goes on and is listed in
    `resumed_in`; other source code is refused."""
    assert record["code"]["commit"] is not None and len(record["code"]["source_sha256"]) == 64  # a checkout
    first = provenance.reconcile(tmp_path, copy.deepcopy(record))
    later = copy.deepcopy(record)
    later["written"] = "2030-01-01T00:00:00Z"
    later["code"].update(commit="e" * 40, dirty=True, diff_sha256="d" * 64)
    kept = provenance.reconcile(tmp_path, later)
    assert kept["code"] == first["code"] and kept["resumed_in"] == [
        {"at": "2030-01-01T00:00:00Z", "commit": "e" * 40, "dirty": True, "diff_sha256": "d" * 64}]
    assert provenance.read(tmp_path) == kept
    other_source = copy.deepcopy(later)
    other_source["code"]["source_sha256"] = "5" * 64
    with pytest.raises(provenance.ProvenanceError, match=r"code\.source_sha256 was [0-9a-f]{12}, now 555555555555"):
        provenance.reconcile(tmp_path, other_source)


def test_the_source_hash_covers_the_code_a_run_executes_and_nothing_else(tmp_path: Path):
    """code.source_sha256 follows an edit of memfit_gpu/ (or kernels/), not one of tests/ or docs/."""
    checkout = tmp_path / "checkout"
    shutil.copytree(REPO, checkout, ignore=shutil.ignore_patterns(".venv", "runs", "__pycache__", "*.egg-info",
                                                                   "gpu_assets", ".git"), symlinks=True)
    git = ["git", "-C", str(checkout), "-c", "user.email=t@t", "-c", "user.name=t"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "base"]):
        subprocess.run([*git, *args], check=True, capture_output=True)

    def code() -> dict:
        return provenance.code_version(checkout / "memfit_gpu")

    clean = code()
    assert clean["checkout"] == str(checkout) and clean["dirty"] is False and clean["source_sha256"]
    (checkout / "docs" / "concepts" / "design.md").write_text("edited\n")
    docs = code()
    assert docs["dirty"] is True and docs["diff_sha256"] and docs["source_sha256"] == clean["source_sha256"]
    subprocess.run([*git, "commit", "-q", "-am", "docs"], check=True, capture_output=True)
    committed = code()
    assert committed["commit"] != clean["commit"] and committed["source_sha256"] == clean["source_sha256"]
    with open(checkout / "memfit_gpu" / "provenance.py", "a") as handle:
        handle.write("# an edit of the code a run executes\n")
    edited = code()
    assert edited["source_sha256"] not in (None, clean["source_sha256"])


def test_drift_warns_for_data_weights_and_judge_and_notes_the_code(record: dict):
    other = copy.deepcopy(record)
    other["data"]["files"]["locomo_conv26_s1-3.json"]["sha256"] = "a" * 64
    other["judge"] = {"enabled": True, "backend": "openai", "model": "openai/gpt-oss-20b", "kind": "paper",
                      "max_new_tokens": 128, "base_urls": [], "prompts": {"judge.txt": "b" * 64}}
    other["code"]["commit"] = "c" * 40
    lines = provenance.drift({"A": record, "B": other, "C": copy.deepcopy(record)})
    assert [line.split(":")[0] + ":" + line.split(":")[1] for line in lines] == [
        "warning: data", "warning: judge", "note: code version"]
    assert lines[0].startswith("warning: data: A and B differ in data.files.locomo_conv26_s1-3.json.sha256 (A: "
                               f"{record['data']['files']['locomo_conv26_s1-3.json']['sha256'][:12]}; B: aaaaaaaaaaaa)")
    assert "judge.enabled (A: false; B: true)" in lines[1]
    assert provenance.drift({"A": record, "B": copy.deepcopy(record)}) == []
    assert provenance.drift({"A": record, "B": None}) == [
        "note: B has no provenance.json (made before memfit recorded provenance): not compared"]
    # a model the runs are meant to differ in (a sweep key) is marked as such
    swept = copy.deepcopy(record)
    swept["models"]["encoder"]["weights"]["sha256"] = "d" * 64
    assert provenance.drift({"p1": record, "p2": swept}, varied=["index.encoder"])[0].endswith(
        "(expected: the runs vary index.encoder)")


def test_weights_are_hashed_once_per_process_and_hub_blobs_by_their_name(tmp_path: Path):
    folder = tmp_path / "model"
    folder.mkdir()
    weights = folder / "model.safetensors"
    weights.write_bytes(b"\0" * 1000)
    before = digests._file_digest.cache_info()
    first = provenance.weights_entry(folder)
    assert first["files"] == {"model.safetensors": digests.bytes_sha256(b"\0" * 1000)} and first["hashed"] == "read"
    assert provenance.weights_entry(folder) == first
    after = digests._file_digest.cache_info()
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 1)  # read once, then the memo
    weights.write_bytes(b"\1" * 1000)  # rewritten: another size or mtime, hashed again
    os.utime(weights, ns=(1, 1))
    assert provenance.weights_entry(folder)["files"]["model.safetensors"] == digests.bytes_sha256(b"\1" * 1000)
    # a Hugging Face cache snapshot links its LFS files to blobs named by their sha256: not read again
    blob = tmp_path / "blobs" / ("e" * 64)
    blob.parent.mkdir()
    blob.write_bytes(b"weights")
    snapshot = tmp_path / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").symlink_to(blob)
    assert provenance.weights_entry(snapshot)["files"] == {"model.safetensors": "e" * 64}


def test_a_large_files_digest_is_kept_in_the_cache_for_the_next_process(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch):
    """Weights are read by every `memfit` process: from PERSIST_MIN_BYTES on, a digest is kept under
    $MEMFIT_CACHE/digests by path, size, mtime, ctime and inode; a file written again is read again."""
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(digests, "PERSIST_MIN_BYTES", 1000)
    small, large = tmp_path / "small.bin", tmp_path / "model.safetensors"
    small.write_bytes(b"\0" * 999)
    large.write_bytes(b"\0" * 1000)
    digests._file_digest.cache_clear()  # as a new process starts
    assert digests.file_sha256(small) == digests.bytes_sha256(b"\0" * 999)
    assert not (tmp_path / "cache" / "digests").exists()  # small files are only memoised in the process
    assert digests.file_sha256(large) == digests.bytes_sha256(b"\0" * 1000)
    [kept] = (tmp_path / "cache" / "digests").iterdir()
    assert kept.read_text() == digests.bytes_sha256(b"\0" * 1000) + "\n"
    kept.write_text("a" * 64)  # what the next process reads instead of the file
    digests._file_digest.cache_clear()
    assert digests.file_sha256(large) == "a" * 64
    stat = large.stat()
    large.write_bytes(b"\1" * 1000)  # the same size and mtime, but written again: a new ctime
    os.utime(large, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    digests._file_digest.cache_clear()
    assert digests.file_sha256(large) == digests.bytes_sha256(b"\1" * 1000)
    [rewritten] = set((tmp_path / "cache" / "digests").iterdir()) - {kept}
    rewritten.write_text("not a digest")  # a damaged entry is read past, and written again
    digests._file_digest.cache_clear()
    assert digests.file_sha256(large) == digests.bytes_sha256(b"\1" * 1000)
    assert rewritten.read_text() == digests.bytes_sha256(b"\1" * 1000) + "\n"


def test_quirks_are_counted_by_kind():
    problems = ["locomo conv-26:q5: evidence 'D8:6; D9:17' read as ['D8:6', 'D9:17']",
                "locomo conv-30:q7: evidence 'D1:3 D1:4 D2:1' read as ['D1:3', 'D1:4', 'D2:1']",
                "locomo conv-26:q9: evidence D30:5 names no turn of conv-26: kept",
                "locomo conv-41:q1: no evidence given (category 2)"]
    assert quirk_kind(problems[2]) == "evidence N names no turn of N: kept"
    assert quirk_counts(problems) == {"evidence '...' read as [...]": 2, "evidence N names no turn of N: kept": 1,
                                      "no evidence given (...)": 1}


def test_the_models_a_configuration_loads():
    cfg = load_config(SMOKE, ["rerank.backend=cross-encoder", "eval.judge.enabled=true", "eval.judge.backend=openai",
                              "eval.judge.base_urls=[http://127.0.0.1:8200/v1]", "eval.judge.model=openai/gpt-oss-20b"])
    judge = reader_config_for_judge(cfg.eval.judge, cfg.reader)
    assert [(u.role, u.name, u.weights) for u in model_uses(cfg, judge=judge)] == [
        ("encoder", cfg.index.encoder, True), ("cross_encoder", cfg.rerank.model, True),
        ("reader", cfg.reader.model, True), ("judge", "openai/gpt-oss-20b", False)]
    assert [u.role for u in model_uses(cfg, readers=False)] == ["encoder", "cross_encoder"]
    assert json.dumps(provenance.package_versions())  # every value a version string or null


def test_the_record_names_the_encoders_dtype_that_auto_chose(record: dict, minilm_path: Path, monkeypatch,
                                                              tmp_path: Path):
    """index.dtype / rerank.dtype as devices.resolve_dtype resolves them on index.device: "auto" is float32 on a
    CPU with AMX (simulated) and without; an explicit bf16 is named; a record written before the field existed
    counts as float32."""
    from memfit_gpu.run.inputs import model_record

    cfg = load_config(SMOKE, ["index.device=cpu", "rerank.backend=cross-encoder", f"rerank.model={minilm_path}"])
    for amx, want in ((True, "float32"), (False, "float32")):
        monkeypatch.setattr("torch.cpu._is_amx_tile_supported", lambda v=amx: v)
        records = {u.role: model_record(u) for u in with_weights(model_uses(cfg, readers=False))}
        assert (records["encoder"]["dtype"], records["cross_encoder"]["dtype"]) == (want, want)
    explicit = load_config(SMOKE, ["index.device=cpu", "index.dtype=float32", "rerank.dtype=bf16",
                                   "rerank.backend=cross-encoder", f"rerank.model={minilm_path}"])
    records = {u.role: model_record(u) for u in with_weights(model_uses(explicit, readers=False))}
    assert (records["encoder"]["dtype"], records["cross_encoder"]["dtype"]) == ("float32", "bfloat16")
    # this machine's record (auto: float32) resumes a record without the field; a bf16 one does not
    assert record["models"]["encoder"]["dtype"] == "float32"
    older = copy.deepcopy(record)
    del older["models"]["encoder"]["dtype"]
    assert provenance.differences(older, record) == []
    bf16 = copy.deepcopy(record)
    bf16["models"]["encoder"]["dtype"] = "bfloat16"
    assert [d.field for d in provenance.differences(older, bf16)] == ["models.encoder.dtype"]


def test_the_record_names_the_in_process_readers_dtype_and_a_resume_on_another_one_is_refused(
        record: dict, monkeypatch) -> None:
    """reader.dtype "auto" is bf16 on a CPU with native bf16 (AVX512-BF16, AMX) or a bf16 GPU, float32 (fp16) on
    one without: a run requeued onto another kind of node resumed without a word, its answers from then on made
    in another dtype. The transformers reader's dtype is recorded (and compared on resume); a record written
    before it was recorded does not name it and is not compared on it; a server's reader has none."""
    from memfit_gpu.run.inputs import model_record

    cfg = load_config(SMOKE)
    server_judge = dataclasses.replace(cfg.reader, backend="openai", model="judge", base_urls=["http://x"])
    for native, want in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr("memfit_gpu.devices.cpu_native_bf16", lambda v=native: v)
        monkeypatch.setattr("torch.cuda.is_available", lambda: False)
        records = {u.role: model_record(u) for u in with_weights(model_uses(cfg, judge=server_judge))}
        assert records["reader"]["reader_dtype"] == want and "reader_dtype" not in records["judge"]
    assert model_record(with_weights(model_uses(load_config(SMOKE, ["reader.dtype=float32"])))[1])[
        "reader_dtype"] == "float32"
    here = copy.deepcopy(record)
    here["models"]["reader"] = records["reader"]  # float32: the last one made
    older = copy.deepcopy(here)
    del older["models"]["reader"]["reader_dtype"]
    assert provenance.differences(older, here) == [] and provenance.differences(here, older) == []
    assert provenance.drift({"A": here, "B": older}) == provenance.drift({"A": older, "B": here}) == []
    other = copy.deepcopy(here)
    other["models"]["reader"]["reader_dtype"] = "bfloat16"
    assert [(d.field, d.before, d.after) for d in provenance.differences(here, other)] == [
        ("models.reader.reader_dtype", "float32", "bfloat16")]
