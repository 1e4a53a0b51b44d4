"""The GPU check: one call on a bare single-GPU machine that says whether memfit_gpu on that GPU gives what
it gives on the CPU, and how fast and how big it runs there, with a verdict that holds even if it is killed.

The procedure (docs/benchmarks/history.md "GPU check" has the same, with the figures):

 1. On the CPU machine (a checkout after `make setup`), prepare the assets and make the dry run:

        .venv/bin/python experiments/prepare_gpu_check.py --out gpu_assets
        .venv/bin/python experiments/gpu_check.py --device cpu --quick --out /tmp/gc

    prepare_gpu_check.py writes gpu_assets/ (ignored by git, ~48 MiB: omegaconf, MiniLM as float16,
    locomo10.json, a manifest with every file's sha256) and prints what travels: the tree as git sees it
    (tracked files and untracked ones not ignored: no .venv/, runs/, build/, gpu_assets/ counted apart)
    plus gpu_assets/, against the 64 MiB the GPU machine accepts; more is an error (exit 2). The dry run
    runs every stage with the CPU as "device" and the Triton kernels under TRITON_INTERPRET=1 (4.5 minutes
    on 2 shared cores on 2026-12-01; its JSON lists every stage with its checks; verdict pass). With
    Triton 3.6 it needs numpy < 2.4 (that interpreter fails with numpy >= 2.4).
 2. Copy the tree as git lists it and gpu_assets/ inside its root (beside experiments/) to the GPU
    machine: 49.6 MiB on 2026-12-01 (2.0 MiB of tree in 267 files, 47.6 MiB of assets).
 3. There, from the tree's root, with its own python3 (no install, no network: the package is imported
    from the tree, omegaconf from gpu_assets/site, FAISS replaced by experiments/_flat_ip.py):

        timeout -k 10 390 python3 experiments/gpu_check.py --device cuda --out $OUT --budget-s 300 --margin-s 30

    The watchdog ends the call at 330 s (budget + margin) with the JSON naming the part still running;
    `timeout` is the backstop if even that hangs (SIGTERM: the same record; SIGKILL 10 s later: the JSON
    written when the running part started, naming it). Exit 0 on pass, 1 on fail or incomplete, 2 for bad
    arguments or assets, 3 when the watchdog fired.
 4. If a stage failed or did not finish, once more on the warm machine (Triton's cache is kept in the
    tree's build/triton-cache, so kernels load instead of compiling): only the stages that were not ok run,
    the ok ones are carried over from the first JSON, and the verdict covers them all:

        timeout -k 10 240 python3 experiments/gpu_check.py --device cuda --out $OUT/rerun \\
            --rerun-failed $OUT/gpu_check.json --budget-s 180 --margin-s 30

    Machine start (a few minutes) + 6.5 + 4 minutes stays inside a 15-minute lease.

Stages (experiments/_gpu_check_stages.py), most valuable first: kernels (bit-identical to torch, speed at
LoCoMo and S size), bm25 (all 1,540 questions GPU = CPU), retrieval (all 1,540 packs with the production
device path: same embeddings identical, the GPU's own embeddings only near ties), encoders (vs CPU and vs
sentence-transformers: vectors and throughput), memory (peaks), encoders_more, rerank, kernels_m, reader
and vllm_room (stand-ins for what the machine cannot run), workers, and the optional kernels_wide.

gpu_check.json is rewritten atomically after every part of every stage, so a kill at any point leaves every
finished part and names the running one. Per stage: status (ok | fail | skipped | not_run | running), seconds,
metrics (checks, placement of every device-side index and model, runtime: kernel backend, dense placement,
dtypes, TF32), kernel_variants (every Triton variant launched, with the seconds of its first launch, i.e. its
compile), warnings logged by the package. Verdict: "fail" when setup or a stage failed; "incomplete" when a
stage did not finish, was not run (--stages selects a subset) or was skipped for the budget, or when the kernel
speed ratio or the memory peaks are missing; else "pass". The optional stage never decides it.
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
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = REPO / "experiments"
REPORT = "gpu_check.json"
MANIFEST_VERSION = 1  # of prepare_gpu_check.py's manifest.json
WATCHDOG_EXIT = 3
_VERSIONS = ("torch", "triton", "transformers", "sentence-transformers", "numpy", "pyyaml", "safetensors",
             "tokenizers", "omegaconf")
_FIGURES = ("kernel_speed_ratio", "memory_peaks")  # what a pass needs besides the checks


class AssetsError(Exception):
    """Missing or damaged assets, or a bad --rerun-failed file: one line, exit code 2."""


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
    numpy, triton = env["versions"]["numpy"] or "0", env["versions"]["triton"] or "0"
    if env["TRITON_INTERPRET"] and triton.startswith("3.6.") and tuple(map(int, numpy.split(".")[:2])) >= (2, 4):
        # seen with triton 3.6.0 + numpy 2.4.1 (3.6.0 + 2.3.5 runs): the kernel cases then fail with
        # "only 0-dimensional arrays can be converted to Python scalars"
        env["warning"] = (f"Triton {triton}'s interpreter fails with numpy {numpy} >= 2.4 (triton-lang/triton#9171): "
                          "the dry run needs numpy < 2.4 with this Triton")
        print(f"gpu_check: {env['warning']}", file=sys.stderr)
    env["TRITON_CACHE_DIR"] = os.environ.get("TRITON_CACHE_DIR")
    if device != "cpu" and torch.cuda.is_available():
        from memfit_gpu.devices import driver_version

        index = torch.device(device).index or 0
        props = torch.cuda.get_device_properties(index)
        env["gpu"] = {"name": props.name, "capability": list(torch.cuda.get_device_capability(index)),
                      "memory_bytes": props.total_memory, "count": torch.cuda.device_count(),
                      "bf16_native": bool(torch.cuda.is_bf16_supported(including_emulation=False)),
                      "allow_tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
                      "allow_tf32_cudnn": torch.backends.cudnn.allow_tf32,
                      "driver": driver_version()}
    return env


class Report:
    """gpu_check.json, rewritten whole (atomically) after every change, by the runner and by the watchdog
    thread (one lock). Its own atomic write, not the package's: it must work before the package imports,
    since a failing import is one of the things it reports."""

    def __init__(self, out: Path, args: argparse.Namespace, budget_s: float, margin_s: float):
        self.path = out / REPORT
        self.started = time.perf_counter()
        self.lock = threading.RLock()
        self.data: dict[str, Any] = {
            "check": "memfit_gpu GPU check (experiments/gpu_check.py)", "args": vars(args),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "budget_s": budget_s, "margin_s": margin_s,
            "elapsed_s": 0.0, "env": {}, "setup": {"status": "running"}, "running": None, "stages": {},
            "figures": {}, "verdict": "incomplete", "verdict_reason": "running",
        }

    def write(self) -> None:
        with self.lock:
            self.data["elapsed_s"] = round(time.perf_counter() - self.started, 2)
            self.data["verdict"], self.data["verdict_reason"] = verdict(self.data)
            for attempt in range(5):  # the watchdog may dump while the main thread mutates a metrics dict
                try:
                    text = json.dumps(self.data, indent=1, default=_json_default) + "\n"
                    break
                except RuntimeError:
                    if attempt == 4:
                        raise
                    time.sleep(0.05)
            tmp = self.path.with_name(f"{self.path.name}.{threading.get_ident()}.tmp")
            tmp.write_text(text)
            os.replace(tmp, self.path)

    def running(self, stage: str | None, part: str | None) -> None:
        """What runs now (None: nothing), then the file is rewritten."""
        with self.lock:
            self.data["running"] = None if stage is None else {
                "stage": stage, "part": part, "since_s": round(time.perf_counter() - self.started, 2)}
            if stage is not None and stage in self.data["stages"]:
                self.data["stages"][stage]["part"] = part
            self.write()


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    return str(value)


class Watchdog(threading.Thread):
    """Ends the process at --budget-s + --margin-s, whatever it is doing (a compile, a hung CUDA call, a
    worker that never starts): the JSON is rewritten naming the part that was running, then
    `exit(WATCHDOG_EXIT)` (os._exit: no cleanup can hang it)."""

    def __init__(self, report: Report, after_s: float, exit: Callable[[int], None] = os._exit):
        super().__init__(name="gpu_check-watchdog", daemon=True)
        self.report, self.after_s, self.exit = report, after_s, exit
        self.stopped = threading.Event()

    def run(self) -> None:
        if not self.stopped.wait(max(0.0, self.after_s - (time.perf_counter() - self.report.started))):
            self.fire("the watchdog")

    def fire(self, by: str) -> None:
        with self.report.lock:
            data = self.report.data
            running = data.get("running") or {}
            data["watchdog"] = {"fired_by": by, "at_s": round(time.perf_counter() - self.report.started, 2),
                                "budget_s": data["budget_s"], "margin_s": data["margin_s"], "running": running}
            stage = data["stages"].get(running.get("stage", ""))
            if stage is not None:
                stage["killed_by"] = by
            self.report.write()
        where = _where(running.get("stage"), running.get("part"))
        print(f"gpu_check: {by} ended the check at {data['watchdog']['at_s']:.0f} s while {where} was running "
              f"-> {self.report.path}", file=sys.stderr, flush=True)
        self.exit(WATCHDOG_EXIT)


def _where(stage: str | None, part: str | None) -> str:
    return "setup" if stage is None else stage if part is None else f"{stage}/{part}"


def verdict(data: dict[str, Any]) -> tuple[str, str]:
    """(pass | fail | incomplete, why). Every stage but the optional ones decides it."""
    if data["setup"].get("status") == "fail":
        return "fail", "setup failed: " + str(data["setup"].get("error", ""))[:200]
    stages = data["stages"]
    failed = [name for name, s in stages.items() if s["status"] == "fail"]
    if failed:
        return "fail", "failed: " + ", ".join(
            f"{n} ({', '.join(stages[n].get('failed_checks', [])) or stages[n].get('error', '')[:80]})" for n in failed)
    dog = data.get("watchdog")
    if dog:
        where = dog["running"] or {}
        return "incomplete", (f"{dog['fired_by']} ended it at {dog['at_s']:.1f} s (budget {dog['budget_s']:g} s + "
                              f"margin {dog['margin_s']:g} s) while {_where(where.get('stage'), where.get('part'))} "
                              "was running")
    running = [name for name, s in stages.items() if s["status"] in ("running", "pending")]
    if data["setup"].get("status") != "ok" or running:
        now = f": {_where(running[0], stages[running[0]].get('part'))}" if running else ""
        return "incomplete", f"not finished (killed or still running{now})"
    required = {name: s for name, s in stages.items() if not s.get("optional")}
    not_run = [name for name, s in required.items() if s["status"] == "not_run"]
    if not_run:
        return "incomplete", "not run (--stages): " + ", ".join(not_run)
    skipped = [name for name, s in required.items() if s["status"] == "skipped"]
    if skipped:
        return "incomplete", "skipped: " + ", ".join(f"{n} ({stages[n]['reason']})" for n in skipped)
    missing = [name for name in _FIGURES if not data.get("figures", {}).get(name)]
    if missing:
        return "incomplete", "no " + " and no ".join(missing.replace("_", " ") for missing in missing)
    return "pass", f"all {len(required)} stages ran and passed; kernel speed ratio and memory peaks recorded"


def _failure(exc: BaseException) -> dict[str, str]:
    return {"error": f"{type(exc).__name__}: {exc}"[:2000],
            "traceback": "".join(traceback.format_exception(exc))[-4000:]}


def _previous(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise AssetsError(f"gpu_check: --rerun-failed {path}: {exc}") from None
    if not isinstance(data.get("stages"), dict):
        raise AssetsError(f"gpu_check: --rerun-failed {path}: not a gpu_check.json (no stages)")
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="The procedure, step by step, is this script's docstring and "
                                            "docs/benchmarks/history.md (GPU check).")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (a dry run of every code path)")
    parser.add_argument("--assets", default=str(REPO / "gpu_assets"), help="folder from prepare_gpu_check.py")
    parser.add_argument("--out", required=True, help="folder for gpu_check.json")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall seconds the stages plan for (skipped when they no longer fit; scalable parts "
                             "size themselves to what is left); default 300 on a GPU, 1200 for a CPU run")
    parser.add_argument("--margin-s", type=float, default=30.0,
                        help="the watchdog ends the check at --budget-s plus this, naming the running part")
    parser.add_argument("--quick", action="store_true", help="two LoCoMo conversations, small samples (the dry run)")
    parser.add_argument("--stages", default=None, help="comma list of stage names to run (the rest: not_run)")
    parser.add_argument("--rerun-failed", default=None, metavar="GPU_CHECK_JSON",
                        help="run only the stages that were not ok in this earlier gpu_check.json, carrying the "
                             "ok ones over (the second call of the procedure, on the warm machine)")
    parser.add_argument("--verbose", action="store_true", help="the package's INFO logs")
    args = parser.parse_args(argv)
    out, assets = Path(args.out), Path(args.assets)
    if args.device != "cpu" and not args.device.startswith("cuda"):
        parser.error(f"--device {args.device!r}: expected cuda, cuda:N or cpu")
    if args.budget_s is None:
        args.budget_s = 1200.0 if args.device == "cpu" else 300.0
    if args.stages and args.rerun_failed:
        parser.error("--stages and --rerun-failed both choose the stages: give one")
    try:
        manifest = verify_assets(assets)
        previous = _previous(Path(args.rerun_failed)) if args.rerun_failed else None
    except AssetsError as exc:
        print(exc, file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    # The Triton interpreter is chosen when a kernel is defined (on first launch): set it before anything
    # runs. A CPU run interprets the kernels; a GPU run must compile them, into the tree's ignored build/
    # (kept on a warm machine between calls, so a rerun loads them).
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
        os.environ.setdefault("TRITON_CACHE_DIR", str(REPO / "build" / "triton-cache"))
    # everything is local: never wait on the hub (the GPU machine has no network)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not args.verbose:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    report = Report(out, args, args.budget_s, args.margin_s)
    report.data["assets"] = {"path": str(assets), "total_bytes": manifest["total_bytes"],
                             "encoder": manifest["encoder"], "site": manifest["site"],
                             "travel": manifest.get("travel"), "verified": True}
    watchdog = Watchdog(report, args.budget_s + args.margin_s)
    # `timeout`'s signal gets the same record as the watchdog (installed before the file first exists)
    previous_handler = signal.signal(signal.SIGTERM, lambda *_: watchdog.fire("SIGTERM"))
    report.write()
    watchdog.start()
    work = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    try:
        return _run(args, assets, work, report, previous)
    finally:
        watchdog.stopped.set()
        signal.signal(signal.SIGTERM, previous_handler)
        shutil.rmtree(work, ignore_errors=True)


class _WarningsOf(logging.Handler):
    """The package's warnings during one stage (an out-of-memory fallback says so there first)."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.messages) < 20:
            self.messages.append(f"{record.name}: {record.getMessage()}"[:400])


def _variants_of_stage(variants: dict[Any, dict[str, Any]], before: dict[Any, int]) -> list[dict[str, Any]]:
    """The kernel variants a stage launched: `first_launch_here` when the stage compiled it (its
    first_launch_s is then that compile), `launches_here` how often the stage launched it."""
    rows = []
    for key, row in variants.items():
        here = row["launches"] - before.get(key, 0)
        if here:
            rows.append({**row, "launches_here": here, "first_launch_here": key not in before})
    return rows


def _run(args: argparse.Namespace, assets: Path, work: Path, report: Report, previous: dict[str, Any] | None) -> int:
    start = report.started
    try:
        if os.environ.get("GPU_CHECK_STALL") == "setup":  # the watchdog's test (see _gpu_check_stages)
            while True:
                time.sleep(1.0)
        report.data["setup"]["bootstrap"] = bootstrap(assets)
        report.data["env"] = environment(args.device)
        import _gpu_check_stages as stages  # after bootstrap: it imports the package from this tree

        from memfit_gpu.kernels._launch import recording_launches

        names = [s.name for s in stages.STAGES]
        unknown = sorted(set((args.stages or "").split(",")) - set(names) - {""})
        if unknown:
            raise ValueError(f"--stages: unknown {', '.join(unknown)} (stages: {', '.join(names)})")
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
        return 2 if isinstance(exc, ValueError) and str(exc).startswith("--stages") else 1
    chosen_names = args.stages.split(",") if args.stages else names
    carried = {}
    if previous is not None:
        carried = {n: s for n, s in previous["stages"].items() if s.get("status") == "ok" and n in names}
        chosen_names = [n for n in names if n not in carried]
        report.data["rerun_of"] = {"file": args.rerun_failed, "started_at": previous.get("started_at"),
                                   "gpu": previous.get("env", {}).get("gpu"), "carried": sorted(carried)}
        for figure, value in previous.get("figures", {}).items():
            if any(figure in (s.get("metrics", {}).get("figures") or {}) for s in carried.values()):
                report.data["figures"][figure] = value
    chosen = [s for s in stages.STAGES if s.name in chosen_names]
    scale = 0.1 if args.quick else 1.0
    for priority, stage in enumerate(stages.STAGES, 1):
        entry = {"priority": priority, "title": stage.title, "optional": stage.optional}
        if stage.name in carried:
            entry.update(carried[stage.name], priority=priority, carried_from=args.rerun_failed)
        else:
            entry["status"] = "pending" if stage in chosen else "not_run"
        report.data["stages"][stage.name] = entry
    report.write()

    def on_part(part: str | None) -> None:
        report.running(ctx.stage, part)

    ctx.on_part = on_part
    with recording_launches() as launches:
        for i, stage in enumerate(chosen):
            entry = report.data["stages"][stage.name]
            ctx.reserve = sum(s.min_s * scale for s in chosen[i + 1:] if not s.optional)
            if ctx.remaining() < stage.min_s * scale:
                entry.update(status="skipped", reason=f"budget: {ctx.remaining():.0f} s left, the stage needs "
                                                      f"~{stage.min_s * scale:.0f} s", seconds=0.0)
                report.write()
                continue
            ctx.stage = stage.name
            ctx.metrics = metrics = {"checks": {}, "skipped": {}}
            before = {key: row["launches"] for key, row in launches.variants.items()}
            caught = _WarningsOf()
            logging.getLogger("memfit_gpu").addHandler(caught)
            entry.update(status="running", metrics=metrics, part=None)
            report.running(stage.name, None)
            began = time.perf_counter()
            try:
                stage.run(ctx)
                failed = [name for name, ok in metrics["checks"].items() if not ok]
                entry["status"] = "fail" if failed else "ok"
                if failed:
                    entry["failed_checks"] = failed
            except stages.Skip as exc:
                entry.update(status="skipped", reason=str(exc))
            except Exception as exc:  # noqa: BLE001 - one stage's failure must not hide the others
                entry.update(status="fail", **_failure(exc))
            finally:
                logging.getLogger("memfit_gpu").removeHandler(caught)
                ctx.free_device_memory()
            entry.update(seconds=round(time.perf_counter() - began, 2), part=None, warnings=caught.messages,
                         runtime=stages.tf32_state(),
                         kernel_variants=_variants_of_stage(launches.variants, before))
            for figure, value in (metrics.get("figures") or {}).items():
                report.data["figures"][figure] = value
            report.running(None, None)
            print(f"gpu_check: {stage.name:<14} {entry['status']:<8} {entry['seconds']:7.1f} s"
                  + (f"  {entry.get('failed_checks') or entry.get('reason') or entry.get('error', '')}"
                     if entry["status"] != "ok" else ""), file=sys.stderr, flush=True)
    verdict_now = report.data["verdict"]
    print(f"gpu_check: verdict {verdict_now} ({report.data['verdict_reason']}) in "
          f"{time.perf_counter() - start:.0f} s -> {report.path}", file=sys.stderr)
    return 0 if verdict_now == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
