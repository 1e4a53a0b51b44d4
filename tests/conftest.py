"""Session-wide fixtures: real data from ../shared/data, real packaged models loaded once."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import forkserver  # tests/support/forkserver.py (tests/ is on sys.path)
from support.data import LOCOMO, SHARED_DATA

# Tests never reach a model hub: packaged weights only, and a clear error otherwise.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]


# MEMFIT_TEST_TIMELINE=FILE: where the suite's time goes. Each worker appends a line per test (worker, start,
# end, test id) and the controller a line per second with the machine's busy cores (/proc/stat), so idle
# stretches can be matched with the tests that ran then (docs/benchmarks/history.md "Test suite"); at the end
# each worker a line per environment its `memfit` processes ran in (tests/support/forkserver.py: processes,
# whether it got zygotes, the import-time variables it differs in).
TIMELINE_ENV = "MEMFIT_TEST_TIMELINE"
_timeline_stop = threading.Event()


def _sample_busy_cores(path: str) -> None:
    def read() -> tuple[float, float]:
        fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # all jiffies, idle + iowait

    cores = os.cpu_count() or 1
    last = read()
    while not _timeline_stop.wait(1.0):
        now = read()
        total, idle = now[0] - last[0], now[1] - last[1]
        last = now
        with open(path, "a") as handle:
            handle.write(f"cpu\t{time.time():.2f}\t{cores * (1 - idle / total) if total else 0:.2f}\n")


# What the suite writes at its peak: its temporary directories (under the system's temp folder, as
# pytest-of-USER/) and the model cache `make test` makes there, 1.4 GiB together on 2026-12-06. With less
# free, a run fails part way with hundreds of "No space left on device" errors; it is refused at the start
# instead, in one line. MEMFIT_TEST_MIN_FREE_GIB sets the floor.
MIN_FREE_ENV = "MEMFIT_TEST_MIN_FREE_GIB"
MIN_FREE_GIB = 2.0


def check_free_disk(config: pytest.Config) -> None:
    need = float(os.environ.get(MIN_FREE_ENV, MIN_FREE_GIB))
    places = {Path(config.option.basetemp or tempfile.gettempdir())}
    if os.environ.get("MEMFIT_CACHE"):
        places.add(Path(os.environ["MEMFIT_CACHE"]))
    for place in sorted(places):
        existing = next(p for p in (place, *place.parents) if p.exists())
        free = shutil.disk_usage(existing).free / 2**30
        if free < need:
            raise pytest.UsageError(
                f"{place}: {free:.1f} GiB free, the test suite needs {need:.1f} GiB there (its temporary files "
                f"and model cache); free some space and rerun ({MIN_FREE_ENV} sets the floor)")


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        check_free_disk(config)
    # `python -m memfit_gpu.cli` children are forks of a process that imported torch & co. once
    # (tests/support/forkserver.py); MEMFIT_TEST_FORKSERVER=0 makes every one a fresh interpreter
    if forkserver.enabled():
        forkserver.install()
    timeline = os.environ.get(TIMELINE_ENV)
    if timeline and os.environ.get("PYTEST_XDIST_WORKER") is None:
        threading.Thread(target=_sample_busy_cores, args=(timeline,), daemon=True).start()


def pytest_unconfigure(config: pytest.Config) -> None:
    _timeline_stop.set()
    timeline = os.environ.get(TIMELINE_ENV)
    if timeline:  # which environments needed zygotes of their own (each pair costs ~13 s of CPU)
        with open(timeline, "a") as handle:
            for entry in forkserver.usage():
                handle.write(f"zygotes\t{os.environ.get('PYTEST_XDIST_WORKER', 'main')}\t{entry['processes']}"
                             f"\t{int(entry['zygotes'])}\t{','.join(entry['differs_in'])}\n")
    forkserver.uninstall()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    timeline = os.environ.get(TIMELINE_ENV)
    started = time.time()
    yield
    if timeline:
        with open(timeline, "a") as handle:
            handle.write(f"test\t{os.environ.get('PYTEST_XDIST_WORKER', 'main')}\t{started:.2f}\t{time.time():.2f}"
                         f"\t{item.nodeid}\n")


# `make test` runs the suite on two pytest-xdist workers (--dist loadfile): each test file runs on one
# worker, so a module's fixtures (a real run, a server) are set up once. Files are handed out in this
# order, the longest first, so that the two workers end together (measured: docs/benchmarks/history.md "Test
# suite"); the rest follow in their collection order. test_serve_hostile.py waits on its server most of its
# minute (a core idle): handed out third, it runs while the other worker's LightMem sweep runs two points at
# once, which take up that core, instead of last, beside nothing.
LONGEST_FIRST = (
    "test_methods_runs.py", "test_run_crash_consistency.py", "test_serve_hostile.py", "test_readers_vllm.py",
    "test_sweep_lightmem.py",
    "test_experiments_gpu_check.py", "test_sweep_slurm.py", "test_run_pipeline.py", "test_run_beam.py", "test_methods_peers.py", "test_sweep_slurm_scripts.py",
    "test_store_locomo.py",
    "test_evaluate_paper_tables.py", "test_run_depths.py", "test_report_browser.py", "test_report.py", "test_index_encoder_workers.py", "test_kernels.py", "test_seams.py", "test_live.py",
    "test_store_run.py", "test_retrieve_reference.py", "test_readers_cache.py", "test_models.py",
    "test_retrieve_cli.py", "test_index_encoders.py", "test_readers_transformers.py", "test_store_cli.py", "test_serve.py",
    "test_store_summaries.py", "test_store_scale.py", "test_cli_errors.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept within


@pytest.fixture(scope="module")
def one_vllm_module_at_a_time(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Taken by what starts vLLM engines or servers: two xdist workers never run them at once (each vLLM
    CPU process binds its OpenMP threads to the cores; two take turns slower than one after the other).
    Held until the module ends."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        yield
        return
    shared = tmp_path_factory.getbasetemp().parent  # this session's folder, common to its workers
    with open(shared / "vllm.lock", "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        yield


@pytest.fixture(autouse=True)
def _fresh_interpreter_when_marked(request: pytest.FixtureRequest):
    """`@pytest.mark.fresh_interpreter`: the test's `memfit` processes start a new interpreter each."""
    if request.node.get_closest_marker("fresh_interpreter") is None:
        yield
        return
    with forkserver.fresh_interpreters():
        yield


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.exists():
        raise RuntimeError(f"benchmark data not found at {SHARED_DATA}: CI needs ../shared beside the checkout")
    return SHARED_DATA


@pytest.fixture(scope="session")
def locomo_path(shared_data: Path) -> Path:
    return shared_data / LOCOMO


@pytest.fixture(scope="session")
def bi_encoder():
    """The real all-MiniLM-L6-v2 bi-encoder (packaged weights), loaded once per test session, on CPU."""
    from memfit_gpu.index.encoders import BiEncoder

    return BiEncoder.from_pretrained("sentence-transformers/all-MiniLM-L6-v2", device="cpu")


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    """Folder of the real all-MiniLM-L6-v2 weights, as `models.resolve` finds them (packaged offline)."""
    from memfit_gpu.models import resolve

    return Path(resolve("encoder", "sentence-transformers/all-MiniLM-L6-v2").path)


@pytest.fixture(scope="session")
def minilm(bi_encoder):
    """The loaded BiEncoder (same object as `bi_encoder`: one load per session)."""
    return bi_encoder


def lead_summaries(prompts: list[str]) -> list[str]:
    """Extractive summaries without an LLM: the first two excerpt bullets of each summary prompt.

    Real conversation text, deterministic; for tests of retrieval over a summary layer (not of summary
    quality, which needs a reader)."""
    out = []
    for prompt in prompts:
        bullets = [line[2:] for line in prompt.splitlines() if line.startswith("- ")]
        out.append(" ".join(bullets[:2]))
    return out


@pytest.fixture(scope="session")
def locomo2_summary_store(locomo_path: Path, bi_encoder):
    """In-memory EpisodeStore of the first two LoCoMo conversations (788 turns, one encoder pass) with
    extractive summaries (`lead_summaries`). Read-only: tests must not append to or delete from it."""
    from memfit_gpu.config import MemFitConfig
    from memfit_gpu.data import load_benchmark, select_questions
    from memfit_gpu.store import EpisodeStore

    benchmark = select_questions(load_benchmark("locomo", locomo_path), exclude_categories=["5"], limit_memories=2)
    store = EpisodeStore(None, MemFitConfig(), bi_encoder)
    store.add_memories(benchmark.memories, progress=False)
    store.build_summaries(lead_summaries, progress=False)
    return benchmark, store


def session_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of this test session common to its xdist workers (the basetemp itself without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") is not None else base


@pytest.fixture(scope="session")
def smoke_run_dir(tmp_path_factory: pytest.TempPathFactory, shared_data: Path) -> tuple[Path, str]:
    """`memfit run --config configs/smoke.yaml` made ONCE per test session, whichever worker asks first (the
    other waits on a lock): (run directory, the command's stdout). READ-ONLY: a test that reruns, damages
    or resumes it works on a copy (`shutil.copytree`)."""
    from support.env import memfit_env

    shared = session_folder(tmp_path_factory)
    out, stdout = shared / "smoke-run" / "smoke", shared / "smoke-run" / "stdout.txt"
    out.parent.mkdir(exist_ok=True)
    with open(shared / "smoke-run.lock", "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        if not stdout.exists():  # written last: a run that failed is made again by the next asker
            if out.exists():
                shutil.rmtree(out)
            env = memfit_env(shared_data)
            proc = subprocess.run([sys.executable, "-m", "memfit_gpu.cli", "run", "--config",
                                   str(REPO / "configs" / "smoke.yaml"), "--out", str(out), "--quiet"], env=env,
                                  capture_output=True, text=True, timeout=1200)
            assert proc.returncode == 0, proc.stderr[-3000:]
            stdout.write_text(proc.stdout)
    return out, stdout.read_text()
