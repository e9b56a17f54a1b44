"""The configuration check of the vocabulary-parallel functions.

Every rank all-gathers one fixed-length int64 record (:data:`_RECORD` slots, then
:data:`_SLOTS` per setting of the caller) describing its arguments; every rank then runs the
same comparisons on the same table, so a mismatch raises the same ValueError on every rank
instead of a hang or a wrong result.

Settings: ``(name, value)`` pairs that must be equal on every rank beyond the record's own
fields (the fused heads': hidden sizes, logit transforms, the sampler, ...); the same names in
the same order on every rank (the caller's code fixes them, not the values), a value None, a
bool, an int, a float or a short text (at most 16 bytes of UTF-8).
"""

from __future__ import annotations

import math
import struct
from numbers import Integral
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ._group import _per_rank

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_MAX_DIMS = 8  # leading dims recorded one by one; more are folded into the last slot
# record layout
_ERR, _PDT, _RDT, _NDIM = 0, 1, 2, 3
_DIMS = slice(4, 4 + _MAX_DIMS)
_VS_GIVEN, _VS, _VR, _TEMP, _HAS_MASK, _MASK_N, _MASK_H, _TOK_S, _TOK_H, _TOK_MIN, _TOK_MAX = (
    range(4 + _MAX_DIMS, 15 + _MAX_DIMS)
)
_RECORD = 15 + _MAX_DIMS  # 23 int64 = 184 bytes per rank
# a setting's slots: what its value is (_NONE, _INT, _FLOAT, _TEXT), then its bits
_SLOTS = 3
_NONE, _INT, _FLOAT, _TEXT = range(4)
_TEXT_BYTES = 8 * (_SLOTS - 1)


def _dtype_code(t: object) -> int:
    if isinstance(t, torch.Tensor) and t.dtype in _DTYPES:
        return _DTYPES.index(t.dtype)
    return -1


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _bits_float(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", b))[0]


def _encode(name: str, value: object) -> list[int]:
    """A setting's :data:`_SLOTS` int64."""
    if value is None:
        return [_NONE, 0, 0]
    if isinstance(value, Integral):  # bool included
        return [_INT, int(value), 0]
    if isinstance(value, float):
        return [_FLOAT, _float_bits(value), 0]
    if isinstance(value, str):
        raw = value.encode()
        if len(raw) <= _TEXT_BYTES:
            raw = raw.ljust(_TEXT_BYTES, b"\0")
            return [_TEXT, *(int.from_bytes(raw[i : i + 8], "little", signed=True)
                             for i in range(0, _TEXT_BYTES, 8))]
    raise TypeError(f"setting {name!r}: cannot record {value!r} ({type(value).__name__})")


def _decode(slots: Sequence[int]) -> str:
    """A setting's value as its message shows it."""
    kind, bits = slots[0], slots[1:]
    if kind == _NONE:
        return "None"
    if kind == _INT:
        return str(bits[0])
    if kind == _FLOAT:
        return repr(_bits_float(bits[0]))
    raw = b"".join(b.to_bytes(8, "little", signed=True) for b in bits)
    return repr(raw.rstrip(b"\0").decode())


def _checksums(t: torch.Tensor) -> tuple[int, int]:
    """(Σ t, Σ (i+1)·t_i) over the flattened integer tensor: equal tensors give equal sums."""
    flat = t.reshape(-1).long()  # (N,)
    idx = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.long)
    return int(flat.sum()), int((flat * idx).sum())


def _local_record(
    error: bool,
    policy: object,
    ref: object,
    leading: Sequence[int],
    vocab_start: int | None,
    width: int,
    temperature: float,
    mask: torch.Tensor | None,
    tokens: torch.Tensor | None,
    settings: Sequence[tuple[str, object]] = (),
) -> list[int]:
    rec = [0] * (_RECORD + _SLOTS * len(settings))
    if error:
        rec[_ERR] = 1
        return rec
    for i, (name, value) in enumerate(settings):
        rec[_RECORD + _SLOTS * i : _RECORD + _SLOTS * (i + 1)] = _encode(name, value)
    rec[_PDT], rec[_RDT] = _dtype_code(policy), _dtype_code(ref)
    dims = list(leading)
    if len(dims) > _MAX_DIMS:
        dims = dims[: _MAX_DIMS - 1] + [math.prod(dims[_MAX_DIMS - 1 :])]
    rec[_NDIM] = len(leading)
    rec[_DIMS] = dims + [-1] * (_MAX_DIMS - len(dims))
    rec[_VS_GIVEN] = int(vocab_start is not None)
    rec[_VS] = vocab_start if vocab_start is not None else 0
    rec[_VR] = width
    rec[_TEMP] = _float_bits(temperature)
    if mask is not None:
        rec[_HAS_MASK] = 1
        rec[_MASK_N], rec[_MASK_H] = _checksums(mask)
    if tokens is not None and tokens.numel():
        rec[_TOK_S], rec[_TOK_H] = _checksums(tokens)
        rec[_TOK_MIN], rec[_TOK_MAX] = int(tokens.min()), int(tokens.max())
    return rec


def _gather_records(
    rec: list[int], device: torch.device, group: Any, world: int
) -> list[list[int]]:
    mine = torch.tensor(rec, dtype=torch.long, device=device)  # (_RECORD,)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return torch.stack(out).tolist()  # (world, _RECORD), identical on every rank


def _leading_of(rec: list[int]) -> tuple[int, ...]:
    n = rec[_NDIM]
    dims = rec[_DIMS][: min(n, _MAX_DIMS)]
    return tuple(dims)


def _check_records(
    recs: list[list[int]], caller: str, *, names: tuple[str, str],
    settings: Sequence[str] = (),
) -> None:
    """Compare the gathered records; raise the same ValueError on every rank on a mismatch.

    ``recs`` is identical on every rank, and the checks run in a fixed order, so the message is
    the same everywhere. ``settings``: the names of the settings the records end with.
    """
    bad = [r for r, rec in enumerate(recs) if rec[_ERR]]
    if bad:
        raise ValueError(
            f"{caller}: rank(s) {bad} rejected their own arguments (their error says why); "
            "every rank stops here, before any collective on the logits"
        )
    for slot, name in ((_PDT, names[0]), (_RDT, names[1])):
        codes = [rec[slot] for rec in recs]
        if name and len(set(codes)) > 1:
            dts = [str(_DTYPES[c]) if c >= 0 else "?" for c in codes]
            raise ValueError(f"{caller}: {name} dtype differs across ranks ({_per_rank(dts)})")
    shapes = [(rec[_NDIM], tuple(rec[_DIMS])) for rec in recs]
    if len(set(shapes)) > 1:
        raise ValueError(
            f"{caller}: the leading dims (...) of the shards differ across ranks "
            f"({_per_rank([_leading_of(rec) for rec in recs])}); every rank must hold the "
            "same positions, only the vocabulary is split"
        )
    temps = [rec[_TEMP] for rec in recs]
    if len(set(temps)) > 1:
        raise ValueError(
            f"{caller}: temperature differs across ranks "
            f"({_per_rank([_bits_float(t) for t in temps])})"
        )
    masks = [(rec[_HAS_MASK], rec[_MASK_N], rec[_MASK_H]) for rec in recs]
    if len(set(masks)) > 1:
        desc = [f"{m[1]} True" if m[0] else "None" for m in masks]
        raise ValueError(
            f"{caller}: mask differs across ranks ({_per_rank(desc)}; compared by count and "
            "an index-weighted checksum); every rank must pass the same mask"
        )
    toks = [(rec[_TOK_S], rec[_TOK_H]) for rec in recs]
    if len(set(toks)) > 1:
        raise ValueError(
            f"{caller}: tokens differ across ranks (compared by sum and an index-weighted "
            "checksum); every rank must pass the same tokens"
        )
    for i, name in enumerate(settings):
        at = slice(_RECORD + _SLOTS * i, _RECORD + _SLOTS * (i + 1))
        values = [tuple(rec[at]) for rec in recs]
        if len(set(values)) > 1:
            raise ValueError(
                f"{caller}: {name} differs across ranks "
                f"({_per_rank([_decode(val) for val in values])}); it must be the same on "
                "every rank"
            )
    given = [rec[_VS_GIVEN] for rec in recs]
    if len(set(given)) > 1:
        raise ValueError(
            f"{caller}: vocab_start is given on some ranks and None on others "
            f"({_per_rank(['given' if g else 'None' for g in given])})"
        )
    if given[0]:
        _check_tiling([(rec[_VS], rec[_VS] + rec[_VR]) for rec in recs], caller)


def _check_tiling(spans: list[tuple[int, int]], caller: str) -> None:
    """The slices [start, end) of ranks 0, 1, ... must be back to back from 0, in rank order."""
    expected = 0
    for r, (start, end) in enumerate(spans):
        if start == expected:
            expected = end
            continue
        listing = _per_rank([f"[{a}, {b})" for a, b in spans])
        ordered = sorted(spans)
        if ordered[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ordered, ordered[1:])):
            kind = "they tile it, but not in rank order"
        elif start > expected:
            kind = f"a gap: rank {r} starts at {start} but the slices before it end at {expected}"
        else:
            kind = (
                f"an overlap: rank {r} starts at {start} but the slices before it end at "
                f"{expected}"
            )
        raise ValueError(
            f"{caller}: the vocabulary slices do not tile [0, V) in rank order ({kind}); "
            f"slices: {listing}. Rank r must hold the slice right after rank r-1's."
        )


def _config_check(
    caller: str,
    group: Any,
    world: int,
    device: torch.device,
    local_error: Exception | None,
    *,
    names: tuple[str, str],
    settings: Sequence[tuple[str, object]] = (),
    **fields: Any,
) -> list[list[int]]:
    rec = _local_record(local_error is not None, settings=settings, **fields)
    recs = _gather_records(rec, device, group, world)
    if local_error is not None:
        raise local_error
    _check_records(recs, caller, names=names, settings=[name for name, _ in settings])
    return recs


def _check_vocab_start(vocab_start: object, *, required: bool) -> int | None:
    if vocab_start is None and not required:
        return None
    if isinstance(vocab_start, bool) or not isinstance(vocab_start, Integral):
        raise TypeError(f"vocab_start must be an int, got {type(vocab_start).__name__}")
    if vocab_start < 0:
        raise ValueError(f"vocab_start must be >= 0, got {vocab_start}")
    return int(vocab_start)


# The check as the public docstrings describe it (inserted at their ``{check}``).
_CHECK_DOC = """
    Configuration check (``check=True``, the default): before touching the logits every rank
    all-gathers one record of 53 int64 (424 bytes per rank) holding: whether its own arguments
    passed the local checks, both dtypes, the leading shape, ``vocab_start`` and V_r, the
    temperature, checksums (count and index-weighted sum) of the mask or tokens, and the call's
    settings (whether tokens are given, entropy, the kind of support, top_k / top_p / min_p,
    checksums of global ids and offsets, a divergence's kind and beta / skew). Every rank
    then runs the same comparisons on the same table, so a rank whose leading dims, dtype,
    temperature, mask, tokens or settings differ, or slices that do not tile [0, V) in rank order
    (gap, overlap or wrong order, when ``vocab_start`` is given), raise the *same* ValueError on
    every rank; a rank whose own arguments are invalid raises its error and the others a
    ValueError naming it. Cost: one small all-gather, one device-to-host copy of the table
    (a synchronisation point on GPU) and O(N) local work for the checksums. ``check=False``
    skips all of it; a mismatch then shows up as a wrong result, a crash or a hang in a
    collective. ``check`` must be the same on every rank. Arguments that are not tensors at all
    raise TypeError at once on the rank that passed them.
"""
