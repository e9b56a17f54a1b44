"""The Triton kernels of the sampler's threshold (imported only by the package, lazily:
importing this module imports Triton).

They serve the ``sampling_threshold`` op, and run before :func:`._kernels_stats.stats_kernel`
where the forward's sampler settings cut. Each row is split into programs as the forward's
(:func:`threshold_scan_kernel`, grid (rows, splits)): one read gives each program's max,
smallest finite logit and NaN flag and, for top-k, the count histogram (``tl.histogram``) of
the first digit of the logits' order-preserving keys (:func:`_radix_key`); each further digit
takes one program per row that merges the row's histograms and picks the digit of the k-th
(:func:`threshold_select_kernel`) and one more split read; for top-p on 16-bit logits where the
host takes the window (threshold.tau_rows) a split read (top-k's last, or its own) counts each
of the WINDOW_KEYS keys up to the row's max (its own, for top-p without top-k, also sums the
float64 mass of the logits below them, :func:`_exp64`: Z takes no read of the row); elsewhere
split reads list a row's candidates (:func:`threshold_cand_kernel`: top-k's set, or top-p's
band of value bins found from one or two counts by :func:`threshold_band_kernel`) and one
program per row decides on them in float64 (:func:`threshold_list_kernel`). One program per row
(:func:`threshold_kernel`) then picks the last digit (the k-th largest key exactly) and runs
top-p's and min-p's reads where nothing before decided them (top-p from the window of keys
where it holds the answer, else radix selects over the keys with float64 masses), and writes τ
(or its maximum with a given tau) into an (N,) float32 buffer. The host is :mod:`.threshold`;
docs/triton.md describes the searches and ``tests/ops/test_triton_compiled.py`` checks their
machine code.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._kernels_common import INTERPRETED, _device, _row_offset, _split_columns

__all__ = ["BAND_BINS", "PER_WARP_HISTOGRAM", "RADIX_DIGIT", "WINDOW_KEYS",
           "threshold_band_kernel", "threshold_cand_kernel", "threshold_kernel",
           "threshold_list_kernel", "threshold_scan_kernel", "threshold_select_kernel"]

# Triton before 3.9 (3.6 measured) lowers ``tl.histogram`` per warp, adding the warp's
# counts of every bin to shared memory each iteration: there a histogram's cost grows with its
# bins.
PER_WARP_HISTOGRAM = tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 9)
# Bins of top-p's band counts (:func:`threshold_cand_kernel`): 4096; 512 with per-warp
# histograms, whose count costs with its bins (4096 spill to local memory there; 2048 cost 266
# instructions an element), the wider band more often counted twice.
BAND_BINS = 512 if PER_WARP_HISTOGRAM else 4096
# The most bits of a digit of top-k's radix select (threshold.digits: the fewest reads, the
# digits as even as can be), a count histogram of up to 2^RADIX_DIGIT bins a read of the row:
# 11 (bf16 keys 8 + 8, fp32 11 + 11 + 10: 3 reads, not 4 with 8-bit digits; a histogram's
# cost hardly grows with its bins there); 7 with per-warp histograms (128 bins: bf16 keys in
# 3 reads instead of 2, fp32 in 5 instead of 4, fewer instructions in all).
RADIX_DIGIT = 7 if PER_WARP_HISTOGRAM else 11
# The keys of top-p's window on 16-bit logits, up to the row's max (each key's count a bin of a
# histogram): 2048; 512 with per-warp histograms (4 binades of bf16 below the max against 16:
# below 1 in magnitude their values lie within a few nats, so the window holds nearly as much
# of a row's mass).
WINDOW_KEYS = 512 if PER_WARP_HISTOGRAM else 2048

# Keys of the window a step of its loops in the row's program: compiled, 512 (256 for a window
# of 512: two steps, so the answer reads half of it again; its whole [2048] vectors would spill
# registers); interpreted, all at once (each step costs the interpreter's per-call overhead,
# not arithmetic).
_CHUNK = tl.constexpr(WINDOW_KEYS if INTERPRETED else min(512, WINDOW_KEYS // 2))
_W = tl.constexpr(WINDOW_KEYS)


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
def _float_below(t):
    """The float32 just below t in the order of the keys (−0 and +0 one value: below ±0
    comes the largest negative subnormal, as key −1 belongs to −0's bits, which
    :func:`_order_key` maps to 0)."""
    k = _order_key(t, 0).to(tl.int64)
    return _key_value(k - tl.where(k == 0, 2, 1), 0)


@_device
def _overflow_floor(t, temperature):
    """The smallest float32 whose quotient by T (``div_rn``) is +inf, t one of them (t > 0):
    a bisection of the positive floats' bits, 31 steps at most (the floats with a +inf
    quotient can span many binades)."""
    lo = tl.zeros([], tl.int32)  # 0 / T = 0: finite
    hi = t.to(tl.int32, bitcast=True)
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        over = tl.math.div_rn(mid.to(tl.float32, bitcast=True), temperature) == float("inf")
        hi = tl.where(over, mid, hi)
        lo = tl.where(over, lo, mid)
    return hi.to(tl.float32, bitcast=True)


@_device
def _f64(bits):
    """The float64 whose bits an int64 argument carries (a kernel's float argument is
    float32)."""
    return bits.to(tl.int64).to(tl.float64, bitcast=True)


@_device
def _kth_key(hist_ptr, hist_stride, row, n_splits, KEY_SHIFT: tl.constexpr):
    """The k-th largest signed key of :func:`_order_key`, from top-k's last select (its
    unsigned key of :func:`_radix_key` in the row's state at n_splits·2048 of ``hist``)."""
    state = hist_ptr + row * hist_stride + n_splits * 2048
    return tl.load(state).to(tl.uint32, bitcast=True).to(tl.int64) - (1 << (31 - KEY_SHIFT))


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
def _z_read(x_row, V, floor, m_s, log_min_p, temperature, offs, TOP_P: tl.constexpr,
            MIN_P: tl.constexpr):
    """One read of the row: Z = Σ exp(x/T − m_s) over x ≥ ``floor`` (TOP_P; float64) and the
    smallest x with x/T − m_s ≥ log min_p (MIN_P; +inf if none)."""
    BLOCK: tl.constexpr = offs.shape[0] * offs.shape[1]
    z_acc = tl.zeros(offs.shape, tl.float64)
    kept_min = tl.full(offs.shape, float("inf"), tl.float32)
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
    return tl.sum(tl.sum(z_acc, 1), 0), tl.min(tl.min(kept_min, 1), 0)


@_device
def _exp_terms(one):
    """The coefficients 1/k!, k = 2 … 13, of :func:`_exp64`'s polynomial, computed from ``one``
    (1.0, a value the compiler cannot fold: computed once before a loop they stay in registers
    instead of each 64-bit constant being set again at each use)."""
    c2 = one / 2.0
    c3 = c2 / 3.0
    c4 = c3 / 4.0
    c5 = c4 / 5.0
    c6 = c5 / 6.0
    c7 = c6 / 7.0
    c8 = c7 / 8.0
    c9 = c8 / 9.0
    c10 = c9 / 10.0
    c11 = c10 / 11.0
    c12 = c11 / 12.0
    c13 = c12 / 13.0
    return c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13


@_device
def _exp64(d, c):
    """exp(d) in float64 for d in [−708, 0] (within an ulp; the caller masks the rest):
    d = n·ln 2 + r, |r| ≤ ln 2 / 2, e^r by its Taylor polynomial to r^13 (the remainder under
    1e-17), times 2^n set in the exponent bits. ``c``: :func:`_exp_terms`."""
    c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13 = c
    t = d * 1.4426950408889634 + 6755399441055744.0  # 1.5·2^52 + n: n in the low bits
    nf = t - 6755399441055744.0
    # ln 2 in two parts, the first with 21 trailing zero bits: n times it exact, r exact
    r = d - nf * 6.93147180369123816490e-01
    r = r - nf * 1.90821492927058770002e-10
    p = c12 + r * c13
    p = c11 + r * p
    p = c10 + r * p
    p = c9 + r * p
    p = c8 + r * p
    p = c7 + r * p
    p = c6 + r * p
    p = c5 + r * p
    p = c4 + r * p
    p = c3 + r * p
    p = c2 + r * p
    p = 1.0 + r * p
    p = 1.0 + r * p
    n = t.to(tl.int64, bitcast=True).to(tl.int32).to(tl.int64)
    return p * ((n + 1023) << 52).to(tl.float64, bitcast=True)


@_device
def _group_floor(x_row, V, t, temperature, offs):
    """The smallest logit of the row whose key x/T (``div_rn``: the rule's float32 quotient) is
    at least t's (t one of the row's logits): t where the float just below it has another key
    (the keys are non-decreasing: no lower logit has t's), else one read of the row. ±inf and
    NaN stay."""
    BLOCK: tl.constexpr = offs.shape[0] * offs.shape[1]
    key = tl.math.div_rn(t, temperature)
    below = _float_below(t)
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

@_device
def _radix_key(x, KEY_SHIFT: tl.constexpr):
    """The key of :func:`_order_key` as an unsigned int (uint32) of 32 − KEY_SHIFT bits: the
    signed key plus 2^(31 − KEY_SHIFT), so that the digits of its bits, high to low, order it."""
    return (_order_key(x, 0).to(tl.uint32, bitcast=True) ^ 0x80000000) >> KEY_SHIFT


@_device
def _select_digit(hist_ptr, hist_stride, row, n_splits, prefix, above, top_k,
                  NB: tl.constexpr):
    """One digit of top-k's radix select: the row's count histogram of the digit (NB bins),
    merged over its ``n_splits`` programs' partial histograms (``hist_ptr``: (N, hist_stride)
    int32, the split s's at s·NB), among the elements whose higher digits are ``prefix``
    (``above``: the elements with larger higher digits). The digit j holding the k-th largest
    key (counted with multiplicity): (prefix·NB + j, the elements above it)."""
    d = tl.arange(0, NB)
    h = tl.zeros([NB], tl.int32)
    base = hist_ptr + row * hist_stride
    for s in range(0, n_splits):
        h += tl.load(base + s * NB + d)
    # at_least[j]: the elements in digits ≥ j, plus those above
    at_least = above + tl.sum(h, 0) - tl.cumsum(h, 0) + h
    j = tl.maximum(tl.sum((at_least >= top_k).to(tl.int32), 0) - 1, 0)
    return prefix * NB + j, _pick(at_least, d, j) - _pick(h, d, j)


@_device
def _window(hist_ptr, hist_stride, row, n_splits, c, top, m_s, temperature,
            KEY_SHIFT: tl.constexpr):
    """Keys [c, c + _CHUNK) of the WINDOW_KEYS up to the max M's (the window of
    :func:`threshold_scan_kernel`, merged over the row's programs) as [_CHUNK] vectors: the
    counts, the signed keys (of :func:`_order_key`), their values (16-bit logits: a key is one
    value), exp(x/T − m_s) in float64, and whether a key is the row's (counted, inside the
    key range, not NaN); and the window's lowest key (a scalar)."""
    d = c + tl.arange(0, _CHUNK)
    h = tl.zeros([_CHUNK], tl.int32)
    base_ptr = hist_ptr + row * hist_stride + n_splits * 2048 + 2
    for s in range(0, n_splits):
        h += tl.load(base_ptr + s * _W + d)
    base = _radix_key(top, KEY_SHIFT).to(tl.int64) - (_W - 1) - (1 << (31 - KEY_SHIFT))
    key = base + d
    x = _key_value(key, KEY_SHIFT)
    e = tl.exp(tl.math.div_rn(x, temperature).to(tl.float64) - m_s)
    listed = (h > 0) & (key >= -(1 << (31 - KEY_SHIFT))) & (x == x)
    return h, key, x, e, listed, base


@_device
def _window_sums(hist_ptr, hist_stride, row, n_splits, top, floor, m_s, log_min_p,
                 temperature, MIN_P: tl.constexpr, KEY_SHIFT: tl.constexpr):
    """From the window (:func:`_window`): the candidates' mass (keys ≥ ``floor``'s, finite;
    float64), the smallest logit x there with x/T − m_s ≥ log min_p (MIN_P; +inf if none),
    the window's lowest key, and each chunk's candidates' mass ([_W // _CHUNK] float64, the
    lowest chunk first; :func:`_window_answer` takes them)."""
    z = tl.zeros([], tl.float64)
    tau_m = tl.full([], float("inf"), tl.float32)
    key_floor = _order_key(floor, KEY_SHIFT).to(tl.int64)
    base = key_floor
    chunks = tl.arange(0, _W // _CHUNK)
    sums = tl.zeros([_W // _CHUNK], tl.float64)
    for c in range(0, _W, _CHUNK):
        h, key, x, e, listed, base = _window(hist_ptr, hist_stride, row, n_splits, c, top, m_s,
                                             temperature, KEY_SHIFT)
        cand = listed & (x > float("-inf")) & (key >= key_floor)
        chunk = tl.sum(tl.where(cand, h.to(tl.float64) * e, 0.0), 0)
        z += chunk
        sums = tl.where(chunks == c // _CHUNK, chunk, sums)
        if MIN_P:
            u = tl.math.div_rn(x, temperature).to(tl.float64) - m_s
            tau_m = tl.minimum(tau_m, tl.min(tl.where(listed & (u >= log_min_p), x,
                                                      float("inf")), 0))
    return z, tau_m, base, sums


@_device
def _window_answer(hist_ptr, hist_stride, row, n_splits, top, floor, target, sums, m_s,
                   temperature, KEY_SHIFT: tl.constexpr):
    """top-p's answer from the window (:func:`_window`) of the candidates (keys ≥ ``floor``'s,
    finite), given each chunk's candidates' mass (``sums``, :func:`_window_sums`): the mass
    above a key, A_key = Σ_{keys above} count·exp(x/T − m_s) (float64: the chunks' masses
    added from the top, then within a chunk). Where the window holds ≥ target of the mass,
    the answer is the smallest candidate key with A_key < target: in the lowest chunk whose
    mass above is < target, the only chunk read again (its highest candidate qualifies).
    Returns (the answer there, else the key below the window; whether it is there; the
    window's mass)."""
    key_floor = _order_key(floor, KEY_SHIFT).to(tl.int64)
    chunks = tl.arange(0, _W // _CHUNK)
    carried = tl.zeros([], tl.float64)
    above_pick = tl.zeros([], tl.float64)
    pick = key_floor * 0  # the chunk's index, from the top
    for i in range(0, _W // _CHUNK):
        here = carried < target
        pick = tl.where(here, i, pick)
        above_pick = tl.where(here, carried, above_pick)
        carried += tl.sum(tl.where(chunks == _W // _CHUNK - 1 - i, sums, 0.0), 0)
    h, key, x, e, listed, base = _window(hist_ptr, hist_stride, row, n_splits,
                                         _W - (pick + 1) * _CHUNK, top, m_s, temperature,
                                         KEY_SHIFT)
    cand = listed & (x > float("-inf")) & (key >= key_floor)
    w = tl.where(cand, h.to(tl.float64) * e, 0.0)
    above = above_pick + (tl.sum(w, 0) - tl.cumsum(w, 0))  # A_key
    highest = tl.max(tl.where(cand, key, -(1 << 40)), 0)
    found = tl.min(tl.where(cand & ((above < target) | (key == highest)), key, 1 << 40), 0)
    inside = (carried >= target) & (found < (1 << 40))
    return tl.where(inside, found, base - 1), inside, tl.where(inside, 0.0, carried)


@triton.jit
def threshold_scan_kernel(
    x_ptr, part_ptr, hist_ptr, zpart_ptr, T, stride_xb, stride_xt, V, cols, n_splits,
    hist_stride, temperature,
    SCAN: tl.constexpr, HIST: tl.constexpr, PASS: tl.constexpr, WINDOW: tl.constexpr,
    ZSUM: tl.constexpr, KEY_SHIFT: tl.constexpr, DIGIT_HI: tl.constexpr,
    DIGIT_LO: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
):
    """Program (row, split) reads its columns [c0, c1) of the row once (blocks of BLOCK) and
    writes its partials: SCAN (pass 0): (max, smallest logit > −inf, NaN held) into
    ``part`` (N, n_splits, 4) float32; HIST: the count histogram of the bits
    [DIGIT_LO, DIGIT_HI) of the keys of :func:`_radix_key` (``tl.histogram``: 2^(DIGIT_HI −
    DIGIT_LO) bins), for PASS > 0 among the elements whose bits above DIGIT_HI are the row's
    prefix of the previous passes (``hist_ptr``: (N, hist_stride) int32, the prefix at
    n_splits·2048), into the row's split s bins at s·NB; WINDOW (top-p's, in a pass after
    pass 0): the count of each of the W = WINDOW_KEYS keys up to the row's max M's (M merged
    from the ``n_splits`` ≤ SPLITS partials of pass 0; bin W − 1 M's own), into the row's
    split s bins at n_splits·2048 + 2 + s·W; ZSUM (with WINDOW, top-p without top-k: every
    finite logit a candidate) also the float64 mass Σ exp(x/T − M/T) of its finite logits
    below the window (x/T the float32 division, as :func:`_z_read`'s), into ``zpart`` (N,
    n_splits) float64.
    NaN is counted in no bin."""
    NB: tl.constexpr = 1 << (DIGIT_HI - DIGIT_LO)
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    x_row = x_ptr + _row_offset(row, T, stride_xb, stride_xt)
    c0, c1 = _split_columns(split, cols, n_splits, V)
    offs = tl.arange(0, BLOCK)
    big = tl.full([BLOCK], float("-inf"), tl.float32)
    small_finite = tl.full([BLOCK], float("inf"), tl.float32)
    nan = tl.zeros([BLOCK], tl.int32)
    h = tl.zeros([NB], tl.int32)
    if PASS > 0:
        prefix = tl.load(hist_ptr + row * hist_stride + n_splits * 2048).to(tl.uint32)
    if WINDOW:
        sp = tl.arange(0, SPLITS)
        top = tl.max(tl.load(part_ptr + (row * n_splits + sp) * 4, mask=sp < n_splits,
                             other=float("-inf")), 0)
        base = _radix_key(top, KEY_SHIFT).to(tl.int32) - (_W - 1)  # the window's lowest key
        hw = tl.zeros([_W], tl.int32)
        if ZSUM:
            m_s = tl.math.div_rn(top, temperature).to(tl.float64)
            z_acc = tl.zeros([BLOCK], tl.float64)
            terms = _exp_terms(tl.where(V > 0, 1.0, 2.0).to(tl.float64))
    for start in range(c0, c1, BLOCK):
        col = start + offs
        valid = col < c1
        x = tl.load(x_row + col, mask=valid, other=float("nan")).to(tl.float32)
        if SCAN:
            big = tl.maximum(big, tl.where(x == x, x, float("-inf")))
            small_finite = tl.minimum(small_finite, tl.where(x > float("-inf"), x,
                                                             float("inf")))
            nan = tl.maximum(nan, (valid & (x != x)).to(tl.int32))
        if HIST:
            u = _radix_key(x, KEY_SHIFT)
            inside = x == x
            if PASS > 0:
                inside = inside & ((u >> DIGIT_HI) == prefix)
            h += tl.histogram(((u >> DIGIT_LO) & (NB - 1)).to(tl.int32), NB, mask=inside)
        if WINDOW:
            w = _radix_key(x, KEY_SHIFT).to(tl.int32) - base
            hw += tl.histogram(w, _W, mask=(x == x) & (w >= 0) & (w < _W))
            if ZSUM:  # the logits below the window (−inf, NaN and terms under e^-708: none)
                d = tl.math.div_rn(x, temperature).to(tl.float64) - m_s
                z_acc += tl.where((w < 0) & (d >= -708.0), _exp64(d, terms), 0.0)
    slot = row * n_splits + split
    if SCAN:
        tl.store(part_ptr + slot * 4, tl.max(big, 0))
        tl.store(part_ptr + slot * 4 + 1, tl.min(small_finite, 0))
        tl.store(part_ptr + slot * 4 + 2, tl.max(nan, 0).to(tl.float32))
    if HIST:
        tl.store(hist_ptr + row * hist_stride + split * NB + tl.arange(0, NB), h)
    if WINDOW:  # after the digits' histograms and the prefix
        tl.store(hist_ptr + row * hist_stride + n_splits * 2048 + 2 + split * _W +
                 tl.arange(0, _W), hw)
        if ZSUM:
            tl.store(zpart_ptr + slot, tl.sum(z_acc, 0))


@_device
def _band_y(x, m32, inv_t, scale):
    """y = (M·(1/T) − x·(1/T))·scale of float32 logits (``m32`` = M·(1/T); float32 products:
    within a few ulps of −(x/T − M/T)·scale; NaN for NaN): non-increasing in x."""
    return (m32 - x * inv_t) * scale


@_device
def _band_bins(x, m32, inv_t, scale, j_lo, s1, NBINS: tl.constexpr):
    """The bins of top-p's band counts (:func:`threshold_cand_kernel`) of float32 logits: ⌊y⌋
    (:func:`_band_y`; NBINS for values past the last bin, ±inf and NaN), and the sub-bin
    ⌊(y − j_lo)·s1⌋ clamped to [0, NBINS) (the second count's bins, within the band's bins
    from j_lo, s1 = NBINS / the band's bins). Both non-increasing in x: bins are intervals of
    the logits, bin 0 the largest."""
    y = _band_y(x, m32, inv_t, scale)
    y = tl.where(y < NBINS, y, NBINS)  # NaN, +inf: past the bins
    b = tl.floor(tl.maximum(y, 0.0)).to(tl.int32)
    sub = tl.floor(tl.minimum(tl.maximum((y - j_lo) * s1, 0.0), NBINS - 1)).to(tl.int32)
    return b, sub


@_device
def _compact(cand_row, counter, x, inset, CAP: tl.constexpr):
    """Appends the values x[inset] of a block to the row's candidate list (``cand_row``, CAP
    float32; ``counter``: its int32 length, which counts past CAP), in no fixed order (an
    atomic add per listed value)."""
    slot = tl.atomic_add(counter + 0 * inset.to(tl.int32), 1, mask=inset, sem="relaxed")
    tl.store(cand_row + slot, x, mask=inset & (slot < CAP))


@_device
def _band_state(cstate_ptr, row, NBINS: tl.constexpr):
    """A row's band (``cstate[row]``, :func:`threshold_band_kernel`): the bins [j_lo, j_hi],
    the sub-bins [i_lo, i_hi] within them (all where one count sufficed), whether the band
    is listed (ok), whether it takes the second count (refine), and s1."""
    st = cstate_ptr + row * 8
    j_lo = tl.load(st)
    j_hi = tl.load(st + 1)
    s1 = NBINS / (j_hi - j_lo + 1).to(tl.float32)
    return j_lo, j_hi, tl.load(st + 5), tl.load(st + 6), tl.load(st + 3) > 0, tl.load(st + 4) > 0, s1


@_device
def _second_count(x, m32, inv_t, scale, j_lo, j_hi, s1, NBINS: tl.constexpr):
    """A block of top-p's second band count: the sub-bins of the logits x, whether each lies
    in the bins' band [j_lo, j_hi], and the mass exp(x/T − M/T) of those above it (float32
    exponentials of the float32 products, as float64; 0 for the rest)."""
    b, sub = _band_bins(x, m32, inv_t, scale, j_lo, s1, NBINS)
    finite = (x > float("-inf")) & (x < float("inf"))
    above = tl.where(finite & (b < j_lo), tl.exp(x * inv_t - m32), 0.0)
    return sub, (b >= j_lo) & (b <= j_hi), above.to(tl.float64)


@triton.jit
def threshold_cand_kernel(
    x_ptr, part_ptr, hist_ptr, zpart_ptr, cstate_ptr, cand_ptr, T, stride_xb, stride_xt, V,
    cols, n_splits, hist_stride, scale, log_min_p_bits, temperature,
    MODE: tl.constexpr, MIN_P: tl.constexpr, CAP: tl.constexpr, NBINS: tl.constexpr,
    KEY_SHIFT: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
):
    """Top-p's candidates where no window of keys is counted, program (row, split) over its
    columns [c0, c1), M merged from pass 0's partials (``part`` (N, n_splits, 4) float32); the
    bins of :func:`_band_bins`, the row's band in ``cstate`` (:func:`_band_state`):

    - MODE 1 (the band's count): the count histogram of the bins (NBINS, ``tl.histogram``)
      into the row's split s bins at s·NBINS of ``hist``, and the mass Σ exp(x/T − M/T) of its
      finite logits (float32 exponentials of the float32 products, summed in float64) into
      ``zpart[row, split, 0]``;
    - MODE 4 (the second count, for a row whose band holds more than CAP logits; the other
      rows' programs read nothing): the count histogram of the sub-bins of the band's logits,
      and the mass (as MODE 1's) of the logits above the band into ``zpart[row, split, 1]``;
    - MODE 2 (the band's read): the logits of the band (its sub-bins [i_lo, i_hi]) appended
      to the row's candidates where it is listed, and the float64 masses Σ exp(x/T − M/T)
      (x/T the float32 division, :func:`_exp64`) of its finite logits and of those above the
      band into ``zpart[row, split]``; MIN_P: the smallest logit with x/T − M/T ≥ log min_p
      into ``part[row, split, 3]``;
    - MODE 3 (top-k's set; its k-th largest logit t from top-k's last select in ``hist`` at
      n_splits·2048): the finite logits whose x/T is at least t's appended: x ≥ the smallest
      float whose quotient is t's, found before the loop: from t downwards a float at a time
      (a tie group spans about T floats), −inf where t/T is −inf, :func:`_overflow_floor`
      where it is +inf.
    """
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    x_row = x_ptr + _row_offset(row, T, stride_xb, stride_xt)
    c0, c1 = _split_columns(split, cols, n_splits, V)
    offs = tl.arange(0, BLOCK)
    slot = row * n_splits + split
    sp = tl.arange(0, SPLITS)
    top = tl.max(tl.load(part_ptr + (row * n_splits + sp) * 4, mask=sp < n_splits,
                         other=float("-inf")), 0)
    inv_t = 1.0 / temperature
    m32 = top * inv_t
    counter = cstate_ptr + row * 8 + 2
    cand_row = cand_ptr + row * CAP
    if MODE == 1:
        j_lo = 0
        s1 = 1.0
        hb = tl.zeros([NBINS], tl.int32)
        z_acc = tl.zeros([BLOCK], tl.float64)
    if MODE == 4:
        j_lo, j_hi, i_lo, i_hi, ok, refine, s1 = _band_state(cstate_ptr, row, NBINS)
        c1 = tl.where(refine, c1, c0)  # no read where one count sufficed
        hb = tl.zeros([NBINS], tl.int32)
        z_acc = tl.zeros([BLOCK], tl.float64)
    if MODE == 2:
        j_lo, j_hi, i_lo, i_hi, ok, refine, s1 = _band_state(cstate_ptr, row, NBINS)
        # the band as values of y (bins [j_lo, j_hi], or their sub-bins [i_lo, i_hi]): the
        # logits above it have y < y_a, listed y_a ≤ y < y_b where ok
        y_a = j_lo + i_lo / s1
        y_b = tl.where(ok, j_lo + (i_hi + 1) / s1, y_a)
        m_s = tl.math.div_rn(top, temperature).to(tl.float64)
        log_min_p = _f64(log_min_p_bits)
        terms = _exp_terms(tl.where(V > 0, 1.0, 2.0).to(tl.float64))
        z_acc = tl.zeros([BLOCK], tl.float64)
        above_acc = tl.zeros([BLOCK], tl.float64)
        kept_min = tl.full([BLOCK], float("inf"), tl.float32)
    if MODE == 3:
        x_min = _key_value(_kth_key(hist_ptr, hist_stride, row, n_splits, KEY_SHIFT),
                           KEY_SHIFT)
        if (x_min > float("-inf")) & (x_min < float("inf")):
            q_k = tl.math.div_rn(x_min, temperature)
            if q_k == float("-inf"):  # every float below has the quotient −inf too
                x_min = float("-inf")
            elif q_k == float("inf"):
                x_min = _overflow_floor(x_min, temperature)
            else:  # a tie group of about T floats
                below = _float_below(x_min)
                while tl.math.div_rn(below, temperature) == q_k:
                    x_min = below
                    below = _float_below(below)
    for start in range(c0, c1, BLOCK):
        col = start + offs
        x = tl.load(x_row + col, mask=col < c1, other=float("nan")).to(tl.float32)
        finite = (x > float("-inf")) & (x < float("inf"))
        if MODE == 1:
            b, _ = _band_bins(x, m32, inv_t, scale, j_lo, s1, NBINS)
            hb += tl.histogram(b, NBINS, mask=b < NBINS)
            z_acc += tl.where(finite, tl.exp(x * inv_t - m32), 0.0).to(tl.float64)
        if MODE == 4:
            sub, inside, above = _second_count(x, m32, inv_t, scale, j_lo, j_hi, s1, NBINS)
            hb += tl.histogram(sub, NBINS, mask=inside)
            z_acc += above
        if MODE == 2:
            y = _band_y(x, m32, inv_t, scale)
            d = tl.math.div_rn(x, temperature).to(tl.float64) - m_s
            # (−inf, NaN: d −inf or NaN; +inf only where M is: d NaN)
            e = tl.where(d >= -708.0, _exp64(d, terms), 0.0)
            z_acc += e
            above_acc += tl.where(y < y_a, e, 0.0)
            if MIN_P:
                kept_min = tl.minimum(kept_min, tl.where((x == x) & (d >= log_min_p), x,
                                                         float("inf")))
            _compact(cand_row, counter, x, finite & (y >= y_a) & (y < y_b), CAP)
        if MODE == 3:
            _compact(cand_row, counter, x, finite & (x >= x_min), CAP)
    if MODE == 1:
        tl.store(hist_ptr + row * hist_stride + split * NBINS + tl.arange(0, NBINS), hb)
        tl.store(zpart_ptr + slot * 2, tl.sum(z_acc, 0))
    if MODE == 4:
        if refine:
            tl.store(hist_ptr + row * hist_stride + split * NBINS + tl.arange(0, NBINS), hb)
            tl.store(zpart_ptr + slot * 2 + 1, tl.sum(z_acc, 0))
    if MODE == 2:
        tl.store(zpart_ptr + slot * 2, tl.sum(z_acc, 0))
        tl.store(zpart_ptr + slot * 2 + 1, tl.sum(above_acc, 0))
        if MIN_P:
            tl.store(part_ptr + slot * 4 + 3, tl.min(kept_min, 0))


@triton.jit
def threshold_band_kernel(zpart_ptr, hist_ptr, cstate_ptr, n_splits, hist_stride, top_p_bits,
                          scale, LEVEL: tl.constexpr, CAP: tl.constexpr, NBINS: tl.constexpr,
                          SPLITS: tl.constexpr):
    """One program per row: top-p's band, the bins (LEVEL 0) or sub-bins (LEVEL 1, rows whose
    bins' band holds more than CAP logits) of :func:`_band_bins` that hold its answer whatever
    the masses inside each, from the counts and float-exponential masses of
    :func:`threshold_cand_kernel` (MODE 1: Z; MODE 4: the mass above the bins' band).

    A logit of bin j has −(x/T − M/T) ∈ [j, j + 1)/scale, of sub-bin i ∈ [j_lo + i/s1,
    j_lo + (i + 1)/s1)/scale, up to the float32 products' rounding (a margin of 1e-5 each
    side, logits up to |x/T| ≈ 100): a (sub-)bin's mass lies between its count times the
    exponentials of its two ends. With t = p·Z, the masses known within 5e-6 (float32
    exponentials, float64 sums) and 1e-4 at LEVEL 0, every logit of a bin whose upper bound
    of the mass of the bins up to it (and above the band) is below t is kept, every logit of
    a bin whose lower bound of the mass of the bins above it reaches t is dropped: the answer
    lies in between. Writes the band, whether it is listed (1 to CAP logits) and, LEVEL 0,
    whether it takes the second count (more) into ``cstate[row]``."""
    row = tl.program_id(0).to(tl.int64)
    st = cstate_ptr + row * 8
    j = tl.arange(0, NBINS)
    sp = tl.arange(0, SPLITS)
    zp = zpart_ptr + (row * n_splits + sp) * 2
    z = tl.sum(tl.load(zp, mask=sp < n_splits, other=0.0), 0)
    t = _f64(top_p_bits) * z
    if LEVEL == 0:
        go = True
        above = tl.zeros([], tl.float64)
        slack = 1e-4
        j_lo0 = 0
        s1 = 1.0
    else:
        j_lo0 = tl.load(st)
        go = tl.load(st + 4) > 0
        above = tl.sum(tl.load(zp + 1, mask=sp < n_splits, other=0.0), 0)
        slack = 5e-6
        s1 = NBINS / (tl.load(st + 1) - j_lo0 + 1).to(tl.float32)
    if go:
        h = tl.zeros([NBINS], tl.int32)
        for s in range(0, n_splits):
            h += tl.load(hist_ptr + row * hist_stride + s * NBINS + j)
        # −(x/T − M/T) at the (sub-)bin's upper end, and its width
        base = (j_lo0 + j.to(tl.float32) / s1) / scale
        width = 1.0 / (s1 * scale)
        # (sub-)bin j's mass at most (hi) and at least (lo)
        hi_m = h.to(tl.float32) * tl.exp(1e-5 - base)
        lo_m = hi_m * tl.exp(-2e-5 - width)
        above_lo = above * (1.0 - slack) + (tl.cumsum(lo_m.to(tl.float64), 0) - lo_m)
        upto_hi = above * (1.0 + slack) + tl.cumsum(hi_m.to(tl.float64), 0)
        i_hi = tl.max(tl.where((h > 0) & (above_lo < t * (1.0 + slack)), j, -1), 0)
        i_lo = tl.min(tl.where(upto_hi >= t * (1.0 - slack), j, NBINS), 0)
        n = tl.sum(tl.where((j >= i_lo) & (j <= i_hi), h, 0), 0)
        valid = (i_lo <= i_hi) & (n > 0) & (t == t) & (t < float("inf"))
        ok = valid & (n <= CAP)
        if LEVEL == 0:
            tl.store(st, i_lo)
            tl.store(st + 1, i_hi)
            tl.store(st + 5, 0)
            tl.store(st + 6, NBINS - 1)
            tl.store(st + 4, (valid & (n > CAP)).to(tl.int32))
        else:
            tl.store(st + 5, i_lo)
            tl.store(st + 6, i_hi)
        tl.store(st + 2, 0)
        tl.store(st + 3, ok.to(tl.int32))


@_device
def _mass_above(key, e, k, s_above):
    """f(k) = s_above + Σ_{key > k} e: the mass before the logit of key k (a step of
    :func:`threshold_list_kernel`'s bisection)."""
    return s_above + tl.sum(tl.where(key > k, e, 0.0), 0)


@triton.jit
def threshold_list_kernel(part_ptr, zpart_ptr, cstate_ptr, cand_ptr, list_ptr, n_splits,
                          top_p_bits, log_min_p_bits, temperature, MODE: tl.constexpr,
                          CAP: tl.constexpr, SPLITS: tl.constexpr):
    """One program per row, after :func:`threshold_cand_kernel` listed the row's candidates
    (MODE 2: top-p's band, the mass above it and Z from ``zpart``; MODE 3: top-k's set, Z its
    own mass): their masses e = exp(x/T − M/T) (float64) and top-p's answer K, the smallest
    candidate whose mass before, f(K) = (the mass above the list) + Σ_{x > K} e, is < p·Z —
    by bisection over the keys between the list's smallest and largest (f is non-increasing
    and steps at the list's keys only, so the smallest key with f < p·Z is a listed one; no
    sort) — lowered to its tie group's smallest in the list. Writes (K, whether the list
    decides it, the list's mass, its smallest logit, min-p's smallest logit with
    x/T − M/T ≥ log min_p there) into ``list[row]`` (float64). The list decides where it
    holds 1 to CAP logits and, MODE 2, K lies in it: its largest kept, the first logit
    below it not."""
    row = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, SPLITS)
    on = sp < n_splits
    top = tl.max(tl.load(part_ptr + (row * n_splits + sp) * 4, mask=on, other=float("-inf")),
                 0)
    m_s = tl.math.div_rn(top, temperature).to(tl.float64)
    top_p = _f64(top_p_bits)
    n = tl.load(cstate_ptr + row * 8 + 2)
    i = tl.arange(0, CAP)
    real = i < tl.minimum(n, CAP)
    xs = tl.load(cand_ptr + row * CAP + i, mask=real, other=float("-inf"))
    key = _order_key(xs, 0)
    q = tl.math.div_rn(xs, temperature)
    d = q.to(tl.float64) - m_s
    e = tl.where(real, tl.exp(d), 0.0)
    total = tl.sum(e, 0)
    s_above = tl.zeros([], tl.float64)
    if MODE == 3:
        target = top_p * total
    else:
        zp = zpart_ptr + (row * n_splits + sp) * 2
        s_above = tl.sum(tl.load(zp + 1, mask=on, other=0.0), 0)
        target = top_p * tl.sum(tl.load(zp, mask=on, other=0.0), 0)
    # the smallest key K in [lo, hi] with f(K) < target (f(hi) = s_above: checked below)
    lo = tl.min(tl.where(real, key, 2147483647), 0).to(tl.int64)
    hi = tl.max(tl.where(real, key, -2147483647 - 1), 0).to(tl.int64)
    while lo < hi:
        mid = (lo + hi) >> 1
        if _mass_above(key, e, mid, s_above) < target:
            hi = mid
        else:
            lo = mid + 1
    ans = _key_value(lo, 0)
    ans = tl.min(tl.where(real & (q >= tl.math.div_rn(ans, temperature)), xs, float("inf")), 0)
    ok = (n > 0) & (n <= CAP) & (s_above < target)
    if MODE == 2:
        ok = ok & (s_above + total >= target)
    out = list_ptr + row * 8
    tl.store(out, ans.to(tl.float64))
    tl.store(out + 1, ok.to(tl.float64))
    tl.store(out + 2, total)
    tl.store(out + 3, tl.min(tl.where(real, xs, float("inf")), 0).to(tl.float64))
    tl.store(out + 4, tl.min(tl.where(real & (d >= _f64(log_min_p_bits)), xs, float("inf")),
                             0).to(tl.float64))


@triton.jit
def threshold_select_kernel(hist_ptr, n_splits, hist_stride, top_k, PASS: tl.constexpr,
                            NB: tl.constexpr):
    """One program per row: top-k's digit of pass PASS from the row's partial histograms
    (:func:`_select_digit`), its prefix and the count above it written at n_splits·2048 of the
    row's scratch for the next pass."""
    row = tl.program_id(0).to(tl.int64)
    state = hist_ptr + row * hist_stride + n_splits * 2048
    prefix = tl.zeros([], tl.int32)
    above = tl.zeros([], tl.int32)
    if PASS > 0:
        prefix = tl.load(state)
        above = tl.load(state + 1)
    prefix, above = _select_digit(hist_ptr, hist_stride, row, n_splits, prefix, above, top_k,
                                  NB)
    tl.store(state, prefix)
    tl.store(state + 1, above)


@triton.jit
def threshold_kernel(
    x_ptr, part_ptr, hist_ptr, zpart_ptr, list_ptr, tau_in_ptr, tau_ptr, T,
    stride_xb, stride_xt, V, n_splits, hist_stride, top_k, top_p_bits, log_min_p_bits,
    window_bits, temperature,
    TOP_K: tl.constexpr, TOP_P: tl.constexpr, MIN_P: tl.constexpr, HAS_TAU: tl.constexpr,
    KEY_SHIFT: tl.constexpr, NB_LAST: tl.constexpr, WINDOW: tl.constexpr, ZSUM: tl.constexpr,
    CAND: tl.constexpr,
    SPLITS: tl.constexpr, BLOCK: tl.constexpr, BT: tl.constexpr, F: tl.constexpr,
):
    """τ of one row (program) for top-k → top-p → min-p sampling (:mod:`klpenalty.sampling`'s
    rule: decisions on the keys x/T, ``div_rn``, the float32 quotient by float32(T); tie groups
    of keys kept whole), written to ``tau[row]`` as a float32 logit of the row;
    HAS_TAU: max(tau_in[row], τ) (NaN if either is). −inf where nothing is cut (an all −inf
    row), NaN for a row holding NaN. ``top_p``, ``log min_p`` and ``window`` come as the int64
    bits of their float64 values (a float argument would be rounded to float32).

    Launched after :func:`threshold_scan_kernel` (and, for top-k, its histogram passes and
    :func:`threshold_select_kernel`): the row's max M, smallest logit > −inf and NaN flag are
    merged from the ``n_splits`` (≤ SPLITS, a power of two) partials of ``part``.

    - top-k (TOP_K): the last digit (NB_LAST bins) of the radix select over the keys of
      :func:`_radix_key` (:func:`_select_digit` on the last pass's histograms, after the
      prefix of the earlier passes): the k-th largest key exactly (counted with multiplicity,
      so ties with the k-th are all kept), its logit lowered to its tie group's smallest
      (:func:`_group_floor`): τ_k;
    - Z = Σ exp(x/T − M/T) (float64) over x ≥ τ_k, x > −inf, and for min-p
      (MIN_P): τ_m = min{x : k_x − k_M ≥ log min_p} (the keys' float64 difference against a
      float64 log), at most M: from the window of keys (WINDOW, :func:`_window_sums`) where
      it holds them — ZSUM (top-p without top-k): Z plus the window scan's per-program masses
      below the window (``zpart`` (N, n_splits) float64, added in a fixed order) — else one
      read (:func:`_z_read`; with ZSUM for τ_m alone);
    - top-p (TOP_P): the smallest key K among x ≥ τ_k, x > −inf with mass(keys > K) < p·Z
      (:func:`_mass_search`: a radix select, each read cutting the key interval [lo, hi] into
      F buckets of 2^s keys (:func:`_bucket_sums`), until a bucket is one key), searched with
      float32 masses and checked in one float64 read (:func:`_mass_at`): mass(keys > K) < p·Z
      ≤ mass(keys ≥ K), or K the lowest candidate; where the check fails the search runs again
      with float64 masses; WINDOW (16-bit logits): first from the counts of the WINDOW_KEYS
      keys up to M's (:func:`_window_answer`), with no read where the answer lies there, else the
      search runs below them, their mass carried. The logit K (the last kept in the order of
      the logits) is lowered
      to its tie group's smallest (the group's mass before it is at most K's, so it is kept
      whole). The search starts at x ≥ (M/T + window)·T (``window`` = log((1 − p)/V) − 2,
      rounded down): the logits below hold less than 1 − p of the mass together, so each has
      more than p before it. The Z read and the checks take blocks of BLOCK columns (16 bytes
      per thread and load), the searches blocks of BT (the threads: one column each);
    - CAND (:func:`threshold_list_kernel`'s results in ``list``): 3,
      top-k's set listed: τ_k (its smallest), Z and τ_m from it; 2, top-p's band: Z (and τ_m)
      from the band's read (``zpart``, ``part``); where the list decides, top-p's K is its
      answer, with no search and no check; else the reads above.
    """
    XBITS: tl.constexpr = x_ptr.dtype.element_ty.primitive_bitwidth
    INNER: tl.constexpr = 128 // XBITS
    NT: tl.constexpr = BLOCK // INNER
    KBITS: tl.constexpr = 32 - KEY_SHIFT
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + _row_offset(row, T, stride_xb, stride_xt)
    top_p = _f64(top_p_bits)
    log_min_p = _f64(log_min_p_bits)
    window = _f64(window_bits)
    offs = tl.arange(0, NT)[:, None] * INNER + tl.arange(0, INNER)[None, :]
    # the row's pass 0, merged from its programs' partials
    sp = tl.arange(0, SPLITS)
    part = part_ptr + (row * n_splits + sp) * 4
    on = sp < n_splits
    top = tl.max(tl.load(part, mask=on, other=float("-inf")), 0)
    smallest_finite = tl.min(tl.load(part + 1, mask=on, other=float("inf")), 0)
    has_nan = tl.max(tl.load(part + 2, mask=on, other=0.0), 0) > 0.0
    key_top = _order_key(top, KEY_SHIFT).to(tl.int64)
    m_s = tl.math.div_rn(top, temperature).to(tl.float64)
    tau = float("-inf")
    tau_k = float("-inf")
    if CAND > 0:  # the candidate list's results (threshold_list_kernel)
        listed = list_ptr + row * 8
        ans_c = tl.load(listed).to(tl.float32)
        use = tl.load(listed + 1) > 0.0
    if CAND == 3:  # top-k's set listed: its smallest is τ_k, its mass Z, min-p's τ among it
        z_c = tl.load(listed + 2)
        tau_k_c = tl.load(listed + 3).to(tl.float32)
        tau_m_c = tl.load(listed + 4).to(tl.float32)
    if TOP_K:
        state = hist_ptr + row * hist_stride + n_splits * 2048
        if CAND == 3:  # top-k's last select ran before the list: the k-th key in the state
            key_k = _kth_key(hist_ptr, hist_stride, row, n_splits, KEY_SHIFT)
        else:
            key_u, _ = _select_digit(hist_ptr, hist_stride, row, n_splits,
                                     tl.load(state).to(tl.int64), tl.load(state + 1), top_k,
                                     NB_LAST)
            key_k = key_u - (1 << (KBITS - 1))  # the k-th largest key, signed
        t_k = _key_value(key_k, KEY_SHIFT)
        if CAND == 3:
            use = use & (t_k > float("-inf")) & (t_k < float("inf"))
            tau_k = tau_k_c
            if use == 0:
                tau_k = _group_floor(x_row, V, t_k, temperature, offs)
        else:
            tau_k = _group_floor(x_row, V, t_k, temperature, offs)
        tau = tau_k
    if TOP_P or MIN_P:
        floor = tl.maximum(tau_k, smallest_finite)  # top-p's candidates
        z = tl.zeros([], tl.float64)
        tau_m = tl.full([], float("inf"), tl.float32)
        read = True
        if CAND == 3:
            z = tl.where(use, z_c, z)
            tau_m = tl.where(use, tau_m_c, tau_m)
            read = use == 0
        if CAND == 2:  # Z and τ_m from the band's read
            z = tl.sum(tl.load(zpart_ptr + (row * n_splits + sp) * 2, mask=on, other=0.0), 0)
            if MIN_P:
                tau_m = tl.min(tl.load(part + 3, mask=on, other=float("inf")), 0)
            read = False
        if WINDOW:  # Z and τ_m from the window where it holds them, else the read
            z, tau_m, base_w, sums_w = _window_sums(hist_ptr, hist_stride, row, n_splits, top,
                                                    floor, m_s, log_min_p, temperature, MIN_P,
                                                    KEY_SHIFT)
            read = _order_key(floor, KEY_SHIFT).to(tl.int64) < base_w  # candidates below it
            if ZSUM:  # their mass: the window scan's partials, added in the splits' order
                z += tl.sum(tl.load(zpart_ptr + row * n_splits + sp, mask=on, other=0.0), 0)
                read = False
            if MIN_P:
                # decided where the value below the window (and so every one below) falls short
                below = tl.math.div_rn(_key_value(base_w - 1, KEY_SHIFT), temperature)
                short = (below.to(tl.float64) - m_s < log_min_p) | (
                    base_w <= -(1 << (31 - KEY_SHIFT)))
                read = read | (not short)
        if read:  # with ZSUM, Z is complete: the read is min-p's alone
            z_read, tau_m = _z_read(x_row, V, floor, m_s, log_min_p, temperature, offs,
                                    TOP_P and not ZSUM, MIN_P)
            if not ZSUM:
                z = z_read
        if MIN_P:
            tau = tl.maximum(tau, tl.minimum(tau_m, top))
        if TOP_P:
            target = top_p * z
            hi = key_top
            # the window's lowest logit, rounded down (a NaN or −inf bound: no narrowing)
            cut = (m_s + window) * temperature
            cut = tl.where(cut == cut, cut - 1e-6 * tl.abs(cut), float("-inf")).to(tl.float32)
            lo = _order_key(tl.maximum(floor, cut), KEY_SHIFT).to(tl.int64)
            # M = ±inf (or NaN in the row): τ_p = M, the sampler's convention; likewise where
            # M/T is +inf (the keys equal to M's hold all the mass: τ_p is M's tie group)
            lo = tl.where(has_nan | (tl.abs(top) == float("inf")) | (m_s == float("inf")), hi,
                          lo)
            # a search with float32 masses, its answer K checked in float64 (mass(keys > K) <
            # target ≤ mass(keys ≥ K), or K the lowest candidate); where the check fails (the
            # target within float32 rounding of a bucket's edge) the search in float64
            above_w = tl.zeros([], tl.float64)  # the mass of the candidates above hi
            if WINDOW:  # the window's keys decide where they hold the answer
                hi_w, in_window, above_w = _window_answer(hist_ptr, hist_stride, row, n_splits,
                                                          top, floor, target, sums_w, m_s,
                                                          temperature, KEY_SHIFT)
                hi = tl.where(lo < hi, tl.maximum(lo, hi_w), hi)
                lo = tl.where(in_window, hi, lo)
            if CAND > 0:  # where the candidate list decides: no search, no check
                decided = use & (lo < hi)
                key_c = _order_key(ans_c, KEY_SHIFT).to(tl.int64)
                lo = tl.where(decided, key_c, lo)
                hi = tl.where(decided, key_c, hi)
            lo0 = lo
            hi0 = hi
            lo, hi, above_m = _mass_search(x_row, V, lo, hi, above_w, target, m_s, temperature,
                                           1, KEY_SHIFT, BT, F)
            if lo0 < hi0:
                above_k, at_k = _mass_at(x_row, V, lo, m_s, temperature, offs, KEY_SHIFT)
                if (above_k >= target) | ((above_k + at_k < target) & (lo > lo0)):
                    lo, hi, above_m = _mass_search(x_row, V, lo0, hi0, above_w, target, m_s,
                                                   temperature, 2, KEY_SHIFT, BT, F)
            tau = tl.maximum(tau, _group_floor(x_row, V, _key_value(lo, KEY_SHIFT), temperature,
                                               offs))
    tau = tl.where(has_nan, float("nan"), tau)
    if HAS_TAU:
        given = tl.load(tau_in_ptr + row).to(tl.float32)
        tau = tl.where(given != given, given, tl.maximum(tau, given))
        tau = tl.where(has_nan, float("nan"), tau)
    tl.store(tau_ptr + row, tau)
