"""A fork server for the tests' `python -m memfit_gpu.cli ...` processes (the suite's time).

Most of what a `memfit run` process costs the test suite on a 2-core machine is the interpreter importing
torch, transformers, FAISS and the package (~6 s of CPU each, and the suite starts ~200 such processes);
the run itself is often shorter. Here a *zygote* process imports all of that once, and every
`subprocess.Popen([sys.executable, "-m", "memfit_gpu.cli", ...])` of the test process becomes a fork of
that zygote which runs the command exactly as `python -m` does (`runpy._run_module_as_main`), with the
test's argv, environment, working directory and stdio file descriptors, in a process of its own: a real
pid that the test can signal, SIGKILL and wait for, its own exit code, atexit handlers, locks and files.
Nothing in memfit_gpu knows about it; `MEMFIT_TEST_FORKSERVER=0` turns it off (every process is then a
fresh interpreter, as before), and a test marked `@pytest.mark.fresh_interpreter` always gets one.

What differs from a fresh interpreter, and why it is safe here:
- Modules are imported before the command starts. The zygote has only imported them: no torch
  computation has run (an OpenMP parallel region before fork() hangs the child in its next one), which
  a probe child checks before the zygote takes any request (else every process is a fresh interpreter).
- Libraries read some environment variables when imported (HF_*, OMP_*, CUDA_*, PYTHON*, ...): a zygote
  serves only requests whose values of those variables equal its own (`import_time_env`); a request with
  other values runs as a fresh interpreter, and the second of them starts zygotes of its own and waits to be
  forked by one, as the ones after it are: a test's one odd process does not pay for two zygotes it never
  uses.
  Two are not import-time here and are served by the zygote of the other values: MEMFIT_PLUGINS (read by
  the command itself, `memfit_gpu.cli.main`), and PYTHONPATH folders that only add modules (the tests'
  plugins in tests/: no name in them is one the interpreter finds elsewhere), which the child puts on
  sys.path where a fresh interpreter would (`_extra_path`, `_become`). A folder that shadows a module
  (a site with an installed memfit_gpu) still gets zygotes of its own. Nor are the values preloaded
  libraries set themselves (sklearn's KMP_*, torch's default TORCHINDUCTOR_CACHE_DIR), which the test
  process passes on once it has imported or used them (`zygote_env`). OpenCV, which vLLM imports, appends
  its lib64 to LD_LIBRARY_PATH when imported: the test process imports it before the first zygote starts
  (`install`), so the zygotes start with the value every later child inherits, as a fresh interpreter does.
  Nor are W&B's WANDB_* (the zygote has not imported wandb: the child reads them when it does).
- Forked children share the zygote's string hash seed, so an order that depends on it would repeat
  across runs where fresh interpreters would vary it. Each environment gets two zygotes (two seeds) that
  take requests in turn, so a test's reference run and its rerun hash differently, as they would for a
  user.
- `random` reseeds itself after fork; tempfile's name generator is per pid.

Protocol (one Unix stream connection per process): the test sends a 4-byte length with the stdin,
stdout and stderr descriptors attached (SCM_RIGHTS), then that many bytes of JSON {argv, env, cwd,
new_session}; the zygote answers `pid N\\n` once it has forked and `status S\\n` (the raw wait status)
when it has reaped the child.
"""

from __future__ import annotations

import errno
import json
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CLI_MODULE = "memfit_gpu.cli"
ENABLE_ENV = "MEMFIT_TEST_FORKSERVER"
# What the zygote imports before serving: what `memfit run` and the other commands load anyway. A
# module that a branch lacks is skipped; nothing here may compute with torch.
PRELOAD = (
    "numpy", "torch", "faiss", "tokenizers", "safetensors", "yaml", "omegaconf", "tqdm", "httpx", "tabulate",
    "nltk.stem",  # every scored run's Porter stemmer (evaluate/metrics.py); nltk brings scipy.stats: seconds
    "transformers", "transformers.models.llama.modeling_llama", "transformers.models.bert.modeling_bert",
    "transformers.generation.utils",
    "memfit_gpu.cli", "memfit_gpu.run.pipeline", "memfit_gpu.readers.transformers", "memfit_gpu.readers.openai",
    "memfit_gpu.index.encoders", "memfit_gpu.index.dense", "memfit_gpu.index.bm25", "memfit_gpu.retrieve.batched",
    "memfit_gpu.evaluate.paper_tables", "memfit_gpu.evaluate.compare", "memfit_gpu.sweep.driver",
    "memfit_gpu.sweep.local", "memfit_gpu.sweep.slurm", "memfit_gpu.run.profile", "memfit_gpu.plan",
    "memfit_gpu.run.preflight", "memfit_gpu.methods.registry", "memfit_gpu.store.episodes",
)
# Environment variables that a library may read when it is imported: a zygote only serves requests with
# its own values of these.
IMPORT_TIME_PREFIXES = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "TOKENIZERS", "OMP_", "MKL_", "KMP_", "OPENBLAS",
                        "GOTO", "NUMEXPR", "TORCH", "CUDA", "NVIDIA", "TRITON", "VLLM", "PYTHON", "LD_", "MEMFIT_PLUGINS",
                        "SAFETENSORS", "FAISS", "TQDM", "NO_", "XDG_", "HOME", "PATH", "TMPDIR")
READY_TIMEOUT_S = 300.0


# Read by the command when it runs (memfit_gpu.plugins.load_plugins, from memfit_gpu.cli.main), not on import
RUN_TIME_VARS = ("MEMFIT_PLUGINS",)
PYTHONPATH = "PYTHONPATH"
# What preloaded libraries put in os.environ themselves: sklearn and joblib set these (setdefault) when
# imported, so a test process that imported them passes them on, and a zygote holds them already
SET_ON_IMPORT = {"KMP_DUPLICATE_LIB_OK": "True", "KMP_INIT_AT_FORK": "FALSE"}
INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"  # torch sets it to its default when it first uses the cache


def _default_inductor_cache() -> str | None:
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:
        return None
    return os.path.abspath(default_cache_dir())


def import_time_env(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES)))


def _path_entries(value: str | None, cwd: str) -> list[str]:
    """PYTHONPATH's folders as a fresh interpreter puts them on sys.path (relative ones and empty ones, the
    working directory, made absolute), in order, without repeats."""
    out: list[str] = []
    for entry in (value or "").split(os.pathsep) if value else []:
        path = os.path.normpath(os.path.join(cwd, entry)) if entry else cwd
        if path not in out:
            out.append(path)
    return out


_ADDS_ONLY: dict[str, bool] = {}


def _adds_only(folder: str) -> bool:
    """Whether a folder on PYTHONPATH only adds modules: each top-level name in it is found nowhere else
    (or, for a folder this process searches already, there)."""
    if folder not in _ADDS_ONLY:
        import importlib.util

        names = set()
        try:
            for entry in os.scandir(folder):
                name = entry.name.split(".", 1)[0] if entry.is_file() else entry.name
                # a folder without __init__.py (tests/' test folders: store/, kernels/, ...) shadows no module: a
                # namespace portion loses to a module or package of that name anywhere on sys.path
                package = entry.is_dir() and os.path.exists(os.path.join(entry.path, "__init__.py"))
                if name.isidentifier() and not name.startswith("__") and (package or entry.name.endswith((".py", ".pyc", ".so"))):
                    names.add(name)
        except OSError:
            names = set()
        ok = True
        for name in sorted(names):
            try:
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError):
                ok = False
                break
            if spec is None:
                continue
            where = spec.origin if spec.origin not in (None, "namespace") else next(
                iter(spec.submodule_search_locations or []), None)
            if where is None or os.path.commonpath([os.path.abspath(where), folder]) != folder:
                ok = False
                break
        _ADDS_ONLY[folder] = ok
    return _ADDS_ONLY[folder]


def _extra_path(env: dict[str, str], cwd: str) -> list[str] | None:
    """The folders `env`'s PYTHONPATH adds to this process's own (the zygotes'), or None when one of them may
    shadow a module (then the request's PYTHONPATH is part of its import-time key)."""
    base = _path_entries(os.environ.get(PYTHONPATH), cwd)
    extra = [p for p in _path_entries(env.get(PYTHONPATH), cwd) if p not in base and p != cwd]
    return extra if all(_adds_only(p) for p in extra) else None


def zygote_env(env: dict[str, str], cwd: str) -> dict[str, str]:
    """The environment of a zygote that serves a request with `env` from `cwd`: `env` less the variables read
    at run time, with this process's PYTHONPATH where the request's only adds modules to it."""
    env = {k: v for k, v in env.items() if k not in RUN_TIME_VARS and SET_ON_IMPORT.get(k) != v}
    if INDUCTOR_CACHE in env and env[INDUCTOR_CACHE] == _default_inductor_cache():
        del env[INDUCTOR_CACHE]  # what an unset variable means
    if env.get(PYTHONPATH) != os.environ.get(PYTHONPATH) and _extra_path(env, cwd) is not None:
        env.pop(PYTHONPATH, None)
        if os.environ.get(PYTHONPATH) is not None:
            env[PYTHONPATH] = os.environ[PYTHONPATH]
    return env


# ----------------------------------------------------------------------------------------------- zygote


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        part = conn.recv(n - len(data))
        if not part:
            raise ConnectionError("client went away")
        data += part
    return bytes(data)


def _probe_fork_is_safe() -> bool:
    """A child of this process computes with torch's thread pool; a zygote whose imports started an
    OpenMP region would hang it (then the zygote refuses to serve)."""
    pid = os.fork()
    if pid == 0:
        import torch

        torch.set_num_threads(2)
        x = torch.ones(256, 256)
        os._exit(0 if float((x @ x).sum()) == 256.0 ** 3 else 1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status) == 0
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return False


def _serve(path: str) -> tuple[dict[str, Any], list[int]]:
    """Serve fork requests until killed; returns only in a forked child, with its request and fds."""
    sys.path[0] = str(REPO)  # resolve the package as `python -m` from the checkout does
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    if not _probe_fork_is_safe():
        print("forkserver: a forked child could not compute after the preload: not serving", file=sys.stderr)
        sys.exit(3)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    os.replace(path + ".tmp", path)  # the socket appears when the zygote is ready
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    waiting: dict[int, socket.socket] = {}
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select(timeout=1.0):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                try:
                    header, fds, _, _ = socket.recv_fds(conn, 4, 8)
                    if len(header) < 4:
                        header += _recv_exactly(conn, 4 - len(header))
                    request = json.loads(_recv_exactly(conn, struct.unpack("!I", header)[0]))
                except (ConnectionError, OSError, ValueError):
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    selector.close()
                    listener.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    for other in waiting.values():
                        other.close()
                    conn.close()
                    return request, fds
                for fd in fds:
                    os.close(fd)
                try:
                    conn.sendall(f"pid {pid}\n".encode())
                    waiting[pid] = conn
                except OSError:
                    conn.close()
            else:
                try:
                    os.read(wake_r, 4096)
                except BlockingIOError:
                    pass
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"status {status}\n".encode())
                except OSError:
                    pass
                conn.close()


def _become(request: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: the process `python -m memfit_gpu.cli ARGV` would be, up to its imports."""
    for target, fd in enumerate(fds[:3]):
        if fd != target:
            os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    if request["new_session"]:
        os.setsid()
    os.chdir(request["cwd"])
    zygote_path = os.environ.get(PYTHONPATH)
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["-m", *request["argv"]]
    sys.path[0] = os.getcwd()  # what `python -m` puts first
    if os.environ.get(PYTHONPATH) != zygote_path:  # folders that only add modules (zygote_key), where
        base = _path_entries(zygote_path, os.getcwd())  # a fresh interpreter puts them: right after the first
        sys.path[1:1] = [p for p in _path_entries(os.environ.get(PYTHONPATH), os.getcwd())
                         if p not in base and p != sys.path[0]]


def _zygote_main() -> None:
    request, fds = _serve(sys.argv[1])
    _become(request, fds)
    del request, fds
    import runpy

    # exactly what `python -m memfit_gpu.cli` runs: __main__ is memfit_gpu/cli/__main__.py (so spawned
    # multiprocessing children do not re-run it), SystemExit and uncaught exceptions end the process
    runpy._run_module_as_main(CLI_MODULE)  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------------------------- client


class _Zygote:
    def __init__(self, env: dict[str, str], workdir: Path) -> None:
        self.socket_path = tempfile.mktemp(prefix="zygote-", suffix=".sock", dir=workdir)
        self.log_path = self.socket_path.replace(".sock", ".log")
        with open(self.log_path, "wb") as log:
            self.process = _ORIGINAL_POPEN([sys.executable, __file__, self.socket_path], env=env, cwd=REPO,
                                           stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)

    def ready(self) -> bool:
        """Waits until the zygote serves (True) or has given up (False)."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not os.path.exists(self.socket_path):
            if self.process.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for path in (self.socket_path,):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


class _Pool:
    """Zygotes by import-time environment, two per environment taken in turn."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.zygotes: dict[tuple[tuple[str, str], ...], list[_Zygote]] = {}
        self.seen: dict[tuple[tuple[str, str], ...], int] = {}
        self.turn = 0
        self.workdir = Path(tempfile.mkdtemp(prefix="memfit-forkserver-"))
        self.default_key = import_time_env(zygote_env(dict(os.environ), os.getcwd()))

    def zygote_for(self, env: dict[str, str], cwd: str) -> _Zygote | None:
        env = zygote_env(env, cwd)
        key = import_time_env(env)
        with self.lock:
            self.seen[key] = self.seen.get(key, 0) + 1
            # another environment's first process runs as a fresh interpreter; its second starts the zygotes
            if key != self.default_key and self.seen[key] == 1:
                return None
            pair = self.zygotes.get(key)
            if pair is None:
                pair = self.zygotes[key] = [_Zygote(env, self.workdir), _Zygote(env, self.workdir)]
            self.turn += 1
            zygote = pair[self.turn % 2]
        if zygote.ready():
            return zygote
        other = pair[(self.turn + 1) % 2]
        return other if other.ready() else None

    def usage(self) -> list[dict[str, Any]]:
        """Per environment: the processes asked for, whether its zygotes started, and the import-time
        variables in which it differs from the test process's own environment (names only)."""
        default = dict(self.default_key)
        with self.lock:
            return [{"processes": n, "zygotes": key in self.zygotes,
                     "differs_in": sorted({k for k, v in key if default.get(k) != v} | (set(default) - dict(key).keys()))}
                    for key, n in self.seen.items()]

    def stop(self) -> None:
        with self.lock:
            for pair in self.zygotes.values():
                for zygote in pair:
                    zygote.stop()
            self.zygotes.clear()
        if not os.environ.get("MEMFIT_TEST_FORKSERVER_KEEP"):  # debugging: keep the zygotes' logs
            shutil.rmtree(self.workdir, ignore_errors=True)


_ORIGINAL_POPEN = subprocess.Popen
_pool: _Pool | None = None
_suspended = False  # set while a fresh_interpreter test runs (all its threads)


def _routable(args: Any, executable: Any, shell: bool, preexec_fn: Any, pass_fds: Any, extra: tuple[Any, ...]) -> bool:
    if _pool is None or _suspended or shell or preexec_fn is not None or pass_fds:
        return False
    if executable is not None or any(value not in (None, -1, False, True) for value in extra):
        return False
    if not isinstance(args, (list, tuple)) or len(args) < 3:
        return False
    return os.fspath(args[0]) == sys.executable and list(args[1:3]) == ["-m", CLI_MODULE]


class ForkServerPopen(_ORIGINAL_POPEN):  # type: ignore[misc, valid-type]
    """subprocess.Popen whose `python -m memfit_gpu.cli` children are forks of a zygote."""

    _via_zygote = False

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, gid, gids, uid, umask, start_new_session, *rest):
        zygote = None
        if _routable(args, executable, shell, preexec_fn, pass_fds, (gid, gids, uid, umask, *rest)):
            zygote = _pool.zygote_for(dict(os.environ if env is None else env),  # type: ignore[union-attr]
                                      os.fspath(cwd) if cwd is not None else os.getcwd())
        if zygote is None:
            return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                                          creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread,
                                          errwrite, restore_signals, gid, gids, uid, umask, start_new_session, *rest)
        request = {"argv": [os.fspath(a) for a in args[3:]],
                   "env": {os.fsdecode(k): os.fsdecode(v) for k, v in (os.environ if env is None else env).items()},
                   "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(), "new_session": bool(start_new_session)}
        payload = json.dumps(request).encode()
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1, errwrite if errwrite != -1 else 2]
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(zygote.socket_path)
            socket.send_fds(conn, [struct.pack("!I", len(payload))], fds)
            conn.sendall(payload)
            self._zygote_buffer = b""
            self._zygote_conn = conn
            line = self._zygote_line(block=True)
            if line is None or not line.startswith("pid "):
                raise OSError(errno.ECHILD, f"fork server {zygote.socket_path} did not start the process "
                                            f"(its log: {zygote.log_path})")
            self.pid = int(line.split()[1])
        except BaseException:
            conn.close()
            raise
        self._via_zygote = True
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    def _zygote_line(self, block: bool) -> str | None:
        """The next line from the zygote, None if none yet (non-blocking) or the connection ended."""
        while b"\n" not in self._zygote_buffer:
            self._zygote_conn.setblocking(block)
            try:
                part = self._zygote_conn.recv(256)
            except BlockingIOError:
                return None
            if not part:
                return None
            self._zygote_buffer += part
        line, self._zygote_buffer = self._zygote_buffer.split(b"\n", 1)
        return line.decode()

    def _try_wait(self, wait_flags):
        if not self._via_zygote:
            return super()._try_wait(wait_flags)
        line = self._zygote_line(block=not wait_flags & os.WNOHANG)
        if line is None:
            if wait_flags & os.WNOHANG and self._zygote_conn.fileno() != -1:
                try:
                    self._zygote_conn.setblocking(False)
                    if self._zygote_conn.recv(1, socket.MSG_PEEK) != b"":
                        # the status arrived since the read above: the next poll reads it (treating this
                        # as a closed connection lost a run's exit code, 255, under load)
                        return (0, 0)
                    raise ConnectionError
                except BlockingIOError:
                    return (0, 0)
                except (ConnectionError, OSError):
                    pass
            # the zygote died before reaping the child: no status to be had
            sys.stderr.write(f"forkserver: lost the exit status of pid {self.pid}\n")
            return (self.pid, 255 << 8)
        self._zygote_conn.close()
        return (self.pid, int(line.split()[1]))

    def _internal_poll(self, _deadstate=None, _waitpid=os.waitpid, _WNOHANG=os.WNOHANG, _ECHILD=errno.ECHILD):
        if not self._via_zygote:
            return super()._internal_poll(_deadstate, _waitpid, _WNOHANG, _ECHILD)
        if self.returncode is None:
            if not self._waitpid_lock.acquire(False):
                return None
            try:
                if self.returncode is not None:
                    return self.returncode
                pid, status = self._try_wait(_WNOHANG)
                if pid == self.pid:
                    self._handle_exitstatus(status)
            finally:
                self._waitpid_lock.release()
        return self.returncode


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "1") != "0" and sys.platform.startswith("linux")


def install() -> None:
    """Route this process's `python -m memfit_gpu.cli` children through zygotes (idempotent)."""
    global _pool
    if _pool is None:
        try:  # OpenCV's import appends its lib64 to LD_LIBRARY_PATH: before the zygotes take os.environ
            import cv2  # noqa: F401
        except ImportError:
            pass
        _pool = _Pool()
        subprocess.Popen = ForkServerPopen  # type: ignore[misc]


def usage() -> list[dict[str, Any]]:
    """What the zygotes served in this process so far (`_Pool.usage`); [] when not installed."""
    return _pool.usage() if _pool is not None else []


def uninstall() -> None:
    global _pool
    subprocess.Popen = _ORIGINAL_POPEN  # type: ignore[misc]
    if _pool is not None:
        _pool.stop()
        _pool = None


class fresh_interpreters:
    """Context manager: processes started inside it (by any thread) are fresh interpreters."""

    def __enter__(self) -> None:
        global _suspended
        _suspended = True

    def __exit__(self, *exc: object) -> None:
        global _suspended
        _suspended = False


if __name__ == "__main__":
    _zygote_main()
