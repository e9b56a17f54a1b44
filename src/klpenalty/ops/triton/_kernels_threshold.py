"""The Triton kernel of the sampler's threshold (imported only by the package, lazily:
importing this module imports Triton).

:func:`threshold_kernel` serves the ``sampling_threshold`` op, and runs before
:func:`._kernels_stats.stats_kernel` where the forward's sampler settings cut: one program per
row computes the top-k → top-p → min-p threshold τ by radix selects over order-preserving keys
of the logits (:func:`_order_key`), with float64 masses, and writes it (or its maximum with a
given tau) into an (N,) float32 buffer. The host is :mod:`.threshold`; docs/triton.md describes
the searches and ``tests/ops/test_triton_compiled.py`` checks their machine code.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._kernels_common import _device, _row_offset

__all__ = ["threshold_kernel"]


@_device
def _order_key(x, KEY_SHIFT: tl.constexpr):
    """The int32 key of float32 values whose signed order is the values' order (−0 as +0, so
    that equal values have equal keys): the bits, with the 31 below the sign flipped where the
    sign is set, shifted right by KEY_SHIFT (the low bits that are 0 in the input's dtype: 16
    for bf16, 13 for fp16, 0 for fp32)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)) >> KEY_SHIFT


@_device
def _key_value(k, KEY_SHIFT: tl.constexpr):
    """The float32 value of an (int64 scalar) key of :func:`_order_key` (its inverse: the low
    bits shifted out are 0 in a positive value's bits, 1 in a negative one's key)."""
    k32 = k.to(tl.int32)
    low = tl.where(k32 < 0, (1 << KEY_SHIFT) - 1, 0)
    full = (k32 << KEY_SHIFT) | low
    return (full ^ ((full >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@_device
def _key_shift(lo, hi, F: tl.constexpr):
    """The smallest s with (hi − lo) >> s < F: the keys [lo, hi] fall into F buckets of 2^s."""
    s = (hi - lo) * 0
    while ((hi - lo) >> s) >= F:
        s += 1
    return s


@_device
def _bucket_sums(x_row, V, lo, hi, s, m_s, temperature, MASS: tl.constexpr,
                 KEY_SHIFT: tl.constexpr, BT: tl.constexpr, F: tl.constexpr):
    """One read of a row: per bucket j of the keys [lo, hi] (bucket (key − lo) >> s), the count
    [F] of its elements and their unnormalised mass Σ exp(x/T − m_s) [F] (float64; MASS = 0:
    not computed, 1: float32 exponentials summed in float32 per thread, 2: float64
    exponentials and sums; x/T rounded as the float32 division). Blocks of BT columns, one per
    thread, as [F, BT] tiles: each thread adds its column into its own F buckets (no reduction
    in the loop); the threads' sums are added once, after it."""
    cols = tl.arange(0, BT)[None, :]  # [1, BT]
    bins = tl.arange(0, F)[:, None]  # [F, 1]
    width = (hi - lo).to(tl.uint32)
    lo32 = lo.to(tl.int32)
    shift = s.to(tl.uint32)
    cnt = tl.zeros([F, BT], tl.int32)
    if MASS == 1:
        mass = tl.zeros([F, BT], tl.float32)
    else:
        mass = tl.zeros([F, BT], tl.float64)
    for start in range(0, V, BT):
        col = start + cols
        x = tl.load(x_row + col, mask=col < V, other=float("nan")).to(tl.float32)
        d = (_order_key(x, KEY_SHIFT) - lo32).to(tl.uint32, bitcast=True)  # mod 2^32
        inside = (x == x) & (d <= width)
        hit = tl.where(inside, (d >> shift).to(tl.int32), -1) == bins  # [F, BT]
        cnt += hit.to(tl.int32)
        if MASS == 1:
            e = tl.exp(tl.math.div_rn(x, temperature) - m_s.to(tl.float32))
            mass += tl.where(hit, e, 0.0)
        if MASS == 2:
            e = tl.exp(tl.math.div_rn(x, temperature).to(tl.float64) - m_s)
            mass += tl.where(hit, e, 0.0)
    return tl.sum(cnt, 1), tl.sum(mass.to(tl.float64), 1)


@_device
def _mass_search(x_row, V, lo, hi, above_m, target, m_s, temperature, MASS: tl.constexpr,
                 KEY_SHIFT: tl.constexpr, BT: tl.constexpr, F: tl.constexpr):
    """top-p's search from the keys [lo, hi] (``above_m``: the mass of the candidates above
    hi): the smallest key K with mass(keys > K) < target, by the buckets' masses of
    :func:`_bucket_sums` (MASS 1 or 2). In bucket j the largest element has exactly the mass of
    the buckets above (before_j) before it, so the answer lies in the lowest non-empty bucket
    with before_j < target. Returns (K, K, the mass above K)."""
    bins = tl.arange(0, F)
    while lo < hi:
        s = _key_shift(lo, hi, F)
        cnt, mass = _bucket_sums(x_row, V, lo, hi, s, m_s, temperature, MASS, KEY_SHIFT, BT, F)
        # before[j]: the mass of the buckets above j (exactly 0 for the empty ones)
        before = above_m + tl.sum(tl.where(bins[None, :] > bins[:, None], mass[None, :], 0.0), 1)
        j = tl.min(tl.where((cnt > 0) & (before < target), bins, F - 1), 0)
        above_m = _pick(before, bins, j)
        lo = lo + (j.to(tl.int64) << s)
        hi = tl.minimum(hi, lo + (((s * 0) + 1) << s) - 1)
    return lo, hi, above_m


@_device
def _mass_at(x_row, V, key, m_s, temperature, offs, KEY_SHIFT: tl.constexpr):
    """One read: the float64 masses Σ exp(x/T − m_s) of the logits with keys > ``key`` and of
    those with key ``key``."""
    BLOCK: tl.constexpr = offs.shape[0] * offs.shape[1]
    k32 = key.to(tl.int32)
    above = tl.zeros(offs.shape, tl.float64)
    at = tl.zeros(offs.shape, tl.float64)
    for start in range(0, V, BLOCK):
        col = start + offs
        x = tl.load(x_row + col, mask=col < V, other=float("nan")).to(tl.float32)
        k = _order_key(x, KEY_SHIFT)
        e = tl.exp(tl.math.div_rn(x, temperature).to(tl.float64) - m_s)
        above += tl.where((x == x) & (k > k32), e, 0.0)
        at += tl.where((x == x) & (k == k32), e, 0.0)
    return tl.sum(tl.sum(above, 1), 0), tl.sum(tl.sum(at, 1), 0)


@_device
def _group_floor(x_row, V, t, temperature, offs):
    """The smallest logit of the row whose key x/T (``div_rn``: the rule's float32 quotient) is
    at least t's (t one of the row's logits): t where the float just below it has another key
    (the keys are non-decreasing: no lower logit has t's), else one read of the row. ±inf and
    NaN stay."""
    BLOCK: tl.constexpr = offs.shape[0] * offs.shape[1]
    key = tl.math.div_rn(t, temperature)
    below = _key_value(_order_key(t, 0).to(tl.int64) - 1, 0)
    out = t
    if (t > float("-inf")) & (t < float("inf")) & (tl.math.div_rn(below, temperature) == key):
        low = tl.full(offs.shape, float("inf"), tl.float32)
        for start in range(0, V, BLOCK):
            col = start + offs
            x = tl.load(x_row + col, mask=col < V, other=float("nan")).to(tl.float32)
            low = tl.minimum(low, tl.where(tl.math.div_rn(x, temperature) >= key, x,
                                           float("inf")))
        out = tl.min(tl.min(low, 1), 0)
    return out


@_device
def _pick(v, bins, j):
    """v[j] of a [F] vector (0 where j is outside)."""
    return tl.sum(tl.where(bins == j, v, 0 * v), 0)


@triton.jit
def threshold_kernel(
    x_ptr, tau_in_ptr, tau_ptr, T, stride_xb, stride_xt, V, top_k, top_p_bits,
    log_min_p_bits, window_bits, temperature, TOP_K: tl.constexpr, TOP_P: tl.constexpr,
    MIN_P: tl.constexpr, HAS_TAU: tl.constexpr, KEY_SHIFT: tl.constexpr,
    BLOCK: tl.constexpr, BT: tl.constexpr, F: tl.constexpr,
):
    """τ of one row (program) for top-k → top-p → min-p sampling (:mod:`klpenalty.sampling`'s
    rule: decisions on the keys x/T, ``div_rn``, the float32 quotient by float32(T); tie groups
    of keys kept whole), written to ``tau[row]`` as a float32 logit of the row;
    HAS_TAU: max(tau_in[row], τ) (NaN if either is). −inf where nothing is cut (an all −inf
    row), NaN for a row holding NaN. ``top_p``, ``log min_p`` and ``window`` come as the int64
    bits of their float64 values (a float argument would be rounded to float32).

    Every search is a radix select over the order-preserving int32 keys of the logits
    (:func:`_order_key`): the key interval [lo, hi] known to hold the answer is cut into F
    buckets of 2^s keys, one read of the row (:func:`_bucket_sums`) sums each bucket, and the
    bucket holding the answer becomes the interval; a bucket of single keys ends it, so a
    search takes ⌈log_F(hi − lo + 1)⌉ reads (16-bit keys for bf16/fp16 logits: at most 4).
    Pass 0 and the Z read take blocks of BLOCK columns (16 bytes per thread and load), the
    searches blocks of BT (the threads: one column each).

    - pass 0: the row's max M, min, smallest logit > −inf, and whether it holds NaN;
    - top-k (TOP_K): the k-th largest logit by counts (the elements above the interval carried
      along), lowered to its tie group's smallest logit (:func:`_group_floor`): τ_k; for k ≤ BLOCK the search starts at
      the smallest of pass 0's BLOCK partial maxima (a lower bound of τ_k);
    - one read for Z = Σ exp(x/T − M/T) (float64) over x ≥ τ_k, x > −inf, and for min-p
      (MIN_P): τ_m = min{x : k_x − k_M ≥ log min_p} (the keys' float64 difference against a
      float64 log), at most M;
    - top-p (TOP_P): the smallest key K among x ≥ τ_k, x > −inf with mass(keys > K) < p·Z
      (:func:`_mass_search`), searched with float32 masses and checked in one float64 read
      (:func:`_mass_at`): mass(keys > K) < p·Z ≤ mass(keys ≥ K), or K the lowest candidate;
      where the check fails the search runs again with float64 masses. The logit K (the last
      kept in the order of the logits) is lowered to its tie group's smallest (the group's mass
      before it is at most K's, so it is kept whole). The search starts at
      x ≥ (M/T + window)·T (``window`` = log((1 − p)/V) − 2, rounded down): the logits below
      hold less than 1 − p of the mass together, so each has more than p before it.
    """
    XBITS: tl.constexpr = x_ptr.dtype.element_ty.primitive_bitwidth
    INNER: tl.constexpr = 128 // XBITS
    NT: tl.constexpr = BLOCK // INNER
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + _row_offset(row, T, stride_xb, stride_xt)
    top_p = top_p_bits.to(tl.int64).to(tl.float64, bitcast=True)
    log_min_p = log_min_p_bits.to(tl.int64).to(tl.float64, bitcast=True)
    window = window_bits.to(tl.int64).to(tl.float64, bitcast=True)
    offs = tl.arange(0, NT)[:, None] * INNER + tl.arange(0, INNER)[None, :]
    bins = tl.arange(0, F)
    big = tl.full([NT, INNER], float("-inf"), tl.float32)
    small = tl.full([NT, INNER], float("inf"), tl.float32)
    small_finite = tl.full([NT, INNER], float("inf"), tl.float32)
    nan = tl.zeros([NT, INNER], tl.int32)
    for start in range(0, V, BLOCK):
        col = start + offs
        valid = col < V
        x = tl.load(x_row + col, mask=valid, other=float("-inf")).to(tl.float32)
        num = valid & (x == x)
        big = tl.maximum(big, tl.where(num, x, float("-inf")))
        small = tl.minimum(small, tl.where(num, x, float("inf")))
        small_finite = tl.minimum(small_finite, tl.where(valid & (x > float("-inf")), x,
                                                         float("inf")))
        nan = tl.maximum(nan, (valid & (x != x)).to(tl.int32))
    top = tl.max(tl.max(big, 1), 0)
    has_nan = tl.max(tl.max(nan, 1), 0) > 0
    key_top = _order_key(top, KEY_SHIFT).to(tl.int64)
    tau = float("-inf")
    tau_k = float("-inf")
    if TOP_K:
        # for k ≤ BLOCK the search starts at the smallest of pass 0's BLOCK partial maxima
        # (each the value of a distinct logit, or −inf: at most the row's BLOCK-th largest,
        # so at most its k-th), else at the row's min
        low = tl.where(top_k <= BLOCK, tl.min(tl.min(big, 1), 0), tl.min(tl.min(small, 1), 0))
        lo = _order_key(low, KEY_SHIFT).to(tl.int64)
        hi = tl.where(has_nan, lo, key_top)  # a NaN row: no search (its τ is NaN)
        above = (lo * 0).to(tl.int64)  # elements with keys > hi
        while lo < hi:
            s = _key_shift(lo, hi, F)
            cnt, _ = _bucket_sums(x_row, V, lo, hi, s, 0.0, temperature, 0, KEY_SHIFT, BT, F)
            c = cnt.to(tl.int64)
            # at_least[j]: the elements with keys in buckets ≥ j, plus those above
            at_least = above + tl.sum(tl.where(bins[None, :] >= bins[:, None], c[None, :], 0), 1)
            j = tl.sum((at_least >= top_k).to(tl.int32), 0) - 1  # the bucket of the k-th
            above = _pick(at_least, bins, j) - _pick(c, bins, j)
            lo = lo + (j.to(tl.int64) << s)
            hi = tl.minimum(hi, lo + (((s * 0) + 1) << s) - 1)
        tau_k = _group_floor(x_row, V, _key_value(lo, KEY_SHIFT), temperature, offs)
        tau = tau_k
    if TOP_P or MIN_P:
        m_s = tl.math.div_rn(top, temperature).to(tl.float64)
        floor = tl.maximum(tau_k, tl.min(tl.min(small_finite, 1), 0))  # top-p's candidates
        z_acc = tl.zeros([NT, INNER], tl.float64)
        kept_min = tl.full([NT, INNER], float("inf"), tl.float32)
        for start in range(0, V, BLOCK):
            col = start + offs
            valid = col < V
            x = tl.load(x_row + col, mask=valid, other=float("-inf")).to(tl.float32)
            if TOP_P:
                e = tl.exp(tl.math.div_rn(x, temperature).to(tl.float64) - m_s)
                z_acc += tl.where(valid & (x >= floor), e, 0.0)
            if MIN_P:
                u = tl.math.div_rn(x, temperature).to(tl.float64) - m_s
                kept_min = tl.minimum(kept_min, tl.where(valid & (u >= log_min_p), x,
                                                         float("inf")))
        if MIN_P:
            tau = tl.maximum(tau, tl.minimum(tl.min(tl.min(kept_min, 1), 0), top))
        if TOP_P:
            target = top_p * tl.sum(tl.sum(z_acc, 1), 0)
            hi = key_top
            # the window's lowest logit, rounded down (a NaN or −inf bound: no narrowing)
            cut = (m_s + window) * temperature
            cut = tl.where(cut == cut, cut - 1e-6 * tl.abs(cut), float("-inf")).to(tl.float32)
            lo = _order_key(tl.maximum(floor, cut), KEY_SHIFT).to(tl.int64)
            # M = ±inf (or NaN in the row): τ_p = M, the sampler's convention
            lo = tl.where(has_nan | (tl.abs(top) == float("inf")), hi, lo)
            # a search with float32 masses, its answer K checked in float64 (mass(keys > K) <
            # target ≤ mass(keys ≥ K), or K the lowest candidate); where the check fails (the
            # target within float32 rounding of a bucket's edge) the search in float64
            lo0 = lo
            hi0 = hi
            zero = tl.zeros([], tl.float64)
            lo, hi, above_m = _mass_search(x_row, V, lo, hi, zero, target, m_s, temperature, 1,
                                           KEY_SHIFT, BT, F)
            if lo0 < hi0:
                above_k, at_k = _mass_at(x_row, V, lo, m_s, temperature, offs, KEY_SHIFT)
                if (above_k >= target) | ((above_k + at_k < target) & (lo > lo0)):
                    lo, hi, above_m = _mass_search(x_row, V, lo0, hi0, zero, target, m_s,
                                                   temperature, 2, KEY_SHIFT, BT, F)
            tau = tl.maximum(tau, _group_floor(x_row, V, _key_value(lo, KEY_SHIFT), temperature,
                                               offs))
    tau = tl.where(has_nan, float("nan"), tau)
    if HAS_TAU:
        given = tl.load(tau_in_ptr + row).to(tl.float32)
        tau = tl.where(given != given, given, tl.maximum(tau, given))
        tau = tl.where(has_nan, float("nan"), tau)
    tl.store(tau_ptr + row, tau)
