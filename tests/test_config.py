from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from memfit_gpu.config import _RANGES, ConfigError, MemFitConfig, load_config, to_yaml

REPO = Path(__file__).resolve().parents[1]


def test_paper_config_is_exactly_the_spec_defaults():
    cfg = load_config(REPO / "configs" / "memfit.yaml")
    assert cfg == MemFitConfig()
    # spot-check SPEC values by name
    assert (cfg.retrieve.scan_top_k, cfg.retrieve.alpha, cfg.retrieve.pool_size) == (60, 0.7, 50)
    assert (cfg.retrieve.boosts.speaker, cfg.retrieve.boosts.month, cfg.retrieve.boosts.year) == (0.10, 0.08, 0.05)
    assert (cfg.retrieve.prf.docs, cfg.retrieve.prf.terms, cfg.retrieve.prf.term_order) == (2, 12, "idf")
    assert (cfg.rerank.rerank_pool, cfg.rerank.max_length, cfg.pack.k, cfg.pack.context_window) == (80, 384, 10, 1)
    assert (cfg.index.bm25_k1, cfg.index.bm25_b) == (1.5, 0.75)
    assert (cfg.summary.max_excerpts, cfg.summary.excerpt_chars, cfg.summary.max_summaries) == (14, 220, 60)


def test_dotlist_overrides_are_typed():
    cfg = load_config(REPO / "configs" / "memfit.yaml", ["retrieve.scan_top_k=30", "rerank.backend=none", "pack.k=5"])
    assert cfg.retrieve.scan_top_k == 30 and cfg.rerank.backend == "none" and cfg.pack.k == 5


@pytest.mark.parametrize(
    "override, needle",
    [
        ("retrieve.scan_topk=30", "retrieve.scan_topk"),
        ("nosuchstage.x=1", "nosuchstage"),
        ("pack.k=ten", "pack.k"),
        ("retrieve.prf.term_order=random", "retrieve.prf.term_order"),
        ("rerank.backend=bi-encoder", "rerank.backend"),
        ("pack.k", "key=value"),
        ("retrieve.boosts.speaker_match=name", "retrieve.boosts.speaker_match"),
        ("boosts.speaker_match=mention", "did you mean retrieve.boosts.speaker_match?"),
    ],
)
def test_bad_override_names_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(REPO / "configs" / "memfit.yaml", [override])


def test_unknown_key_in_yaml_names_file_and_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("retrieve:\n  scan_top: 10\n")
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    assert "bad.yaml" in str(err.value) and "retrieve.scan_top" in str(err.value)


@pytest.mark.parametrize(("content", "message"), [
    (b"- a\n", "bad.yaml: a config is a mapping of keys (reader:, pack:, ...), not a list"),
    (b"defaults: 3\n", "bad.yaml: defaults must name one base file (e.g. defaults: memfit.yaml), not 3"),
    (b"defaults: bad.yaml\n", "bad.yaml: defaults: bad.yaml leads back to a file already read (bad.yaml -> bad.yaml)"),
    (b"defaults: .\n", "bad.yaml: defaults points at ., which is not a file"),
    (b"\xff\n", "bad.yaml: not UTF-8 text (byte 0): a config is a YAML file"),
])
def test_a_config_file_of_the_wrong_shape_is_one_error_naming_it(tmp_path, content, message):
    """A list, a `defaults:` that is no file name or leads back to itself, and bytes that are not UTF-8 were
    tracebacks (TypeError, RecursionError, UnicodeDecodeError)."""
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(content)
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    assert message in str(err.value)
    with pytest.raises(ConfigError, match="a folder, not a config file"):
        load_config(tmp_path)


def test_an_override_that_is_not_yaml_is_one_error():
    with pytest.raises(ConfigError, match=r"overrides \['eval.metrics=\[f1'\]: a value is not valid YAML"):
        load_config(REPO / "configs" / "memfit.yaml", ["eval.metrics=[f1"])


def test_a_retired_key_in_a_saved_config_is_dropped_with_a_pointer(tmp_path, caplog):
    """Run directories started before the top-level `seed` (read by nothing) was retired keep resuming: the
    key is dropped with a warning saying where seeds live; as an override it is unknown, with the hint."""
    old = tmp_path / "config.yaml"
    old.write_text(to_yaml(MemFitConfig()) + "seed: 0\n")
    assert "seed: 0" in old.read_text().splitlines()
    with caplog.at_level("WARNING", logger="memfit_gpu.config"):
        assert load_config(old) == MemFitConfig()
    assert f"{old}: ignoring retired key 'seed': see reader.seed (sampling) and eval.seed" in caplog.text
    with pytest.raises(ConfigError, match=r"did you mean (reader|eval)\.seed"):
        load_config(None, ["seed=3"])


def test_defaults_key_composes_on_a_base_file(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("pack:\n  k: 7\nretrieve:\n  alpha: 0.5\n")
    child = tmp_path / "child.yaml"
    child.write_text("defaults: base.yaml\npack:\n  k: 3\n")
    cfg = load_config(child)
    assert cfg.pack.k == 3 and cfg.retrieve.alpha == 0.5
    missing = tmp_path / "orphan.yaml"
    missing.write_text("defaults: nowhere.yaml\n")
    with pytest.raises(ConfigError, match="nowhere.yaml"):
        load_config(missing)


def test_a_key_written_twice_in_a_config_file_is_refused_naming_it_and_its_lines(tmp_path):
    """A section written twice (two `reader:` blocks) loaded the second alone: the first block's settings were
    dropped without a word (yaml.safe_load keeps the last value of a repeated key)."""
    twice = tmp_path / "twice.yaml"
    twice.write_text("reader:\n  temperature: 0.5\npack:\n  k: 3\nreader:\n  max_new_tokens: 8\n")
    with pytest.raises(ConfigError) as err:
        load_config(twice)
    assert str(err.value) == (f"{twice}: key 'reader' is written twice in one mapping (lines 1 and 5): YAML would keep "
                              "the second and drop the first silently; write it once")
    nested = tmp_path / "nested.yaml"
    nested.write_text("pack:\n  k: 3\n  k: 4\n")
    with pytest.raises(ConfigError, match=r"nested.yaml: key 'k' is written twice in one mapping \(lines 2 and 3\)"):
        load_config(nested)
    # a merge key brings keys the mapping may override: no key is written twice there
    merged = tmp_path / "merged.yaml"
    merged.write_text("pack:\n  <<: {k: 3, context_window: 2}\n  k: 4\n")
    cfg = load_config(merged)
    assert (cfg.pack.k, cfg.pack.context_window) == (4, 2)


def test_yaml_round_trip(tmp_path):
    cfg = load_config(None, ["pack.k=20", "reader.base_urls=[http://a,http://b]"])
    out = tmp_path / "resolved.yaml"
    out.write_text(to_yaml(cfg))
    assert load_config(out) == cfg


@pytest.mark.parametrize(
    "override, message",
    [
        # values that each crashed late or ran with silently different retrieval
        ("pack.k=-1", "pack.k=-1 is out of range: it must be >= 1"),
        ("retrieve.alpha=1.5", "retrieve.alpha=1.5 is out of range: it must be in [0, 1]"),
        ("retrieve.scan_top_k=0", "retrieve.scan_top_k=0 is out of range: it must be >= 1"),
        ("retrieve.prf.docs=-1", "retrieve.prf.docs=-1 is out of range: it must be >= 1"),
        ("rerank.rerank_pool=-1", "rerank.rerank_pool=-1 is out of range: it must be >= 1"),
        ("data.limit_questions=-1", "data.limit_questions=-1 is out of range: it must be >= 1 or null"),
        ("data.limit_memories=0", "data.limit_memories=0 is out of range: it must be >= 1 or null"),
        ("pack.context_window=-1", "pack.context_window=-1 is out of range: it must be >= 0"),
        ("pack.max_excerpt_chars=0", "pack.max_excerpt_chars=0 is out of range: it must be >= 1"),
        ("reader.max_prompt_chars=0", "reader.max_prompt_chars=0 is out of range: it must be >= 1"),
        ("retrieve.boosts.speaker=-0.1", "retrieve.boosts.speaker=-0.1 is out of range: it must be >= 0"),
        ("retrieve.dense_min_cosine=2", "retrieve.dense_min_cosine=2.0 is out of range: it must be in [-1, 1]"),
        ("index.bm25_b=1.01", "index.bm25_b=1.01 is out of range: it must be in [0, 1]"),
        ("reader.timeout_s=0", "reader.timeout_s=0.0 is out of range: it must be > 0"),
        ("reader.gpu_memory_utilization=0", "reader.gpu_memory_utilization=0.0 is out of range: it must be in (0, 1]"),
        ("reader.batch_size=0", "reader.batch_size=0 is out of range: it must be >= 1"),
        ("retrieve.question_batch_size=0", "retrieve.question_batch_size=0 is out of range: it must be >= 1"),
        ("retrieve.alpha=nan", "retrieve.alpha=nan is out of range: it must be in [0, 1]"),
        ("retrieve.prf.weight=inf", "retrieve.prf.weight=inf is out of range: it must be >= 0"),
        ("segment.depth_std_factor=-inf", "segment.depth_std_factor=-inf is out of range: it must be a finite number"),
        ("eval.bootstrap_samples=0", "eval.bootstrap_samples=0 is out of range: it must be >= 1"),
        # choices
        ("data.benchmark=nope", "data.benchmark='nope' is not one of locomo, longmemeval, memgallery"),
        ("data.split=x", "data.split='x' is not one of null, s, m, oracle"),
        ("reader.protocol=official", "reader.protocol='official' is not one of auto, paper, memgallery"),
        ("eval.judge.prompt=strict", "eval.judge.prompt='strict' is not one of auto, paper, memgallery, longmemeval"),
        ("eval.metrics=[paper,bleu]", "eval.metrics[1]='bleu' is not one of paper, locomo, memgallery"),
        # settings wrong together
        ("reader.backend=openai", "reader.backend=openai needs reader.base_urls"),
        ("reader.base_urls=[127.0.0.1:8000/v1]", "reader.base_urls[0]='127.0.0.1:8000/v1' is not an http:// or https:// URL"),
        ("rerank.summary_suffix=' (as of {day})'", "rerank.summary_suffix=' (as of {day})' is not a format string"),
    ],
)
def test_bad_values_are_refused_naming_key_value_and_range(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs" / "smoke.yaml", [override])
    # one line: the file and overrides, then the key, the value and what is allowed
    assert str(err.value).startswith(f"{REPO / 'configs' / 'smoke.yaml'} + overrides {[override]!r}: {message}")
    assert "\n" not in str(err.value)


def test_edge_values_are_accepted():
    cfg = load_config(None, ["retrieve.alpha=0", "retrieve.alpha=1", "pack.k=1", "pack.context_window=0",
                             "data.limit_questions=null", "data.limit_memories=1", "reader.gpu_memory_utilization=1",
                             "retrieve.dense_min_cosine=-1", "data.split=oracle"])
    assert (cfg.retrieve.alpha, cfg.pack.k, cfg.data.limit_questions, cfg.data.split) == (1.0, 1, None, "oracle")


def test_judge_on_openai_needs_a_url():
    with pytest.raises(ConfigError, match=r"eval\.judge\.backend=openai needs eval\.judge\.base_urls"):
        load_config(None, ["eval.judge.enabled=true", "eval.judge.backend=openai"])
    # off, or with the reader's URLs to fall back on, it is fine
    load_config(None, ["eval.judge.backend=openai"])
    load_config(None, ["eval.judge.enabled=true", "eval.judge.backend=openai", "reader.base_urls=[http://a:1/v1]"])


def test_every_shipped_config_passes_the_checks():
    for path in sorted((REPO / "configs").rglob("*.yaml")):
        if path.parent.name != "sweeps" and path.name != "prices.yaml":
            load_config(path)


def test_every_numeric_key_has_a_range():
    """A numeric setting added later without a range would be taken unchecked."""

    def numeric_keys(cls: type, prefix: str = "") -> list[str]:
        keys = []
        for name, hint in typing.get_type_hints(cls).items():
            if dataclasses.is_dataclass(hint):
                keys += numeric_keys(hint, f"{prefix}{name}.")
            elif hint in (int, float, int | None, float | None):
                keys.append(prefix + name)
        return keys

    numeric = numeric_keys(MemFitConfig)
    assert "data.limit_questions" in numeric and "retrieve.prf.docs" in numeric
    assert sorted(numeric) == sorted(_RANGES)
