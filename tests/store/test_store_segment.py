"""TextTiling segmentation: exact cuts on a controlled three-topic conversation, batched == reference."""

from __future__ import annotations

import numpy as np
import pytest

from memfit_gpu.config import SegmentConfig, SummaryConfig
from memfit_gpu.store.segment import segment_batch, segment_reference, summary_segments, window_size


def _three_topics(rng: np.random.Generator, sizes=(12, 12, 12), dim=32, noise=0.05) -> np.ndarray:
    topics = np.linalg.qr(rng.standard_normal((dim, 3)))[0].T  # three orthonormal topic directions
    rows = [topics[t] + noise * rng.standard_normal(dim) for t, size in enumerate(sizes) for _ in range(size)]
    emb = np.array(rows, dtype=np.float32)
    return emb / np.linalg.norm(emb, axis=1, keepdims=True)


def test_window_rule():
    cfg = SegmentConfig()
    assert [window_size(n, cfg) for n in (1, 36, 48, 49, 64, 81, 100, 400)] == [3, 3, 3, 4, 4, 4, 5, 10]


def test_two_topic_shifts_give_exactly_those_two_cuts():
    emb = _three_topics(np.random.default_rng(0))
    assert segment_reference(emb) == [(0, 12), (12, 24), (24, 36)]
    assert segment_batch([emb]) == [[(0, 12), (12, 24), (24, 36)]]
    uneven = _three_topics(np.random.default_rng(1), sizes=(15, 9, 20))
    assert segment_batch([uneven])[0] == [(0, 15), (15, 24), (24, 44)]


def test_short_memories_are_one_segment():
    rng = np.random.default_rng(2)
    emb = _three_topics(rng, sizes=(4, 4, 3))  # n = 11 < 4 * 3
    assert segment_batch([emb, emb[:1], emb[:0]]) == [[(0, 11)], [(0, 1)], []]
    assert segment_reference(emb) == [(0, 11)]


def test_hand_computed_depths_on_a_plateau():
    # One-hot rows, w = 3, n = 12: gaps 3..9. Topic A for 6 rows then B: only gap 6 is a full shift.
    emb = np.zeros((12, 2), np.float32)
    emb[:6, 0] = 1
    emb[6:, 1] = 1
    # scores at gaps 3..9: 1, 2/sqrt(5), 1/sqrt(5), 0, 1/sqrt(5), 2/sqrt(5), 1 -> depth 2 at gap 6 only
    assert segment_reference(emb) == [(0, 6), (6, 12)]
    assert segment_batch([emb]) == [[(0, 6), (6, 12)]]


@pytest.mark.parametrize("seed", range(6))
def test_batched_equals_reference_on_random_and_tied_memories(seed):
    rng = np.random.default_rng(seed)
    memories = []
    for _ in range(25):
        n = int(rng.integers(0, 140))
        if rng.random() < 0.5:  # small integer vectors: exact sums, many equal scores and depth plateaus
            memories.append(rng.integers(0, 2, size=(n, 4)).astype(np.float32))
        else:
            memories.append(rng.standard_normal((n, 4)).astype(np.float32))
    expected = [segment_reference(e) for e in memories]
    assert segment_batch(memories) == expected
    for e, segments in zip(memories, expected, strict=True):
        assert sum(end - start for start, end in segments) == len(e)


def test_summary_segments_keeps_largest_with_earlier_on_ties():
    cfg = SummaryConfig(max_summaries=3, min_segment=3)
    segments = [(0, 2), (2, 6), (6, 10), (10, 15), (15, 19), (19, 21), (21, 26)]
    # sizes 2, 4, 4, 5, 4, 2, 5: eligible >= 3; largest three = (10,15), (21,26), then the earlier 4 = (2,6)
    assert summary_segments(segments, cfg) == [(2, 6), (10, 15), (21, 26)]
    assert summary_segments([(0, 2)], cfg) == []


COOKING = [
    "I boiled the spaghetti for nine minutes in salted water.",
    "The tomato sauce needs garlic, basil and a splash of olive oil.",
    "Grate some parmesan cheese over the pasta before serving.",
    "My grandmother's lasagna recipe uses three layers of béchamel.",
    "Fresh egg noodles cook much faster than dried ones.",
    "Stir the risotto slowly and add the broth one ladle at a time.",
    "I burned the onions while making the carbonara sauce.",
    "Homemade ravioli filled with ricotta and spinach is my favourite dinner.",
    "Season the pasta water generously with salt.",
    "We baked garlic bread to go with the spaghetti.",
]
CARS = [
    "The mechanic said my car's brake pads are worn out.",
    "I changed the engine oil and the oil filter this weekend.",
    "The tyre pressure warning light came on during the drive.",
    "My old sedan needs a new battery because it will not start.",
    "The garage replaced the timing belt on the engine.",
    "I rotated the tyres and checked the wheel alignment.",
    "The transmission makes a grinding noise when I shift gears.",
    "We took the truck in for its annual safety inspection.",
    "The radiator was leaking coolant onto the driveway.",
    "The mechanic recommended new spark plugs for the engine.",
]
ASTRONOMY = [
    "Through the telescope we could see the rings of Saturn.",
    "Jupiter's largest moons are visible with good binoculars.",
    "The Andromeda galaxy is the nearest large galaxy to the Milky Way.",
    "A meteor shower lit up the night sky over the desert.",
    "Astronomers discovered a new exoplanet orbiting a red dwarf star.",
    "The full moon made it hard to see faint stars and nebulae.",
    "A total solar eclipse darkened the sky for three minutes.",
    "The Orion nebula is a nursery where new stars are born.",
    "We photographed the Milky Way from a dark observatory site.",
    "Mars appears reddish because of iron oxide dust on the planet.",
]


@pytest.mark.slow
def test_real_minilm_embeddings_of_three_topics_cut_at_the_two_shifts(bi_encoder):
    embeddings = bi_encoder.encode(COOKING + CARS + ASTRONOMY)
    assert segment_batch([embeddings]) == [[(0, 10), (10, 20), (20, 30)]]
    assert segment_reference(embeddings) == [(0, 10), (10, 20), (20, 30)]
