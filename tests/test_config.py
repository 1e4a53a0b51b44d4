from __future__ import annotations

from pathlib import Path

import pytest

from memfit_gpu.config import ConfigError, MemFitConfig, load_config, to_yaml

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


def test_yaml_round_trip(tmp_path):
    cfg = load_config(None, ["pack.k=20", "reader.base_urls=[http://a,http://b]"])
    out = tmp_path / "resolved.yaml"
    out.write_text(to_yaml(cfg))
    assert load_config(out) == cfg
