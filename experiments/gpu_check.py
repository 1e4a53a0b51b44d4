"""The GPU check: one command, at most ~8 minutes on a bare single-GPU machine, that says whether memfit_gpu
on that GPU gives what it gives on the CPU, and how fast and how big it runs there.

    here:   .venv/bin/python experiments/prepare_gpu_check.py --out gpu_assets
            .venv/bin/python experiments/gpu_check.py --device cpu --quick --assets gpu_assets --out /tmp/gc
    there:  python experiments/gpu_check.py --device cuda --assets gpu_assets --out $OUT --budget-s 420

The machine needs Python, a CUDA torch, triton, transformers, sentence-transformers, numpy and pyyaml;
nothing is installed. The package is imported from this source tree; the pure-Python packages it lacks
come from the assets (`gpu_assets/site`), and FAISS is replaced on both sides, always, by the exact numpy
search of experiments/_flat_ip.py, so every CPU/GPU difference the check reports comes from torch or Triton.

Stages, most valuable first (experiments/_gpu_check_stages.py): 1 kernels (Triton compiled vs the torch
reference, bit-identical over 10 runs), 2 bm25 (device vs CPU on LoCoMo), 3 encoders (fp32/bf16,
sentence-transformers, duplicates, cross-encoder top-10, throughput, OOM halving), 4 retrieval (all
1,540 LoCoMo questions, packs device vs CPU), 5 memory (peak GPU/host memory, LongMemEval-M-shaped BM25),
6 bench_kernels (experiments/bench_kernels.run_gpu_stage). A stage that no longer fits --budget-s is
skipped; the scalable ones size themselves to what is left.

`--out DIR/gpu_check.json` is rewritten (atomically) when each stage starts and ends, so a run killed by a
timeout still leaves every finished stage and names the one that was running. Verdict: "pass" when every
stage that ran is ok and none of stages 1-4 was skipped; "fail" when a stage failed; else "incomplete".
Exit 0 on pass, 1 otherwise, 2 for bad arguments or assets.

`--device cpu --quick` (CI, tests/test_gpu_check.py) runs every stage on two LoCoMo conversations with the
CPU as "device" and the Triton kernels under TRITON_INTERPRET=1: it proves the code paths, not a GPU.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = REPO / "experiments"
REPORT = "gpu_check.json"
MANIFEST_VERSION = 1  # of prepare_gpu_check.py's manifest.json
_VERSIONS = ("torch", "triton", "transformers", "sentence-transformers", "numpy", "pyyaml", "safetensors",
             "tokenizers", "omegaconf")


class AssetsError(Exception):
    """Missing or damaged assets: one line, exit code 2."""


def verify_assets(assets: Path) -> dict[str, Any]:
    """The manifest, after checking every file it lists against its size and sha256."""
    manifest_path = assets / "manifest.json"
    if not manifest_path.is_file():
        raise AssetsError(f"gpu_check: {manifest_path} not found: run `python experiments/prepare_gpu_check.py "
                          f"--out {assets}` on the CPU machine first")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as exc:
        raise AssetsError(f"gpu_check: {manifest_path}: invalid JSON ({exc})") from None
    if manifest.get("version") != MANIFEST_VERSION:
        raise AssetsError(f"gpu_check: {manifest_path}: version {manifest.get('version')!r}, expected "
                          f"{MANIFEST_VERSION}: prepare the assets again")
    for name, info in manifest["files"].items():
        path = assets / name
        if not path.is_file():
            raise AssetsError(f"gpu_check: asset {path} is missing (listed in {manifest_path})")
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if path.stat().st_size != info["bytes"] or digest != info["sha256"]:
            raise AssetsError(f"gpu_check: asset {path} does not match its manifest entry (damaged or replaced)")
    return manifest


def bootstrap(assets: Path) -> dict[str, Any]:
    """Before the package is imported: the tree and the assets' packages first on sys.path, FAISS replaced
    by the exact stand-in, and memfit_gpu.kernels mapped to kernels/ if the tree lost its symlink."""
    for path in (assets / "site", EXPERIMENTS, REPO):
        sys.path.insert(0, str(path))
    import _flat_ip

    _flat_ip.install()
    info = {"package_from": str(REPO), "faiss": "experiments/_flat_ip.py (exact numpy stand-in)",
            "kernels": "memfit_gpu/kernels symlink"}
    if not (REPO / "memfit_gpu" / "kernels").is_dir():
        # a copy that does not keep symlinks (the device tool, a Windows checkout): map the package by hand
        import importlib.util

        spec = importlib.util.spec_from_file_location("memfit_gpu.kernels", REPO / "kernels" / "__init__.py",
                                                      submodule_search_locations=[str(REPO / "kernels")])
        module = importlib.util.module_from_spec(spec)
        sys.modules["memfit_gpu.kernels"] = module
        spec.loader.exec_module(module)
        info["kernels"] = "kernels/ mapped by gpu_check (the memfit_gpu/kernels symlink is missing)"
    return info


def environment(device: str) -> dict[str, Any]:
    """Versions and the device, read without importing the package."""
    env: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform(),
                           "cpu_count": os.cpu_count(), "versions": {}}
    for name in _VERSIONS:
        try:
            env["versions"][name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            env["versions"][name] = None
    import torch

    env["torch_cuda"] = torch.version.cuda
    env["torch_threads"] = torch.get_num_threads()
    env["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    env["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET")
    if device != "cpu" and torch.cuda.is_available():
        index = torch.device(device).index or 0
        props = torch.cuda.get_device_properties(index)
        env["gpu"] = {"name": props.name, "capability": list(torch.cuda.get_device_capability(index)),
                      "memory_bytes": props.total_memory, "count": torch.cuda.device_count(),
                      "bf16_native": bool(torch.cuda.is_bf16_supported(including_emulation=False)),
                      "allow_tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
                      "driver": _driver_version()}
    return env


def _driver_version() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None


class Report:
    """gpu_check.json, rewritten whole after every change. Its own atomic write (not the package's): it
    must work before the package imports, since a failing import is one of the things it reports."""

    def __init__(self, out: Path, args: argparse.Namespace, budget_s: float):
        self.path = out / REPORT
        self.started = time.perf_counter()
        self.data: dict[str, Any] = {
            "check": "memfit_gpu GPU check (experiments/gpu_check.py)", "args": vars(args),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "budget_s": budget_s, "elapsed_s": 0.0,
            "env": {}, "setup": {"status": "running"}, "stages": {}, "verdict": "incomplete",
            "verdict_reason": "running",
        }

    def write(self) -> None:
        self.data["elapsed_s"] = round(time.perf_counter() - self.started, 2)
        self.data["verdict"], self.data["verdict_reason"] = verdict(self.data)
        # its own atomic write (not memfit_gpu.files): the JSON is written before the package can be imported
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=_json_default) + "\n")
        os.replace(tmp, self.path)


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    if isinstance(value, Path):
        return str(value)
    return str(value)


def verdict(data: dict[str, Any]) -> tuple[str, str]:
    if data["setup"].get("status") == "fail":
        return "fail", "setup failed: " + str(data["setup"].get("error", ""))[:200]
    stages = data["stages"]
    failed = [name for name, s in stages.items() if s["status"] == "fail"]
    if failed:
        return "fail", "failed: " + ", ".join(failed)
    running = [name for name, s in stages.items() if s["status"] in ("running", "pending")]
    if data["setup"].get("status") != "ok" or running:
        return "incomplete", "not finished (killed or still running" + (f": {running[0]}" if running else "") + ")"
    missing = [name for name, s in stages.items() if s["top"] and s["status"] == "skipped"]
    if missing:
        return "incomplete", "skipped: " + ", ".join(f"{n} ({stages[n]['reason']})" for n in missing)
    return "pass", "every stage that ran is ok and stages 1-4 all ran"


def _failure(exc: BaseException) -> dict[str, str]:
    return {"error": f"{type(exc).__name__}: {exc}"[:2000],
            "traceback": "".join(traceback.format_exception(exc))[-4000:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (a dry run of every code path)")
    parser.add_argument("--assets", default=str(REPO / "gpu_assets"), help="folder from prepare_gpu_check.py")
    parser.add_argument("--out", required=True, help="folder for gpu_check.json")
    parser.add_argument("--budget-s", type=float, default=420.0, help="wall seconds for the whole check")
    parser.add_argument("--quick", action="store_true", help="two LoCoMo conversations, no throughput sweeps")
    parser.add_argument("--stages", default=None, help="comma list of stage names to run (default: all)")
    parser.add_argument("--verbose", action="store_true", help="the package's INFO logs")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    out, assets = Path(args.out), Path(args.assets)
    if args.device != "cpu" and not args.device.startswith("cuda"):
        parser.error(f"--device {args.device!r}: expected cuda, cuda:N or cpu")
    try:
        manifest = verify_assets(assets)
    except AssetsError as exc:
        print(exc, file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    # The Triton interpreter is chosen when a kernel is defined (on first launch): set it before anything
    # runs. A CPU run interprets the kernels; a GPU run must compile them.
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    # everything is local: never wait on the hub (the GPU machine has no network)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if not args.verbose:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    report = Report(out, args, args.budget_s)
    report.data["assets"] = {"path": str(assets), "total_bytes": manifest["total_bytes"],
                             "encoder": manifest["encoder"], "site": manifest["site"], "verified": True}
    report.write()
    work = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    try:
        return _run(args, assets, work, report, start)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(args: argparse.Namespace, assets: Path, work: Path, report: Report, start: float) -> int:
    try:
        report.data["setup"]["bootstrap"] = bootstrap(assets)
        report.data["env"] = environment(args.device)
        import _gpu_check_stages as stages  # after bootstrap: it imports the package from this tree

        ctx = stages.Context.create(args.device, args.quick, assets, work, start + args.budget_s)
        report.data["setup"]["imports"] = {name: getattr(sys.modules.get(name), "__file__", None)
                                           for name in ("memfit_gpu", "memfit_gpu.kernels", "faiss", "omegaconf")}
        report.data["setup"].update(status="ok", seconds=round(time.perf_counter() - start, 2),
                                    device=str(ctx.device), memories=len(ctx.memories), questions=len(ctx.questions),
                                    episodes=len(ctx.episodes))
    except Exception as exc:  # noqa: BLE001 - reported in the JSON: the import itself is under test
        report.data["setup"].update(status="fail", seconds=round(time.perf_counter() - start, 2), **_failure(exc))
        report.write()
        print(f"gpu_check: setup failed: {exc}", file=sys.stderr)
        return 1
    chosen = [s for s in (*stages.STAGES, *stages.FIGURE_STAGES)
              if args.stages is None or s.name in args.stages.split(",")]
    scale = 0.1 if args.quick else 1.0
    for priority, stage in enumerate(chosen, 1):
        report.data["stages"][stage.name] = {"priority": priority, "title": stage.title, "top": stage.top,
                                             "status": "pending"}
    report.write()
    for i, stage in enumerate(chosen):
        entry = report.data["stages"][stage.name]
        ctx.reserve = sum(s.min_s * scale for s in chosen[i + 1:])
        if ctx.remaining() < stage.min_s * scale:
            entry.update(status="skipped", reason=f"budget: {ctx.remaining():.0f} s left, the stage needs "
                                                  f"~{stage.min_s * scale:.0f} s", seconds=0.0)
            report.write()
            continue
        entry["status"] = "running"
        report.write()
        began = time.perf_counter()
        try:
            metrics = stage.run(ctx)
            failed = [name for name, ok in metrics.get("checks", {}).items() if not ok]
            entry.update(status="fail" if failed else "ok", metrics=metrics)
            if failed:
                entry["failed_checks"] = failed
        except stages.Skip as exc:
            entry.update(status="skipped", reason=str(exc))
        except Exception as exc:  # noqa: BLE001 - one stage's failure must not hide the others
            entry.update(status="fail", **_failure(exc))
        finally:
            ctx.free_device_memory()
        entry["seconds"] = round(time.perf_counter() - began, 2)
        report.write()
        print(f"gpu_check: {stage.name:<14} {entry['status']:<8} {entry['seconds']:7.1f} s"
              + (f"  {entry.get('failed_checks') or entry.get('reason') or entry.get('error', '')}"
                 if entry["status"] != "ok" else ""), file=sys.stderr, flush=True)
    verdict_now = report.data["verdict"]
    print(f"gpu_check: verdict {verdict_now} ({report.data['verdict_reason']}) in "
          f"{time.perf_counter() - start:.0f} s -> {report.path}", file=sys.stderr)
    return 0 if verdict_now == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
