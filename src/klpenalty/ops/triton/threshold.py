"""The host of the Triton backend's ``klpenalty::triton_sampling_threshold`` op, and of the
sampler's threshold that its forward computes first where the sampler settings cut.

:func:`tau_rows` launches the kernels of :mod:`._kernels_threshold` (docs/triton.md): the
split scan (pass 0 and top-k's digit histograms, the rows split as the forward's), top-k's
selects between its passes, and the row's program (top-k's last digit, top-p, min-p), which
writes τ, or max(tau, τ) where a tau is given, into an (N,) float32 buffer: the threshold op
returns it, the forward's statistics kernels read it as their tau and write it into the stats
column ``ST_TAU``. Nothing read back. Float64 logits and empty vocabularies run the streaming
backend's op (:func:`._host.portable_op`).
"""

from __future__ import annotations

import functools
import math
import struct

import torch
from torch import Tensor

from .. import contract
from . import _host
from ._load import _kernels

__all__ = ["tau_rows", "sampling_threshold_op", "THRESHOLD_BUCKETS", "THRESHOLD_BLOCK",
           "THRESHOLD_WARPS", "digits", "cand_cap"]

# Buckets per read of a threshold search (:func:`._kernels_threshold.threshold_kernel`): 4 bits
# of the 32-bit key per read; a power of two.
THRESHOLD_BUCKETS = 16
# Columns per block of the threshold kernel's pass 0, Z and check reads (vector loads; the
# smallest of its BLOCK partial maxima bounds top-k's search for k ≤ BLOCK).
THRESHOLD_BLOCK = 1024
# Columns per block of the split scan (pass 0 and top-k's histograms): one histogram of a block
# costs 3 barriers, so the larger the block the fewer per element.
THRESHOLD_SCAN_BLOCK = 2048
# Warps of a threshold program (a search reads one column per thread at a time).
THRESHOLD_WARPS = 8
# The longest candidate list of top-p's band (its second count narrows a band that holds
# more), and of top-k's set.
BAND_CAP = 2048
CAND_MAX = 8192
# The low bits of a float32 key that are 0 for logits of the dtype (16-bit keys for 16-bit
# logits: half the reads of a search).
_KEY_SHIFT = {torch.bfloat16: 16, torch.float16: 13, torch.float32: 0}


def _float64_bits(value: float) -> int:
    """The bits of a float64 as an int64 (a kernel's float arguments arrive as float32)."""
    return struct.unpack("<q", struct.pack("<d", value))[0]


def digits(dtype: torch.dtype, most: int) -> list[tuple[int, int]]:
    """The (high, low) bit bounds of top-k's radix digits, high to low, over the keys of
    logits of ``dtype`` (32 − KEY_SHIFT bits): as few digits of at most ``most`` bits (the
    kernels' ``RADIX_DIGIT``, by the Triton version) as hold them, as even as can be, the wider
    first (11 bits: bf16 8 + 8, fp16 10 + 9, fp32 11 + 11 + 10; 7 bits: bf16 6 + 5 + 5,
    fp16 7 + 6 + 6, fp32 7 + 7 + 6 + 6 + 6)."""
    high = 32 - _KEY_SHIFT[dtype]
    n = -(-high // most)
    out = []
    for i in range(n):
        width = -(-high // (n - i))
        out.append((high, high - width))
        high -= width
    return out


def cand_cap(vocab: int, top_k: int, bins: int = 4096) -> int:
    """The candidate list's length for top-p without the window of keys (a power of two):
    top-p's band of ``bins`` value bins (V·64/bins, at least 512, at most :data:`BAND_CAP`: at
    p ≤ 0.95 the band of 4096 bins of high-entropy rows, N(0, 2²) logits, holds about V/70),
    or top-k's set (twice k, room for ties; at least 256), 0 where it would pass
    :data:`CAND_MAX`."""
    if not top_k:
        return min(BAND_CAP, max(512, 1 << (-(-vocab * 64 // bins) - 1).bit_length()))
    cap = max(256, 1 << (2 * top_k - 1).bit_length())
    return cap if cap <= CAND_MAX else 0


def tau_rows(x: Tensor, top_k: int, top_p: float, min_p: float, temperature: float,
             tau: Tensor | None = None) -> Tensor:
    """τ (N,) float32 of the sampler settings on the rows of (..., V) logits (the rule of
    :mod:`klpenalty.sampling`), or max(tau, τ) (NaN where either is) where ``tau`` (...) is
    given, launched on x's device, nothing read back. The settings cut
    (:func:`..contract.sampler_cuts`).

    Each row is split into programs as the forward's (:func:`.token_stats.split_columns`):
    :func:`._kernels_threshold.threshold_scan_kernel` reads it once for its max, smallest
    finite logit, NaN and, for top-k, the count histogram of the keys' first digit; each
    further digit of top-k takes :func:`._kernels_threshold.threshold_select_kernel` (one
    program per row: the digit of the k-th, from the merged histograms) and one more
    histogram read; for top-p on 16-bit logits where the window holds its answer (below) a
    scan (top-k's last, or its own) counts the ``WINDOW_KEYS`` keys up to the row's max (its
    own also sums Z's float64 mass below them per program); elsewhere
    :func:`._kernels_threshold.threshold_cand_kernel` lists the row's candidates (after top-k
    its set, else top-p's band of value bins, from one or two counts,
    :func:`._kernels_threshold.threshold_band_kernel`) and
    :func:`._kernels_threshold.threshold_list_kernel` decides on them;
    :func:`._kernels_threshold.threshold_kernel` (one program per row) then selects the last
    digit and runs top-p's and min-p's reads where the list did not decide."""
    from .token_stats import split_columns  # token_stats imports this module

    vocab = x.shape[-1]
    n = x.numel() // vocab
    out = torch.empty(n, dtype=torch.float32, device=x.device)
    if n == 0:
        return out
    rows = _host.rows(x, None, None)
    tauf = _host.flat(tau)
    block = _host.block(vocab, THRESHOLD_BLOCK)
    _, cols = split_columns(n, vocab, x.device)
    splits = max(1, -(-vocab // cols))
    cut_k = 0 < top_k < vocab
    cut_p = top_p < 1.0
    kernels = _kernels()
    # top-p on 16-bit logits: a read (top-k's last) counts each of the WINDOW_KEYS keys up to
    # the max, where they hold its answer: bf16 top-p alone (128 keys a binade: 4 or 16
    # binades; fp16's 1024 a binade reach half a binade or two), and after a top-k whose set
    # is too large to list; after top-k (its set lies there), bf16's and fp16's, where a
    # histogram's cost hardly grows with its bins (Triton 3.9: 2048 keys). Else a candidate
    # list decides (below)
    bf16 = x.dtype == torch.bfloat16
    listed_k = cut_k and cand_cap(vocab, top_k) > 0
    window = cut_p and x.element_size() == 2 and (
        bf16 and not listed_k if kernels.PER_WARP_HISTOGRAM else bf16 or cut_k)
    # top-p without top-k (every finite logit a candidate): the window's scan sums the mass
    # below the window per program, the row's program adds them (no read of the row for Z)
    zsum = window and not cut_k
    # top-p without the window, and fp32's top-k with min-p alone: decided on a candidate
    # list (top-k's set after top-k, else the band of value bins holding top-p's answer) by a
    # program per row
    bins = kernels.BAND_BINS  # top-p's value bins (by the Triton version)
    cap = 0
    if (x.element_size() == 4 or (cut_p and not window)) and (cut_p or (cut_k and min_p > 0.0)):
        cap = cand_cap(vocab, top_k if cut_k else 0, bins)
    cand = (3 if cut_k else 2) if cap else 0
    part = torch.empty((n, splits, 4), dtype=torch.float32, device=x.device)
    ds = digits(x.dtype, kernels.RADIX_DIGIT)
    # the digits' histograms (2048 int32 a split, the kernels' layout: a digit's bins at the
    # start of each), the prefix and count above, the window's histograms
    stride = (splits * 2048 + 2) + (splits * kernels.WINDOW_KEYS if window else 0)
    if cand == 2:  # top-p's band counts: `bins` int32 a split (no top-k: no digits)
        stride = max(stride, splits * bins)
    hist = torch.empty((n, stride if cut_k or window or cand else 1), dtype=torch.int32,
                       device=x.device)
    # the window scan's float64 partials of Z (else unused: part stands in, no allocation)
    zpart = part
    if zsum:
        zpart = torch.empty((n, splits), dtype=torch.float64, device=x.device)
    elif cand == 2:  # the band's masses: all finite logits', those above the band
        zpart = torch.empty((n, splits, 2), dtype=torch.float64, device=x.device)
    # the list's results (else unused: part stands in)
    listed = part
    if cand:
        # the band (bins, whether listed, whether counted again, sub-bins) and the list's
        # length a row, its candidate list, the list's results
        # (zeroed for top-k's set, whose list starts empty; the band's kernel writes its own)
        cstate = (torch.zeros if cand == 3 else torch.empty)((n, 8), dtype=torch.int32,
                                                             device=x.device)
        cands = torch.empty((n, cap), dtype=torch.float32, device=x.device)
        listed = torch.empty((n, 8), dtype=torch.float64, device=x.device)
    scan_block = _host.block(vocab, THRESHOLD_SCAN_BLOCK)
    scan = functools.partial(
        _host.launch, kernels.threshold_scan_kernel, (n, splits), x.device, rows.x, part, hist,
        zpart, *rows.args[:3], vocab, cols, splits, stride, temperature,
        KEY_SHIFT=_KEY_SHIFT[x.dtype],
        SPLITS=1 << (splits - 1).bit_length(), BLOCK=scan_block,
        num_warps=_host.warps(scan_block),
    )
    passes = ds if cut_k else ds[:1]
    for pass_, (high, low) in enumerate(passes):
        if pass_:
            _host.launch(kernels.threshold_select_kernel, (n,), x.device, hist, splits, stride,
                         top_k, PASS=pass_ - 1, NB=1 << (ds[pass_ - 1][0] - ds[pass_ - 1][1]),
                         num_warps=4)
        scan(SCAN=pass_ == 0, HIST=cut_k, PASS=pass_,
             WINDOW=window and 0 < pass_ == len(passes) - 1, ZSUM=False, DIGIT_HI=high,
             DIGIT_LO=low)
    log_min_p = _float64_bits(math.log(min_p) if min_p > 0.0 else 0.0)
    # top-p's search starts where the logits below hold < 1 − p of the mass together
    bound = math.log((1.0 - top_p) / vocab) - 2.0 if cut_p else 0.0
    if cand:
        cand_scan = functools.partial(
            _host.launch, kernels.threshold_cand_kernel, (n, splits), x.device, rows.x, part,
            hist, zpart, cstate, cands, *rows.args[:3], vocab, cols, splits, stride,
            bins / -bound if cut_p else 1.0, log_min_p, temperature, MIN_P=min_p > 0.0,
            CAP=cap, NBINS=bins, KEY_SHIFT=_KEY_SHIFT[x.dtype],
            SPLITS=1 << (splits - 1).bit_length(), BLOCK=scan_block,
            num_warps=_host.warps(scan_block))
    if cand == 3:  # top-k's last digit selected: the k-th key, then its set listed
        _host.launch(kernels.threshold_select_kernel, (n,), x.device, hist, splits, stride,
                     top_k, PASS=len(ds) - 1, NB=1 << (ds[-1][0] - ds[-1][1]), num_warps=4)
        cand_scan(MODE=3)
    if cand == 2:  # the band's count, the band, its second count where it holds too many,
        # its list and the masses
        band = functools.partial(
            _host.launch, kernels.threshold_band_kernel, (n,), x.device, zpart, hist, cstate,
            splits, stride, _float64_bits(top_p), bins / -bound, CAP=cap,
            NBINS=bins, SPLITS=1 << (splits - 1).bit_length(), num_warps=4)
        cand_scan(MODE=1)
        band(LEVEL=0)
        cand_scan(MODE=4)
        band(LEVEL=1)
        cand_scan(MODE=2)
    if cand:
        _host.launch(kernels.threshold_list_kernel, (n,), x.device, part, zpart, cstate, cands,
                     listed, splits, _float64_bits(top_p), log_min_p, temperature, MODE=cand,
                     CAP=cap, SPLITS=1 << (splits - 1).bit_length(),
                     num_warps=4 if cap <= 1024 else 8)
    if window and len(passes) == 1:  # no later pass of top-k's to count the window in
        scan(SCAN=False, HIST=False, PASS=0, WINDOW=True, ZSUM=zsum, DIGIT_HI=ds[0][0],
             DIGIT_LO=ds[0][1])
    _host.launch(
        kernels.threshold_kernel, (n,), x.device, rows.x, part, hist, zpart, listed,
        out if tauf is None else tauf, out, *rows.args[:3], vocab, splits, stride,
        top_k if cut_k else 0, _float64_bits(top_p), log_min_p, _float64_bits(bound),
        temperature, TOP_K=cut_k, TOP_P=cut_p, MIN_P=min_p > 0.0, HAS_TAU=tauf is not None,
        KEY_SHIFT=_KEY_SHIFT[x.dtype], NB_LAST=1 << (ds[-1][0] - ds[-1][1]), WINDOW=window,
        ZSUM=zsum, CAND=cand,
        SPLITS=1 << (splits - 1).bit_length(), BLOCK=block,
        BT=min(block, 32 * THRESHOLD_WARPS), F=THRESHOLD_BUCKETS,
        num_warps=THRESHOLD_WARPS if block >= 32 * THRESHOLD_WARPS else 1,
    )
    return out


def sampling_threshold_op(x, top_k, top_p, min_p, temperature):  # SCHEMAS["sampling_threshold"]
    """τ (...) float32 of top-k → top-p → min-p sampling on (..., V) logits (the threshold op
    of :mod:`..contract`, :func:`klpenalty.sampling.sampling_threshold`'s rule): −inf where
    nothing is cut, NaN for a row holding NaN; computed by :func:`tau_rows` (float64 logits and
    empty vocabularies: the streaming backend's op)."""
    if _host.portable(x):
        return _host.portable_op("sampling_threshold")(x, top_k, top_p, min_p, temperature)
    contract.check_sampler_args(top_k, top_p, min_p, temperature)
    if not contract.sampler_cuts(x.shape[-1], top_k, top_p, min_p):
        return torch.full(x.shape[:-1], -math.inf, dtype=torch.float32, device=x.device)
    return tau_rows(x, top_k, top_p, min_p, temperature).view(x.shape[:-1])
