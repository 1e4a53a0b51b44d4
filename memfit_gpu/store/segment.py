"""TextTiling over episode embeddings (SPEC write path 3), vectorised over many memories.

For a memory of n episodes (embeddings in conversation order):
  w = max(min_window, round(sqrt(n) * window_scale))   (Python/numpy round: halves go to even)
  n < short_factor * w: the whole memory is one segment.
  Gap i (the boundary before episode i, w <= i <= n - w) scores
      s_i = cosine(mean(E[i-w:i]), mean(E[i:i+w])).
  Depth at a gap = (left peak - s) + (right peak - s), where the peak is found by climbing
  (TextTiling's peak search): from the gap, step to the neighbouring gap while its score is >= the
  current one (plateaus are crossed), stop at the first strictly lower score; the peak is the last
  score reached. So the left peak of gap j is s[L] with L the largest l <= j where the climb breaks
  (l is the first gap, or s[l-1] < s[l]); the right peak mirrors it.
  A gap is a local maximum of depth when depth[j] > depth[j-1] (or j is the first gap) and
  depth[j] >= depth[j+1] (or j is the last gap): a plateau of equal depths cuts once, at its start.
  Cut at local maxima with depth > mean(depth) + depth_std_factor * std(depth) (population std,
  over the memory's gaps).

`segment_batch` does this for many memories at once on padded tensors (no Python loop over gaps);
`segment_reference` is the plain per-memory loop it is tested against.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from memfit_gpu.config import SegmentConfig, SummaryConfig

# Memories are padded to the longest one in a chunk; bound a chunk's padded rows to bound memory.
_CHUNK_ROWS = 1 << 20


def window_size(n: int, cfg: SegmentConfig) -> int:
    return max(cfg.min_window, int(round(math.sqrt(n) * cfg.window_scale)))


def _boundaries_to_segments(n: int, cuts: Sequence[int]) -> list[tuple[int, int]]:
    edges = [0, *sorted(int(c) for c in cuts), n]
    return [(edges[i], edges[i + 1]) for i in range(len(edges) - 1) if edges[i + 1] > edges[i]]


def segment_reference(embeddings: np.ndarray | torch.Tensor, cfg: SegmentConfig | None = None) -> list[tuple[int, int]]:
    """One memory, plain loops in float64: segments as [start, end) episode positions."""
    cfg = cfg or SegmentConfig()
    emb = np.asarray(embeddings.cpu() if isinstance(embeddings, torch.Tensor) else embeddings, dtype=np.float64)
    n = len(emb)
    if n == 0:
        return []
    w = window_size(n, cfg)
    if n < cfg.short_factor * w:
        return [(0, n)]
    gaps = list(range(w, n - w + 1))
    scores = []
    for i in gaps:
        # cosine(mean, mean) = cosine(sum, sum): sums keep integer-valued test vectors exact
        left, right = emb[i - w : i].sum(axis=0), emb[i : i + w].sum(axis=0)
        denominator = np.linalg.norm(left) * np.linalg.norm(right)
        scores.append(float(left @ right / denominator) if denominator > 0 else 0.0)
    depths = []
    for j, score in enumerate(scores):
        peak_left = score
        position = j
        while position > 0 and scores[position - 1] >= peak_left:
            position -= 1
            peak_left = scores[position]
        peak_right = score
        position = j
        while position < len(scores) - 1 and scores[position + 1] >= peak_right:
            position += 1
            peak_right = scores[position]
        depths.append((peak_left - score) + (peak_right - score))
    depth = np.array(depths)
    threshold = depth.mean() + cfg.depth_std_factor * depth.std()
    cuts = []
    for j in range(len(depth)):
        rises = j == 0 or depth[j] > depth[j - 1]
        holds = j == len(depth) - 1 or depth[j] >= depth[j + 1]
        if rises and holds and depth[j] > threshold:
            cuts.append(gaps[j])
    return _boundaries_to_segments(n, cuts)


def _segment_chunk(embeddings: list[torch.Tensor], cfg: SegmentConfig) -> list[list[tuple[int, int]]]:
    """Segments of memories that all need tiling (n >= short_factor * w), as one padded computation."""
    device = embeddings[0].device
    lengths = torch.tensor([len(e) for e in embeddings], device=device)
    windows = torch.tensor([window_size(len(e), cfg) for e in embeddings], device=device)
    n_mem, n_max, dim = len(embeddings), int(lengths.max()), embeddings[0].shape[1]
    # prefix[m, i] = sum of the first i embeddings: window sums are differences, and cosine of means =
    # cosine of sums. float64 keeps the prefix differences as exact as the reference's direct means.
    prefix = torch.zeros((n_mem, n_max + 1, dim), dtype=torch.float64, device=device)
    for m, emb in enumerate(embeddings):
        prefix[m, 1 : len(emb) + 1] = torch.cumsum(emb.to(torch.float64), dim=0)
    gap_counts = lengths - 2 * windows + 1  # gaps i = w .. n - w
    g_max = int(gap_counts.max())
    j = torch.arange(g_max, device=device)
    valid = j[None, :] < gap_counts[:, None]  # [M, G]
    i = (j[None, :] + windows[:, None]).clamp(max=n_max)  # gap position per memory
    left_start = (i - windows[:, None]).clamp(min=0)
    right_end = (i + windows[:, None]).clamp(max=n_max)

    def at(positions: torch.Tensor) -> torch.Tensor:
        return torch.gather(prefix, 1, positions[:, :, None].expand(-1, -1, dim))

    left = at(i) - at(left_start)
    right = at(right_end) - at(i)
    denominator = left.norm(dim=2) * right.norm(dim=2)
    scores = torch.where(denominator > 0, (left * right).sum(dim=2) / denominator.clamp(min=1e-300), 0.0)
    scores = torch.where(valid, scores, 0.0)

    # Left climb breaks at gap l when l == 0 or s[l-1] < s[l]; the peak is s at the last break <= j.
    positions = j[None, :].expand(n_mem, -1)
    previous = torch.cat([scores[:, :1], scores[:, :-1]], dim=1)
    left_break = (positions == 0) | (previous < scores)
    left_peak_at = torch.cummax(torch.where(left_break, positions, torch.zeros_like(positions)), dim=1).values
    # Right climb breaks at gap r when r is the memory's last gap or s[r+1] < s[r] (padding always breaks).
    following = torch.cat([scores[:, 1:], scores[:, -1:]], dim=1)
    right_break = (positions >= gap_counts[:, None] - 1) | (following < scores)
    flipped = torch.where(right_break, g_max - 1 - positions, torch.zeros_like(positions)).flip(1)
    right_peak_at = (g_max - 1 - torch.cummax(flipped, dim=1).values).flip(1)
    depth = (torch.gather(scores, 1, left_peak_at) - scores) + (torch.gather(scores, 1, right_peak_at) - scores)
    depth = torch.where(valid, depth, 0.0)

    counts = gap_counts.to(torch.float64)
    mean = depth.sum(dim=1) / counts
    variance = (torch.where(valid, (depth - mean[:, None]) ** 2, 0.0)).sum(dim=1) / counts
    threshold = mean + cfg.depth_std_factor * variance.sqrt()
    before = torch.cat([torch.full_like(depth[:, :1], -math.inf), depth[:, :-1]], dim=1)
    after = torch.cat([depth[:, 1:], torch.full_like(depth[:, :1], -math.inf)], dim=1)
    after = torch.where(positions >= gap_counts[:, None] - 1, -math.inf, after)
    cut = valid & (depth > before) & (depth >= after) & (depth > threshold[:, None])

    out = []
    for m in range(n_mem):
        cut_positions = (torch.nonzero(cut[m]).flatten() + windows[m]).tolist()
        out.append(_boundaries_to_segments(int(lengths[m]), cut_positions))
    return out


def segment_batch(
    embeddings: Sequence[np.ndarray | torch.Tensor], cfg: SegmentConfig | None = None
) -> list[list[tuple[int, int]]]:
    """Segments ([start, end) positions) of each memory, given its embeddings in conversation order."""
    cfg = cfg or SegmentConfig()
    tensors = [
        (e if isinstance(e, torch.Tensor) else torch.from_numpy(np.asarray(e, dtype=np.float32))).detach()
        for e in embeddings
    ]
    results: list[list[tuple[int, int]] | None] = [None] * len(tensors)
    tiled = []
    for m, emb in enumerate(tensors):
        n = len(emb)
        if n == 0:
            results[m] = []
        elif n < cfg.short_factor * window_size(n, cfg):
            results[m] = [(0, n)]
        else:
            tiled.append(m)
    # Longest first, chunked so the padded block stays bounded.
    tiled.sort(key=lambda m: -len(tensors[m]))
    start = 0
    while start < len(tiled):
        n_max = len(tensors[tiled[start]])
        size = max(1, _CHUNK_ROWS // n_max)
        chunk = tiled[start : start + size]
        for m, segments in zip(chunk, _segment_chunk([tensors[m] for m in chunk], cfg), strict=True):
            results[m] = segments
        start += size
    return [r if r is not None else [] for r in results]


def summary_segments(segments: list[tuple[int, int]], cfg: SummaryConfig | None = None) -> list[tuple[int, int]]:
    """The segments that get a summary: >= min_segment episodes, at most max_summaries of the largest
    (equal sizes: the earlier wins), returned in conversation order."""
    cfg = cfg or SummaryConfig()
    eligible = [(start, end) for start, end in segments if end - start >= cfg.min_segment]
    ranked = sorted(range(len(eligible)), key=lambda i: (-(eligible[i][1] - eligible[i][0]), i))
    keep = sorted(ranked[: cfg.max_summaries])
    return [eligible[i] for i in keep]
