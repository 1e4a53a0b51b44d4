"""Triton kernel of `memfit_gpu.kernels.hybrid_topk` (imported on first launch, see _launch.py).

Every value is formed with the float64 operations of the torch path, in its order; the launch turns
off floating-point contraction so that no multiply-add is fused into one rounding.
"""

# no `from __future__ import annotations`: Triton < 3.4 reads a constexpr only from a real annotation

import triton
import triton.language as tl


@triton.jit
def hybrid_topk_kernel(
    b_score_ptr, b_row_ptr, d_score_ptr, d_row_ptr, param_ptr,
    speaker_bits_ptr, years_ptr, months_ptr, row_speaker_ptr, row_year_ptr, row_month_ptr,
    out_row_ptr, out_bm25_ptr, out_dense_ptr, out_fused_ptr, out_boost_ptr, out_score_ptr,
    KB, KD, n_years, n_months, k,
    KBP: tl.constexpr, KDP: tl.constexpr, BOOSTS: tl.constexpr, BY_ROW: tl.constexpr,
):
    q = tl.program_id(0).to(tl.int64)
    ib = tl.arange(0, KBP)
    jd = tl.arange(0, KDP)
    # A = the BM25 list, B = the dense list
    row_a = tl.load(b_row_ptr + q * KB + ib, mask=ib < KB, other=-1)
    raw_b_a = tl.load(b_score_ptr + q * KB + ib, mask=ib < KB, other=0.0).to(tl.float64)
    row_b = tl.load(d_row_ptr + q * KD + jd, mask=jd < KD, other=-1)
    raw_d_b = tl.load(d_score_ptr + q * KD + jd, mask=jd < KD, other=0.0).to(tl.float64)
    ok_a = row_a >= 0
    # the union: a dense hit already in the BM25 list lends it its cosine and leaves B
    same = (row_a[:, None] == row_b[None, :]) & ok_a[:, None] & (row_b >= 0)[None, :]
    raw_d_a = tl.sum(tl.where(same, raw_d_b[None, :], 0.0), axis=1)  # one real value and zeros: exact
    ok_b = (row_b >= 0) & (tl.max(same.to(tl.int32), axis=0) == 0)
    raw_b_b = tl.zeros([KDP], tl.float64)

    # min-max over the union, per signal: norm = (raw - min) / (max - min); a flat signal gives 1
    # where raw > 0, else 0 (retrieve.hybrid.minmax)
    inf = float("inf")
    lo = tl.minimum(tl.min(tl.where(ok_a, raw_b_a, inf), axis=0), tl.min(tl.where(ok_b, raw_b_b, inf), axis=0))
    hi = tl.maximum(tl.max(tl.where(ok_a, raw_b_a, -inf), axis=0), tl.max(tl.where(ok_b, raw_b_b, -inf), axis=0))
    flat = (hi - lo) <= 0
    span = tl.where(flat, 1.0, hi - lo)
    bn_a = tl.where(ok_a, tl.where(flat, tl.where(raw_b_a > 0, 1.0, 0.0), (raw_b_a - lo) / span), 0.0)
    bn_b = tl.where(ok_b, tl.where(flat, tl.where(raw_b_b > 0, 1.0, 0.0), (raw_b_b - lo) / span), 0.0)
    lo = tl.minimum(tl.min(tl.where(ok_a, raw_d_a, inf), axis=0), tl.min(tl.where(ok_b, raw_d_b, inf), axis=0))
    hi = tl.maximum(tl.max(tl.where(ok_a, raw_d_a, -inf), axis=0), tl.max(tl.where(ok_b, raw_d_b, -inf), axis=0))
    flat = (hi - lo) <= 0
    span = tl.where(flat, 1.0, hi - lo)
    dn_a = tl.where(ok_a, tl.where(flat, tl.where(raw_d_a > 0, 1.0, 0.0), (raw_d_a - lo) / span), 0.0)
    dn_b = tl.where(ok_b, tl.where(flat, tl.where(raw_d_b > 0, 1.0, 0.0), (raw_d_b - lo) / span), 0.0)

    alpha = tl.load(param_ptr)
    one_minus_alpha = tl.load(param_ptr + 1)
    fused_a = tl.where(ok_a, alpha * dn_a + one_minus_alpha * bn_a, 0.0)
    fused_b = tl.where(ok_b, alpha * dn_b + one_minus_alpha * bn_b, 0.0)

    boost_a = tl.zeros([KBP], tl.float64)
    boost_b = tl.zeros([KDP], tl.float64)
    if BOOSTS:
        # ((0 + speaker) + month) + year, each term the config's value or 0.0 (retrieve.boosts)
        speaker = tl.load(param_ptr + 2)
        month = tl.load(param_ptr + 3)
        year = tl.load(param_ptr + 4)
        bits = tl.load(speaker_bits_ptr + q)
        safe_a = tl.where(ok_a, row_a, 0)
        safe_b = tl.where(ok_b, row_b, 0)
        year_a = tl.load(row_year_ptr + safe_a, mask=ok_a, other=-2)
        year_b = tl.load(row_year_ptr + safe_b, mask=ok_b, other=-2)
        month_a = tl.load(row_month_ptr + safe_a, mask=ok_a, other=-2)
        month_b = tl.load(row_month_ptr + safe_b, mask=ok_b, other=-2)
        year_hits_a = tl.zeros([KBP], tl.int32)
        year_hits_b = tl.zeros([KDP], tl.int32)
        for j in range(n_years):
            wanted = tl.load(years_ptr + q * n_years + j)
            year_hits_a += (year_a == wanted).to(tl.int32)
            year_hits_b += (year_b == wanted).to(tl.int32)
        month_hits_a = tl.zeros([KBP], tl.int32)
        month_hits_b = tl.zeros([KDP], tl.int32)
        for j in range(n_months):
            wanted = tl.load(months_ptr + q * n_months + j)
            month_hits_a += (month_a == wanted).to(tl.int32)
            month_hits_b += (month_b == wanted).to(tl.int32)
        speaker_a = (tl.load(row_speaker_ptr + safe_a, mask=ok_a, other=0) & bits) != 0
        speaker_b = (tl.load(row_speaker_ptr + safe_b, mask=ok_b, other=0) & bits) != 0
        boost_a = boost_a + tl.where(speaker_a, speaker, 0.0)
        boost_a = boost_a + tl.where(month_hits_a > 0, month, 0.0)
        boost_a = boost_a + tl.where(year_hits_a > 0, year, 0.0)
        boost_b = boost_b + tl.where(speaker_b, speaker, 0.0)
        boost_b = boost_b + tl.where(month_hits_b > 0, month, 0.0)
        boost_b = boost_b + tl.where(year_hits_b > 0, year, 0.0)
        boost_a = tl.where(ok_a, boost_a, 0.0)
        boost_b = tl.where(ok_b, boost_b, 0.0)
        score_a = tl.where(ok_a, fused_a + boost_a, -inf)
        score_b = tl.where(ok_b, fused_b + boost_b, -inf)
    else:
        score_a = tl.where(ok_a, fused_a, -inf)
        score_b = tl.where(ok_b, fused_b, -inf)

    # Output slot = rank among the union: how many valid candidates come first (score desc, then
    # lower row; or row order). Rows are distinct, so the ranks are distinct.
    if BY_ROW:
        rank_a = tl.sum((ok_a[None, :] & (row_a[None, :] < row_a[:, None])).to(tl.int32), axis=1) + tl.sum(
            (ok_b[None, :] & (row_b[None, :] < row_a[:, None])).to(tl.int32), axis=1)
        rank_b = tl.sum((ok_a[None, :] & (row_a[None, :] < row_b[:, None])).to(tl.int32), axis=1) + tl.sum(
            (ok_b[None, :] & (row_b[None, :] < row_b[:, None])).to(tl.int32), axis=1)
    else:
        rank_a = tl.sum((ok_a[None, :] & ((score_a[None, :] > score_a[:, None]) | (
            (score_a[None, :] == score_a[:, None]) & (row_a[None, :] < row_a[:, None])))).to(tl.int32), axis=1)
        rank_a += tl.sum((ok_b[None, :] & ((score_b[None, :] > score_a[:, None]) | (
            (score_b[None, :] == score_a[:, None]) & (row_b[None, :] < row_a[:, None])))).to(tl.int32), axis=1)
        rank_b = tl.sum((ok_a[None, :] & ((score_a[None, :] > score_b[:, None]) | (
            (score_a[None, :] == score_b[:, None]) & (row_a[None, :] < row_b[:, None])))).to(tl.int32), axis=1)
        rank_b += tl.sum((ok_b[None, :] & ((score_b[None, :] > score_b[:, None]) | (
            (score_b[None, :] == score_b[:, None]) & (row_b[None, :] < row_b[:, None])))).to(tl.int32), axis=1)

    keep_a = ok_a & (rank_a < k)
    at_a = q * k + rank_a
    tl.store(out_row_ptr + at_a, row_a, mask=keep_a)
    tl.store(out_bm25_ptr + at_a, raw_b_a, mask=keep_a)
    tl.store(out_dense_ptr + at_a, raw_d_a, mask=keep_a)
    tl.store(out_fused_ptr + at_a, fused_a, mask=keep_a)
    tl.store(out_boost_ptr + at_a, boost_a, mask=keep_a)
    tl.store(out_score_ptr + at_a, score_a, mask=keep_a)
    keep_b = ok_b & (rank_b < k)
    at_b = q * k + rank_b
    tl.store(out_row_ptr + at_b, row_b, mask=keep_b)
    tl.store(out_bm25_ptr + at_b, raw_b_b, mask=keep_b)
    tl.store(out_dense_ptr + at_b, raw_d_b, mask=keep_b)
    tl.store(out_fused_ptr + at_b, fused_b, mask=keep_b)
    tl.store(out_boost_ptr + at_b, boost_b, mask=keep_b)
    tl.store(out_score_ptr + at_b, score_b, mask=keep_b)
