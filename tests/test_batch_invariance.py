"""Batch invariance on CPU: a row's outputs (and its gradient) are bit-identical (torch.equal)
whatever else is in the batch, at whatever position, and whatever the chunk plan.

From logits this is klpenalty's own arithmetic, for every input. From hidden states a row's
logits come from torch's GEMM on the chunk that holds it: bf16/fp16 heads (oneDNN) give a row
the same logits for any number of rows M; torch's float32 GEMM (MKL) does only from about 12
rows on, so the float32 cases use chunks of at least 16 rows, and a separate test shows that
klpenalty adds nothing to the GEMM's dependence (docs/numerics.md, "Batch invariance").
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import klpenalty
from klpenalty.linear import linear_kl, linear_logprobs, linear_policy_loss

V, H = 2000, 48  # vocabulary, hidden size
FIELDS = ("kl", "logprobs", "ref_logprobs", "entropy")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _place(row: torch.Tensor, n: int, at: int, seed: int, fill) -> torch.Tensor:
    """(n, ...) batch: ``fill(n, seed)`` with ``row`` written at position ``at``."""
    out = fill(n, seed)
    out[at] = row
    return out


# ------------------------------------------------------------------------------ from logits
# (N, position of the row): alone, first, last, in the middle of batches of several sizes
# (the streaming backend's tiles hold 2**18 // V = 131 rows: N = 150 spans two tiles).
LOGIT_BATCHES = [(1, 0), (2, 1), (7, 3), (64, 0), (150, 140)]


def _logits(n: int, seed: int) -> torch.Tensor:
    """(n, V) float32 logits of std 2, one row in four with −inf on half the vocabulary (the
    streaming backend's careful 0·log 0 arithmetic then runs on the tile) and one row in five
    shifted by +1000 (a large max)."""
    x = torch.randn(n, V, generator=_gen(seed)) * 2.0
    x[::4, : V // 2] = float("-inf")
    x[1::5] += 1000.0
    return x


def _token_stats_row(backend, dtype, temperature, top_p, x, y, tokens, at):
    """Row ``at`` of every one-pass output and of each one-field view, and its gradient."""
    x = x.to(dtype).requires_grad_(True)
    y = y.to(dtype)
    kw = dict(temperature=temperature, backend=backend, top_p=top_p)
    s = klpenalty.token_stats(x, y, tokens, entropy=True, **kw)
    (grad,) = torch.autograd.grad(sum(t.sum() for t in s), x)
    views = (
        klpenalty.full_kl(x, y, **kw),
        klpenalty.token_logprobs(x, tokens, **kw),
        klpenalty.entropy(x, **kw),
    )
    return [t[at] for t in (*s, *views, grad)]


@pytest.mark.parametrize("top_p", [None, 0.9])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["streaming", "native"])
def test_token_stats_row_is_bit_identical_whatever_the_batch(backend, dtype, temperature, top_p):
    g = _gen(1)
    xr, yr = torch.randn(V, generator=g) * 2.0, torch.randn(V, generator=g) * 2.0
    token = torch.argmax(xr)  # inside any top-p support
    results = []
    for seed, (n, at) in enumerate(LOGIT_BATCHES):
        x = _place(xr, n, at, 10 + seed, _logits)
        y = _place(yr, n, at, 20 + seed, _logits)
        tokens = torch.argmax(x, -1)
        tokens[at] = token
        results.append(_token_stats_row(backend, dtype, temperature, top_p, x, y, tokens, at))
    alone = results[0]
    for (n, at), got in zip(LOGIT_BATCHES[1:], results[1:]):
        for k, (a, b) in enumerate(zip(alone, got)):
            assert torch.equal(a, b), f"output {k} of the row at {at} among {n} rows"


# ------------------------------------------------------------------------------ torch's GEMM
def test_torch_cpu_gemm_gives_a_row_the_same_product_for_these_row_counts():
    """What the hidden-state tests rest on (torch's, not klpenalty's): bf16/fp16 products of
    a row are the same for any M; float32 products for M >= 16 rows."""
    w = torch.randn(V, H, generator=_gen(2))
    x = torch.randn(96, H, generator=_gen(3))
    dz = torch.randn(96, V, generator=_gen(4))
    for dtype, counts in ((torch.bfloat16, (1, 2, 5, 16, 37)), (torch.float16, (1, 5, 37)),
                          (torch.float32, (16, 17, 48))):
        wd, xd, dzd = w.to(dtype), x.to(dtype), dz.to(dtype)
        full, back = F.linear(xd, wd), dzd @ wd  # (96, V): the head; (96, H): grad_h
        for m in counts:
            for r0 in (0, 96 - m):
                sl = slice(r0, r0 + m)
                assert torch.equal(F.linear(xd[sl], wd), full[sl]), (dtype, m, r0)
                assert torch.equal(dzd[sl] @ wd, back[sl]), (dtype, m, r0)


# ------------------------------------------------------------------------------ hidden states
def _hidden(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, H, generator=_gen(seed))


def _heads(dtype):
    g = _gen(5)
    wp = (torch.randn(V, H, generator=g) * 0.3).to(dtype)
    wr = (torch.randn(V, H, generator=g) * 0.3).to(dtype)
    return wp, wr


def _plans(dtype):
    """(batches (N, position of the row), chunk_rows values): for float32 heads every chunk
    has 16 rows or a multiple (2N/3 rows count, see _row_inputs; the GEMM test above); any
    for bf16/fp16."""
    if dtype == torch.float32:
        return [(24, 3), (72, 0), (72, 71), (144, 50)], [16, 48, None]
    return [(1, 0), (5, 4), (37, 17), (64, 50)], [1, 16, 48, None]


def _row_inputs(n, at, seed, dtype, hp_row, hr_row, wp):
    """Both models' hidden states (n, H) with the row at ``at``, the tokens (each row's most
    likely one: inside any top-p support), and a mask that leaves out one other row in three
    (their hidden states are NaN: never read)."""
    hp = _place(hp_row, n, at, 100 + seed, _hidden)
    hr = _place(hr_row, n, at, 200 + seed, _hidden)
    tokens = F.linear(hp.to(dtype), wp).argmax(-1)
    mask = torch.ones(n, dtype=torch.bool)
    mask[(at + 1) % 3::3] = False
    mask[at] = True
    hp[~mask] = float("nan")
    return hp.to(dtype), hr.to(dtype), tokens, mask


def _each_plan(dtype, wp):
    """Yield (n, at, chunk_rows, hp, hr, tokens, mask) over the batches and plans."""
    g = _gen(6)
    hp_row, hr_row = torch.randn(H, generator=g), torch.randn(H, generator=g)
    batches, chunks = _plans(dtype)
    for seed, (n, at) in enumerate(batches):
        hp, hr, tokens, mask = _row_inputs(n, at, seed, dtype, hp_row, hr_row, wp)
        for chunk_rows in chunks:
            yield n, at, chunk_rows, hp, hr, tokens, mask


def _assert_all_equal(rows: list, what: str) -> None:
    (n0, at0, c0), first = rows[0]
    for (n, at, c), got in rows[1:]:
        for k, (a, b) in enumerate(zip(first, got)):
            assert torch.equal(a, b), (
                f"{what} output {k}: the row at {at} of {n} with chunk_rows={c} differs from "
                f"the row at {at0} of {n0} with chunk_rows={c0}"
            )


@pytest.mark.parametrize("sampler", [dict(), dict(temperature=0.7, top_p=0.9)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_linear_kl_row_and_its_hidden_gradient_are_bit_identical_whatever_the_batch_and_plan(
    dtype, sampler
):
    wp, wr = _heads(dtype)
    rows = []
    for n, at, chunk_rows, hp, hr, tokens, mask in _each_plan(dtype, wp):
        hp = hp.clone().requires_grad_(True)
        s = linear_kl(hp, wp, hr, wr, tokens=tokens, mask=mask, entropy=True,
                      chunk_rows=chunk_rows, **sampler)
        (grad,) = torch.autograd.grad(sum(t.sum() for t in s), hp)
        rows.append(((n, at, chunk_rows), [*(t[at] for t in s), grad[at]]))
    _assert_all_equal(rows, "linear_kl")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_logprobs_row_is_bit_identical_whatever_the_batch_and_plan(dtype):
    wp, _ = _heads(dtype)
    rows = []
    for n, at, chunk_rows, hp, _, tokens, mask in _each_plan(dtype, wp):
        s = linear_logprobs(hp, wp, tokens, mask=mask, entropy=True, chunk_rows=chunk_rows)
        rows.append(((n, at, chunk_rows), [s.logprobs[at], s.entropy[at]]))
    _assert_all_equal(rows, "linear_logprobs")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_policy_loss_row_and_its_hidden_gradient_are_bit_identical_with_sum_reduction(
    dtype,
):
    """Per-row metrics, and the row's hidden-state gradient under ``reduction="sum"`` (a mean
    divides by the batch's token count, so its per-row gradient depends on the batch by
    definition)."""
    wp, wr = _heads(dtype)
    rows = []
    for n, at, chunk_rows, hp, hr, tokens, mask in _each_plan(dtype, wp):
        adv = torch.randn(n, generator=_gen(n))
        old = torch.full((n,), -8.0)
        adv[at], old[at] = 0.5, -7.9
        hp = hp.clone().requires_grad_(True)
        out = linear_policy_loss(hp, wp, hr, wr, tokens, beta=0.1, advantages=adv,
                                 old_logprobs=old, mask=mask, reduction="sum",
                                 chunk_rows=chunk_rows)
        (grad,) = torch.autograd.grad(out.loss, hp)
        per_row = (out.kl, out.logprobs, out.ref_logprobs, out.ratio, out.clipped, grad)
        rows.append(((n, at, chunk_rows), [t[at] for t in per_row]))
    _assert_all_equal(rows, "linear_policy_loss")


@pytest.mark.parametrize("chunk_rows", [1, 5, 16])
def test_linear_kl_float32_row_is_the_engine_on_the_gemm_of_its_chunk(chunk_rows):
    """Whatever the GEMM does with M, klpenalty adds no dependence of its own: a row's output
    is token_stats on the logits torch's GEMM gives its chunk."""
    wp, wr = _heads(torch.float32)
    n = 37
    hp, hr = _hidden(n, 8), _hidden(n, 9)
    tokens = torch.randint(0, V, (n,), generator=_gen(10))
    s = linear_kl(hp, wp, hr, wr, tokens=tokens, entropy=True, chunk_rows=chunk_rows)
    for r0 in range(0, n, chunk_rows):
        sl = slice(r0, min(n, r0 + chunk_rows))
        want = klpenalty.token_stats(F.linear(hp[sl], wp), F.linear(hr[sl], wr), tokens[sl],
                                     entropy=True)
        for name in FIELDS:
            assert torch.equal(getattr(s, name)[sl], getattr(want, name)), (name, r0)


# ------------------------------------------------------------------------------ Hugging Face
def _llama(seed: int, dtype) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval().to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_causal_lm_kl_of_a_sequence_is_bit_identical_alone_or_among_padded_sequences(dtype):
    """A 20-token sequence alone, and third of four with one right-padded and one left-padded
    neighbour (19 scored rows alone: float32 chunks of >= 16 rows). The body's hidden states
    are torch's; they are checked first, so that a failure there is named as such."""
    from klpenalty.hf import causal_lm_kl, generate_position_ids

    policy, ref = _llama(1, dtype), _llama(2, dtype).requires_grad_(False)
    t = 20
    seq = torch.randint(3, V, (1, t), generator=_gen(11))
    ids = torch.randint(3, V, (4, t), generator=_gen(12))
    ids[2] = seq[0]
    attention = torch.ones(4, t, dtype=torch.long)
    attention[0, -6:] = 0  # right padding
    attention[1, :5] = 0  # left padding
    ids[attention == 0] = 0
    alone = causal_lm_kl(policy, ref, seq, torch.ones(1, t, dtype=torch.long),
                                      entropy=True)
    batch = causal_lm_kl(policy, ref, ids, attention, entropy=True)
    with torch.no_grad():
        h_alone = policy.model(input_ids=seq).last_hidden_state[0]
        h_batch = policy.model(
            input_ids=ids, attention_mask=attention,
            position_ids=generate_position_ids(attention),
        ).last_hidden_state[2]
    assert torch.equal(h_alone, h_batch), "the model body (torch) is not batch-invariant here"
    for name in FIELDS:
        assert torch.equal(getattr(alone, name)[0], getattr(batch, name)[2]), name
