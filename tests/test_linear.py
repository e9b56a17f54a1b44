"""klpenalty.linear_kl against materialised logits and the float64 reference.

Shape letters: N rows, H hidden (H_p policy, H_r reference), V vocabulary.

How the comparisons isolate the errors: the fast path computes each chunk's logits with
``F.linear`` in the *input* dtype (bf16/fp16 on CPU: in float32 on the upcast operands), upcasts
them to float32 before a scale or soft-cap (:func:`tests.helpers.fused_logits`), then the
engine. For float64 inputs everything is compared
with plain float64 autograd through ``F.linear`` and the reference formulas. For float32 and
bfloat16 inputs the reference is evaluated on *the same logits the fast path saw* (the input-dtype
logits, upcast exactly), while its derivatives still flow through a float64 ``F.linear`` graph
(the input-dtype logit values are substituted with a straight-through ``z64 + (z − z64).detach()``).
So the value error is the engine's alone (the tolerance table's entry for that input dtype), and
the gradient error is the engine's ∂/∂z rounded to the input dtype plus the input-dtype GEMMs of
the chain rule (the table's gradient entry for that dtype, relative to the largest entry).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import klpenalty
from klpenalty.bench import alloc_profile
from klpenalty import (
    TokenStats,
    full_kl_reward_and_loss,
    k3_ratio_loss,
    linear_kl,
    next_token_kl,
    token_logprobs,
)
from klpenalty import linear
from klpenalty.linear import _heads as heads
from klpenalty.linear import default_chunk_rows
from klpenalty.linear import kl as kl_module
from klpenalty.ops.reference import (
    entropy_reference,
    full_kl_reference,
    token_logprobs_reference,
)

from .helpers import GRAD_REL_TOL, fused_logits, tol, triton_interpreter_env

BACKENDS = ["streaming", "native"]
NAMES = ("hp", "wp", "bp", "hr", "wr", "br")


# --------------------------------------------------------------------------- helpers
def make_heads(leading, h_p=12, h_r=9, vocab=37, dtype=torch.float32, *, seed=0, bias=True):
    """Hidden states and LM heads of two models whose logits are O(3) and KL ~ 0.1-1."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    wp = rnd(vocab, h_p) * (2.0 / math.sqrt(h_p))
    wr = rnd(vocab, h_r) * (2.0 / math.sqrt(h_r))
    t = {
        "hp": rnd(*leading, h_p),
        "wp": wp,
        "bp": rnd(vocab) * 0.5 if bias else None,
        "hr": rnd(*leading, h_r),
        "wr": wr,
        "br": rnd(vocab) * 0.5 if bias else None,
    }
    return {k: (None if x is None else x.to(dtype)) for k, x in t.items()}


def make_tokens(leading, vocab, *, seed=1, ignored=0.2):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, leading, generator=g)
    return tokens.masked_fill(torch.rand(leading, generator=g) < ignored, -100)


def make_mask(leading, *, seed=2):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(leading, generator=g) < 0.7
    mask.view(-1)[0] = True
    return mask


def call(t, **kw):
    """linear_kl on the dict of tensors ``t``."""
    return linear_kl(
        t["hp"], t["wp"], t["hr"], t["wr"], policy_bias=t["bp"], ref_bias=t["br"], **kw
    )


def reference(t, *, tokens=None, mask=None, temperature=1.0, logit_scale=1.0, softcap=None,
              ref_logit_scale=None, ref_softcap=None, entropy=False, same_logits=True, **_):
    """Float64 outputs (kl, logprobs, ref_logprobs, entropy; None where not asked) and the
    float64 leaves they are differentiable in (a dict like ``t``).

    ``same_logits``: for non-float64 inputs, substitute the values of the input-dtype logits
    (see the module docstring); masked rows are zeroed before the matmul so that their garbage
    never enters the graph.
    """
    scale_r = logit_scale if ref_logit_scale is None else ref_logit_scale
    cap_r = softcap if ref_softcap is None else ref_softcap
    leaves = {k: None if x is None else x.detach().double().requires_grad_() for k, x in t.items()}
    keep = None if mask is None else mask.unsqueeze(-1)

    def logits(side, scale, cap):
        h, w, b = (f"h{side}", f"w{side}", f"b{side}")
        h64, hin = leaves[h], t[h].detach()
        if keep is not None:
            h64, hin = torch.where(keep, h64, 0.0), torch.where(keep, hin, 0.0)
        z64 = fused_logits(h64, leaves[w], leaves[b], scale, cap)
        if same_logits and t[h].dtype != torch.float64:
            bias = None if t[b] is None else t[b].detach()
            z = fused_logits(hin, t[w].detach(), bias, scale, cap).double()
            z64 = z64 + (z - z64).detach()
        return z64

    zp, zr = logits("p", logit_scale, softcap), logits("r", scale_r, cap_r)
    outs = [full_kl_reference(zp, zr, temperature), None, None, None]
    if tokens is not None:
        ignored = tokens == -100
        safe = tokens.masked_fill(ignored, 0)
        outs[1] = token_logprobs_reference(zp, safe, temperature).masked_fill(ignored, 0.0)
        outs[2] = token_logprobs_reference(zr, safe, temperature).masked_fill(ignored, 0.0)
    if entropy:
        outs[3] = entropy_reference(zp, temperature)
    if mask is not None:
        outs = [None if o is None else torch.where(mask, o, 0.0) for o in outs]
    return outs, leaves


def close_values(got, want, dtype):
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            assert g.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
            torch.testing.assert_close(g.double(), w, **tol(dtype))


def close_grad(got, want, dtype, name=""):
    """Gradients relative to the largest entry, with the table's entry for ``dtype``."""
    rel = GRAD_REL_TOL[dtype]
    scale = max(float(want.abs().max()), 1e-30) if want.numel() else 1.0
    assert got.dtype == dtype, name
    torch.testing.assert_close(got.double(), want, atol=rel * scale, rtol=rel, msg=lambda m: f"{name}: {m}")


def upstream(outs, seed=3):
    """Non-unit upstream gradients (one per present output)."""
    g = torch.Generator().manual_seed(seed)
    return [None if o is None else
            (torch.randn(o.shape, generator=g, dtype=torch.float64) * 1.7).to(o.device)
            for o in outs]


def loss_of(outs, grads):
    return sum((o.double() * g).sum() for o, g in zip(outs, grads) if o is not None and g is not None)


def check_against_reference(t, dtype, want_grad=NAMES, **kw):
    """linear_kl vs the float64 reference: values and the gradients of ``want_grad``."""
    for k in want_grad:
        if t[k] is not None:
            t[k].requires_grad_()
    got = call(t, **kw)
    want, leaves = reference(t, **kw)
    close_values(got, want, dtype)
    grads = upstream(want)
    names = [k for k in want_grad if t[k] is not None]
    got_g = torch.autograd.grad(loss_of(got, grads), [t[k] for k in names])
    want_g = torch.autograd.grad(loss_of(want, grads), [leaves[k] for k in names])
    for k, a, b in zip(names, got_g, want_g):
        close_grad(a, b, dtype, k)
    return got, dict(zip(names, got_g))


# --------------------------------------------------------------------------- values and grads
TRANSFORMS = [
    dict(),
    dict(temperature=0.7),
    dict(logit_scale=1.7, softcap=4.0),  # both models soft-capped and scaled alike
    dict(logit_scale=0.8, softcap=None, ref_logit_scale=1.3, ref_softcap=2.5, temperature=1.3),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transform", TRANSFORMS, ids=lambda d: ",".join(d) or "plain")
def test_values_and_all_grads_match_reference(backend, dtype, transform):
    leading = (2, 7)
    t = make_heads(leading, dtype=dtype)
    tokens, mask = make_tokens(leading, 37), make_mask(leading)
    t["hp"][~mask] = float("nan")  # masked rows hold garbage, never multiplied
    t["hr"][~mask] = float("inf")
    got, grads = check_against_reference(
        t, dtype, tokens=tokens, mask=mask, entropy=True, chunk_rows=3, backend=backend,
        **transform,
    )
    assert isinstance(got, TokenStats) and all(o.shape == leading for o in got)
    assert all(torch.all(o[~mask] == 0) for o in got)
    assert torch.all(got.logprobs[tokens == -100] == 0)
    assert torch.all(grads["hp"][~mask] == 0) and torch.all(grads["hr"][~mask] == 0)
    assert all(torch.isfinite(g).all() for g in grads.values())


# the interpreter evaluates masked-off lanes too (−inf − −inf): numpy warns, the kernels guard
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_backend(dtype):
    """The Triton kernels on each chunk: compiled on a GPU, in Triton's interpreter on CPU."""
    pytest.importorskip("triton", reason="Triton is not installed: pip install 'klpenalty[triton]'")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    leading = (2, 5)
    t = {k: x.to(device) for k, x in make_heads(leading, dtype=dtype, seed=22).items()}
    tokens, mask = make_tokens(leading, 37).to(device), make_mask(leading).to(device)
    with triton_interpreter_env():
        check_against_reference(t, dtype, tokens=tokens, mask=mask, entropy=True, softcap=4.0,
                                temperature=0.9, chunk_rows=3, backend="triton")


@pytest.mark.parametrize("output", ["kl", "logprobs", "ref_logprobs", "entropy"])
def test_gradient_from_each_output_alone(output):
    leading = (9,)
    t = make_heads(leading, dtype=torch.float64, seed=4)
    for k in NAMES:
        t[k].requires_grad_()
    tokens = make_tokens(leading, 37, seed=5)
    kw = dict(tokens=tokens, entropy=True, temperature=0.9, softcap=3.0, chunk_rows=4)
    got = call(t, **kw)
    want, leaves = reference(t, **kw)
    k = TokenStats._fields.index(output)
    g = torch.linspace(-2.0, 3.0, 9, dtype=torch.float64)
    got_g = torch.autograd.grad((getattr(got, output) * g).sum(), [t[n] for n in NAMES],
                                allow_unused=True)
    want_g = torch.autograd.grad((want[k] * g).sum(), [leaves[n] for n in NAMES],
                                 allow_unused=True)
    for n, a, b in zip(NAMES, got_g, want_g):
        if b is None:  # e.g. the reference side of the policy entropy: nothing flows there
            assert a is None or torch.all(a == 0), n
        else:
            close_grad(a, b, torch.float64, n)


@pytest.mark.parametrize("kl_in_loss", [False, True])
def test_reference_logits_are_recomputed_only_when_a_gradient_needs_them(monkeypatch, kl_in_loss):
    """A frozen reference and no KL gradient (the KL detached into the reward, log-probs in the
    loss): the backward multiplies the policy's head only; with the KL in the loss, both."""
    leading = (7,)
    t = make_heads(leading, dtype=torch.float64, seed=8)
    for k in ("hp", "wp", "bp"):
        t[k].requires_grad_()
    tokens = make_tokens(leading, 37, seed=2)
    got = call(t, tokens=tokens, entropy=True, temperature=0.9, chunk_rows=3)
    calls = []
    original = kl_module._logits
    monkeypatch.setattr(kl_module, "_logits", lambda h, w, *a: calls.append(w) or original(h, w, *a))
    loss = got.logprobs.sum() - 0.1 * got.entropy.sum() + (got.kl.sum() if kl_in_loss else 0)
    grads = torch.autograd.grad(loss, [t["hp"], t["wp"], t["bp"]])
    ref_calls = sum(w is t["wr"] for w in calls)
    assert ref_calls == (3 if kl_in_loss else 0) and len(calls) - ref_calls == 3  # 3 chunks
    want, leaves = reference(t, tokens=tokens, entropy=True, temperature=0.9)
    wloss = want[1].sum() - 0.1 * want[3].sum() + (want[0].sum() if kl_in_loss else 0)
    want_g = torch.autograd.grad(wloss, [leaves["hp"], leaves["wp"], leaves["bp"]])
    for n, a, b in zip(("hp", "wp", "bp"), grads, want_g):
        close_grad(a, b, torch.float64, n)


def test_reference_side_gets_gradients_only_where_asked():
    leading = (3, 4)
    t = make_heads(leading, dtype=torch.float32, seed=6)
    for k in ("hp", "wp", "bp", "wr"):  # the reference's hidden states and bias are frozen
        t[k].requires_grad_()
    got = call(t, tokens=make_tokens(leading, 37), temperature=0.8)
    (got.kl.sum() + got.ref_logprobs.sum()).backward()
    assert t["hr"].grad is None and t["br"].grad is None
    assert t["wr"].grad is not None and t["wr"].grad.abs().max() > 0
    check_against_reference(make_heads(leading, dtype=torch.float32, seed=6), torch.float32,
                            want_grad=("hp", "wr"), tokens=make_tokens(leading, 37),
                            temperature=0.8)


def test_frozen_reference_and_no_bias():
    leading = (5, 3)
    t = make_heads(leading, h_p=16, h_r=7, vocab=50, dtype=torch.float32, seed=7, bias=False)
    got, _ = check_against_reference(t, torch.float32, want_grad=("hp", "wp"), mask=make_mask(leading))
    assert got.logprobs is None and got.ref_logprobs is None and got.entropy is None


@pytest.mark.parametrize("leading", [(), (6,), (2, 2, 3)])
def test_leading_dims_and_mixed_dtypes(leading):
    t = make_heads(leading, dtype=torch.float32, seed=8)
    t["hr"], t["wr"], t["br"] = (x.bfloat16() for x in (t["hr"], t["wr"], t["br"]))
    tokens = make_tokens(leading, 37, ignored=0.0)
    got = call(t, tokens=tokens, entropy=True)
    want, _ = reference(t, tokens=tokens, entropy=True)
    assert all(o.shape == leading and o.dtype == torch.float32 for o in got)
    close_values(got, want, torch.bfloat16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_equals_the_public_functions_on_materialised_logits(backend):
    leading = (3, 5)
    t = make_heads(leading, dtype=torch.float32, seed=19)
    tokens, mask = make_tokens(leading, 37, seed=20), make_mask(leading, seed=21)
    kw = dict(temperature=0.8, backend=backend)
    got = call(t, tokens=tokens, mask=mask, entropy=True, logit_scale=1.5, softcap=6.0,
               chunk_rows=4, **kw)
    zp = fused_logits(t["hp"], t["wp"], t["bp"], 1.5, 6.0)  # (3, 5, V)
    zr = fused_logits(t["hr"], t["wr"], t["br"], 1.5, 6.0)
    want = (
        klpenalty.full_kl(zp, zr, mask=mask, **kw),
        token_logprobs(zp, tokens.masked_fill(~mask, -100), **kw),
        token_logprobs(zr, tokens.masked_fill(~mask, -100), **kw),
        klpenalty.entropy(zp, mask=mask, **kw),
    )
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol(torch.float32))


# --------------------------------------------------------------------------- chunking
def test_chunk_size_invariance(monkeypatch):
    leading = (2, 5)  # N = 10
    t = make_heads(leading, dtype=torch.float32, seed=9)
    tokens, mask = make_tokens(leading, 37, seed=10), make_mask(leading, seed=11)
    results = []
    # None: the default plan (one chunk at this size); "plan": the default plan with a budget
    # small enough for several balanced chunks
    for chunk in (1, 3, 10, 25, None, "plan"):
        u = {k: x.detach().clone().requires_grad_() for k, x in t.items()}
        with monkeypatch.context() as m:
            if chunk == "plan":
                m.setattr(heads, "CPU_MIN_CHUNK_BYTES", 3 * 37 * 4 * 5)  # R = 5 rows
                m.setattr(heads, "CPU_MIN_CHUNK_ROWS", 1)
                m.setattr(heads, "CPU_CHUNK_MULTIPLE", 1)
                m.setattr(heads, "CHUNK_BUDGET_HEADS", 0.0)
                m.setattr(kl_module, "_LinearKL", counting_chunks(-(-int(mask.sum()) // 5)))
                chunk = None
            got = call(u, tokens=tokens, mask=mask, entropy=True, softcap=5.0, chunk_rows=chunk)
            grads = upstream(got, seed=12)
            loss_of(got, grads).backward()
        results.append((got, {k: u[k].grad for k in NAMES}))
    (base, base_g), rest = results[0], results[1:]
    for got, g in rest:
        for a, b in zip(got, base):
            torch.testing.assert_close(a, b, **tol(torch.float32))
        for k in NAMES:
            close_grad(g[k], base_g[k].double(), torch.float32, k)


def counting_chunks(expected_chunks):
    """A _LinearKL whose forward checks that the plan it got makes ``expected_chunks`` chunks
    of the counted rows (the mask's), of sizes that differ by at most one row."""
    base = kl_module._LinearKL

    class Counting(base):
        @staticmethod
        def forward(ctx, hp, wp, bp, hr, wr, br, tokens, rows, opts):
            m = hp.shape[0] if rows is None else rows.shape[0]
            sizes = _chunks(m, opts.chunk)
            assert len(sizes) == expected_chunks and max(sizes) - min(sizes) <= 1, sizes
            return base.forward(ctx, hp, wp, bp, hr, wr, br, tokens, rows, opts)

    return Counting


def _chunks(n, rows):
    """The chunk sizes of N rows walked R at a time."""
    return [min(rows, n - r0) for r0 in range(0, n, rows)]


def test_default_chunk_rows_values(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(heads, "_host_memory", lambda: 64 << 30)
    big = 1 << 20
    # one head's bytes of three (R, V) float32 buffers: R ≈ H/3 rows whatever V, a multiple
    # of 16; bf16 heads: half
    assert default_chunk_rows(big, 151936, cpu, 896) == 288
    assert default_chunk_rows(big, 32000, cpu, 896) == 288
    assert default_chunk_rows(big, 32000, cpu, 512) == 160
    assert default_chunk_rows(big, 151936, cpu, 4096) == 1360
    assert default_chunk_rows(big, 151936, cpu, 896, torch.bfloat16) == 144
    assert default_chunk_rows(big, 151936, cpu, 896, torch.float64) == 288
    # the floor: 48 MiB (small heads, or the head unknown), at least 16 rows
    assert default_chunk_rows(4096, 32000, cpu) == 128
    assert default_chunk_rows(4096, 32000, cpu, 64) == 128
    assert default_chunk_rows(4096, 1 << 24, cpu) == 16
    # the cap: 1/8 of the physical memory (here 1 GiB -> 128 MiB)
    monkeypatch.setattr(heads, "_host_memory", lambda: 1 << 30)
    assert default_chunk_rows(big, 151936, cpu, 4096) == (128 << 20) // (3 * 151936 * 4) // 16 * 16
    # an explicit budget replaces the rule's (no floor, no cap)
    assert default_chunk_rows(big, 32000, cpu, 512, budget=3 * 32000 * 4 * 100) == 96
    # clipped to N, balanced chunks: 300 rows at R = 288 are two chunks of 150 -> 160 rows
    monkeypatch.setattr(heads, "_host_memory", lambda: 64 << 30)
    assert default_chunk_rows(300, 151936, cpu, 896) == 160
    assert default_chunk_rows(288, 151936, cpu, 896) == 288
    assert default_chunk_rows(10, 32000, cpu, 896) == 10 and default_chunk_rows(0, 5, cpu) == 1


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_default_chunk_rows_properties(monkeypatch, device):
    """Multiples, the budget bound, balanced chunks and the clip to N, over a grid of shapes."""
    dev = torch.device(device)
    memory = 8 << 30
    monkeypatch.setattr(heads, "_physical_memory", lambda d: memory)
    cpu = device == "cpu"
    multiple = 16 if cpu else 128
    low, high = (16, None) if cpu else (1024, 2048)
    fraction = linear.CPU_MAX_MEMORY_FRACTION if cpu else linear.ACCEL_MAX_MEMORY_FRACTION
    for vocab in (37, 2048, 32000, 151936, 262144, 1 << 24):
        for hidden in (None, 16, 512, 896, 4096, 16384):
            for dtype in (torch.float32, torch.bfloat16, torch.float64):
                head = 0 if hidden is None else vocab * hidden * dtype.itemsize
                budget = min(max(head, linear.CPU_MIN_CHUNK_BYTES if cpu else 0),
                             int(memory * fraction))
                buf = 8 if dtype == torch.float64 else 4
                r_max = default_chunk_rows(1 << 40, vocab, dev, hidden, dtype)
                assert r_max % multiple == 0 and r_max >= low
                assert high is None or r_max <= high
                # the budget bound, unless at the rows floor
                assert 3 * r_max * vocab * buf <= budget or r_max == low
                # the largest multiple within the budget (and the rows bounds)
                within = budget // (3 * vocab * buf) // multiple * multiple
                assert r_max == max(low, within if high is None else min(high, within))
                for n in (0, 1, 15, 17, r_max - 1, r_max, r_max + 1, 3 * r_max + 5, 10 * r_max):
                    rows = default_chunk_rows(n, vocab, dev, hidden, dtype)
                    assert 1 <= rows <= max(n, 1) and rows <= r_max
                    if n <= r_max:
                        assert rows == max(n, 1)  # one chunk
                        continue
                    sizes = _chunks(n, rows)
                    assert rows % multiple == 0
                    assert len(sizes) == -(-n // r_max)  # as few chunks as R allows
                    # equal sizes up to the multiple: ceil(N/chunks) rounded up
                    assert rows - multiple < -(-n // len(sizes)) <= rows


def test_default_chunk_rows_errors():
    cpu = torch.device("cpu")
    with pytest.raises(TypeError, match="n_rows must be an int"):
        default_chunk_rows(2.0, 5, cpu)
    with pytest.raises(ValueError, match="vocab must be >= 0"):
        default_chunk_rows(2, -1, cpu)
    with pytest.raises(ValueError, match="hidden must be >= 1"):
        default_chunk_rows(2, 5, cpu, 0)
    with pytest.raises(ValueError, match="budget must be >= 1"):
        default_chunk_rows(2, 5, cpu, 4, budget=0)
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
        default_chunk_rows(2, 5, cpu, 4, torch.int64)


def test_default_plan_reads_both_heads(monkeypatch):
    """linear_kl and linear_policy_loss plan from the larger hidden size and the wider
    weight dtype of the two heads."""
    seen = []
    real = linear.default_chunk_rows

    def spy(n, vocab, device, hidden=None, dtype=torch.float32, budget=None):
        seen.append((n, vocab, hidden, dtype))
        return real(n, vocab, device, hidden, dtype, budget)

    monkeypatch.setattr(heads, "default_chunk_rows", spy)
    t = make_heads((2, 3), h_p=12, h_r=9, dtype=torch.float32)
    call(t)
    t64 = dict(t, wr=t["wr"].double(), hr=t["hr"].double(), br=t["br"].double())
    call(t64, mask=make_mask((2, 3)))
    tokens = make_tokens((2, 3), 37, ignored=0.0)
    klpenalty.linear_policy_loss(t["hp"], t["wp"], t["hr"], t["wr"], tokens, beta=0.1)
    m = int(make_mask((2, 3)).sum())
    assert seen == [(6, 37, 12, torch.float32), (m, 37, 12, torch.float64),
                    (6, 37, 12, torch.float32)]


# --------------------------------------------------------------------------- edge cases
def test_empty_batch():
    t = make_heads((0,), dtype=torch.float32)
    for k in NAMES:
        t[k].requires_grad_()
    got = call(t, tokens=torch.zeros(0, dtype=torch.long), entropy=True)
    assert all(o.shape == (0,) for o in got)
    loss_of(got, [torch.ones(0, dtype=torch.float64)] * 4).backward()
    for k in NAMES:
        assert t[k].grad is not None and t[k].grad.shape == t[k].shape and not t[k].grad.any()
    t = make_heads((2, 0), dtype=torch.float32)
    assert call(t).kl.shape == (2, 0)


def test_vocabulary_of_one():
    leading = (4,)
    t = make_heads(leading, vocab=1, dtype=torch.float64, seed=13)
    got, _ = check_against_reference(t, torch.float64, tokens=torch.zeros(4, dtype=torch.long),
                                  entropy=True)
    for o in got:
        assert torch.all(o == 0)


def test_all_rows_masked_cost_nothing():
    leading = (3, 2)
    t = make_heads(leading, dtype=torch.float32)
    t["hp"].fill_(float("nan"))
    for k in NAMES:
        t[k].requires_grad_()
    got = call(t, mask=torch.zeros(leading, dtype=torch.bool), entropy=True)
    assert all(torch.all(o == 0) for o in (got.kl, got.entropy))
    (got.kl.sum() + got.entropy.sum()).backward()
    assert all(not t[k].grad.any() for k in NAMES)


def test_identical_models_give_zero_kl_and_zero_gradient():
    t = make_heads((6,), dtype=torch.float32, seed=14)
    t["hr"], t["wr"], t["br"] = t["hp"], t["wp"], t["bp"]
    t["hp"].requires_grad_()
    got = call(t, chunk_rows=4)
    assert torch.all(got.kl == 0)
    (g,) = torch.autograd.grad(got.kl.sum(), [t["hp"]])
    assert g.abs().max() < 1e-6


def test_second_derivative_raises():
    t = make_heads((4,), dtype=torch.float64)
    t["hp"].requires_grad_()
    kl = call(t).kl
    (g,) = torch.autograd.grad(kl.sum(), [t["hp"]], create_graph=True)
    with pytest.raises(RuntimeError):
        torch.autograd.grad(g.sum(), [t["hp"]])


# --------------------------------------------------------------------------- loss forms
def test_loss_forms_match_materialised_logits():
    """next_token_kl(kl) as reward + kl as loss, and k3_ratio_loss on the log-probs, give the
    gradients of full_kl_reward_and_loss / k3_ratio_loss on materialised logits."""
    leading = (3, 6)  # (B, T)
    t = make_heads(leading, dtype=torch.float64, seed=15)
    mask = make_mask(leading, seed=16)
    tokens = make_tokens(leading, 37, seed=17).masked_fill(~mask, -100)
    weights = torch.linspace(0.5, 2.0, 6, dtype=torch.float64)
    for k in ("hp", "wp", "bp"):
        t[k].requires_grad_()
    got = call(t, tokens=tokens, mask=mask, temperature=0.9)
    reward = next_token_kl(got.kl, mask)
    loss = (got.kl * weights).sum() + k3_ratio_loss(got.logprobs, got.ref_logprobs, mask=mask).sum()
    grads = torch.autograd.grad(loss, [t[k] for k in ("hp", "wp", "bp")])

    u = {k: None if x is None else x.detach().clone().requires_grad_(k in ("hp", "wp", "bp"))
         for k, x in t.items()}
    zp = F.linear(u["hp"], u["wp"], u["bp"])  # (B, T, V), materialised
    zr = F.linear(u["hr"], u["wr"], u["br"])
    reward_kl, loss_kl = full_kl_reward_and_loss(zp, zr, mask=mask, temperature=0.9)
    lp = token_logprobs(zp, tokens, temperature=0.9)
    rlp = token_logprobs(zr, tokens, temperature=0.9)
    loss_m = (loss_kl * weights).sum() + k3_ratio_loss(lp, rlp, mask=mask).sum()
    want = torch.autograd.grad(loss_m, [u[k] for k in ("hp", "wp", "bp")])
    torch.testing.assert_close(reward, reward_kl, **tol(torch.float64))
    for k, a, b in zip(("hp", "wp", "bp"), grads, want):
        close_grad(a, b, torch.float64, k)


# --------------------------------------------------------------------------- memory

def test_forward_and_backward_never_allocate_rows_by_vocab():
    # backend "auto" (native): the chunking is the backends' common structure; the streaming
    # engine's own tile buffers are checked in tests/ops/test_streaming.py (and its ~10 ATen
    # ops per tile make the profiler slow here)
    backend = "auto"
    n, h, vocab, chunk = 512, 16, 2048, 16
    logits_bytes = n * vocab * 4  # one model's (N, V) float32 logits: 4 MiB
    t = make_heads((n,), h_p=h, h_r=h, vocab=vocab, dtype=torch.float32, seed=18)
    tokens = make_tokens((n,), vocab)
    for k in NAMES:
        t[k].requires_grad_()

    def fused():
        out = call(t, tokens=tokens, entropy=True, chunk_rows=chunk, backend=backend)
        (out.kl.sum() + out.logprobs.sum() + out.entropy.sum()).backward()

    def unfused():
        zp = F.linear(t["hp"], t["wp"], t["bp"])
        zr = F.linear(t["hr"], t["wr"], t["br"])
        klpenalty.full_kl(zp, zr, backend=backend).sum().backward()

    fused()  # warm-up (native build, op registration)
    peak, largest = alloc_profile(fused)
    # a few chunk-sized buffers (16 × 2048 × 4 B = 128 KiB each: both models' logits and
    # their gradients), the gradients of the hidden states (32 KiB each) and weights
    # (V·H·4 = 128 KiB each) and O(N) statistics: far below one (N, V) tensor (4 MiB)
    assert largest <= chunk * vocab * 4
    assert peak < logits_bytes / 2
    # sanity check of the probe: the unfused path is caught
    peak_u, largest_u = alloc_profile(unfused)
    assert largest_u >= logits_bytes and peak_u >= 2 * logits_bytes


# --------------------------------------------------------------------------- checks
def test_nan_in_counted_rows_is_named():
    t = make_heads((2, 3), dtype=torch.float32)
    t["hr"][1, 2, 0] = float("nan")
    with pytest.raises(ValueError, match=r"ref_hidden contains NaN .* the first at index \(1, 2\)"):
        call(t)
    assert torch.isnan(call(t, check=False).kl[1, 2])
    t = make_heads((2, 3), dtype=torch.float32)
    t["wp"][5, 1] = float("nan")
    with pytest.raises(ValueError, match=r"policy_weight contains NaN \(shape=\(37, 12\)"):
        call(t)


def test_token_range_is_checked_on_counted_rows_only():
    leading = (2, 3)
    t = make_heads(leading, dtype=torch.float32)
    tokens = make_tokens(leading, 37, ignored=0.0)
    tokens[1, 1] = 37
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, 37\).* at index \(1, 1\)"):
        call(t, tokens=tokens)
    mask = torch.ones(leading, dtype=torch.bool)
    mask[1, 1] = False
    got = call(t, tokens=tokens, mask=mask)
    assert got.logprobs[1, 1] == 0
    # another ignore_index: -1 is ignored, -100 is then out of range
    tokens[1, 1] = -1
    assert call(t, tokens=tokens, ignore_index=-1).logprobs[1, 1] == 0
    with pytest.raises(ValueError, match="tokens must lie"):
        call(t, tokens=tokens.masked_fill(tokens == -1, -100), ignore_index=-1)


def _bad(**over):
    return over


INVALID = [
    (_bad(hp=[1.0]), TypeError, "policy_hidden must be a torch.Tensor"),
    (_bad(hp=torch.ones(3, 12, dtype=torch.long)), TypeError, "policy_hidden must be a floating"),
    (_bad(hp=torch.ones(())), ValueError, r"policy_hidden must have shape \(\.\.\., H\)"),
    (_bad(wp=torch.ones(37, 12, 1)), ValueError, r"policy_weight must have shape \(V, H\)"),
    (_bad(wp=torch.ones(0, 12)), ValueError, r"policy_weight must have shape \(V, H\) with V >= 1"),
    (_bad(wp=torch.ones(37, 11)), ValueError, r"policy_weight must have shape \(V, 12\)"),
    (_bad(wr=torch.ones(36, 9), br=None), ValueError, "same vocabulary size V"),
    (_bad(wr=torch.ones(37, 9, dtype=torch.float64)), TypeError, "ref_hidden and ref_weight must have the same dtype"),
    (_bad(bp=torch.ones(36)), ValueError, r"policy_bias must have shape \(37,\)"),
    (_bad(br=torch.ones(37, dtype=torch.float64)), TypeError, "ref_bias must have the dtype"),
    (_bad(br=torch.ones(37, dtype=torch.long)), TypeError, "ref_bias must be a floating"),
    (_bad(hr=torch.ones(4, 9)), ValueError, "same leading dims"),
    (_bad(wr=torch.ones(37, 9, device="meta")), ValueError, "ref_weight must be on the device"),
    (_bad(tokens=torch.zeros(3, 4)), TypeError, "tokens must be an integer tensor"),
    (_bad(tokens=torch.zeros(4, dtype=torch.long)), ValueError, r"tokens must have shape \(3,\)"),
    (_bad(tokens=torch.zeros(3, dtype=torch.long, device="meta")), ValueError, "tokens must be on cpu"),
    (_bad(mask=torch.ones(3)), TypeError, "mask must be a bool tensor"),
    (_bad(mask=torch.ones(4, dtype=torch.bool)), ValueError, r"mask must have shape \(3,\)"),
    (_bad(temperature=0.0), ValueError, "temperature must be finite and > 0"),
    (_bad(logit_scale=-1.0), ValueError, "logit_scale must be finite and > 0"),
    (_bad(ref_logit_scale=float("inf")), ValueError, "ref_logit_scale must be finite and > 0"),
    (_bad(softcap=0.0), ValueError, "softcap must be finite and > 0"),
    (_bad(ref_softcap="30"), TypeError, "ref_softcap must be a real number"),
    (_bad(entropy=1), TypeError, "entropy must be a bool"),
    (_bad(ignore_index=0), ValueError, "ignore_index must be negative"),
    (_bad(chunk_rows=0), ValueError, "chunk_rows must be >= 1"),
    (_bad(chunk_rows=2.0), TypeError, "chunk_rows must be an int"),
    (_bad(backend="fast"), ValueError, "backend must be one of"),
]


@pytest.mark.parametrize("over, exc, match", INVALID, ids=[m[:40] for _, _, m in INVALID])
def test_validation_errors(over, exc, match):
    t = make_heads((3,), dtype=torch.float32)
    tensors = {k: over.pop(k, t[k]) for k in NAMES}
    with pytest.raises(exc, match=match):
        call(tensors, **over)


# --------------------------------------------------------------------------- sampler support
def _greedy_tokens(t, scale=1.0, cap=None):
    """The policy's argmax per row: inside every top-k/top-p/min-p support."""
    return fused_logits(t["hp"], t["wp"], t["bp"], scale, cap).argmax(-1)


def _support_cases(z):
    """(name, kwargs) of every way to give the support, for policy logits z (..., V)."""
    keep = z >= z.topk(9, -1).values[..., -1:]  # a threshold set: the compact form → τ
    irregular = keep.clone()
    irregular[..., 0] = ~irregular[..., 0]  # not a threshold set: the compact form → a mask
    irregular |= torch.nn.functional.one_hot(z.argmax(-1), z.shape[-1]).bool()
    flat = irregular.reshape(-1, z.shape[-1])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), flat.sum(-1).cumsum(0)])
    return [
        ("top_k", dict(top_k=5)),
        ("top_p", dict(top_p=0.8)),
        ("min_p", dict(min_p=0.2)),
        ("top_k_top_p_min_p", dict(top_k=12, top_p=0.9, min_p=0.05)),
        ("mask", dict(support=keep)),
        ("ids_irregular", dict(support=(flat.nonzero()[:, 1], offsets))),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(6))
def test_support_matches_the_logits_functions(backend, case):
    """linear_kl with a support equals token_stats with that support on the materialised
    (fused_logits) logits: values and the gradients of every input, chunked and masked."""
    leading = (3, 5)
    t = make_heads(leading, dtype=torch.float64)
    transform = dict(logit_scale=1.3, softcap=4.0, temperature=0.8)
    zp = fused_logits(t["hp"], t["wp"], t["bp"], 1.3, 4.0)
    zr = fused_logits(t["hr"], t["wr"], t["br"], 1.3, 4.0)
    name, support = _support_cases(zp)[case]
    tokens = zp.argmax(-1)
    mask = make_mask(leading)
    for k in NAMES:
        t[k].requires_grad_()
    got = call(t, tokens=tokens, mask=mask, entropy=True, chunk_rows=4, backend=backend,
               **transform, **support)
    zp = fused_logits(t["hp"], t["wp"], t["bp"], 1.3, 4.0)
    zr = fused_logits(t["hr"], t["wr"], t["br"], 1.3, 4.0)
    want = klpenalty.token_stats(zp, zr, tokens, mask=mask, entropy=True, temperature=0.8,
                                 **support)
    close_values(got, [w.detach() for w in want], torch.float64)
    grads = upstream(want)
    got_g = torch.autograd.grad(loss_of(got, grads), [t[k] for k in NAMES])
    want_g = torch.autograd.grad(loss_of(want, grads), [t[k] for k in NAMES])
    for k, a, b in zip(NAMES, got_g, want_g):
        close_grad(a, b, torch.float64, f"{name} {k}")
    if "top_k" in support and "top_p" not in support:  # the support really cuts
        assert float(got.entropy.detach()[mask].max()) < math.log(support["top_k"]) + 1e-9


def test_support_float32_against_the_float64_reference():
    """float32 hidden states with top-k: the fused result against the float64 truncated
    policy on the same logits (π̃ = softmax of the logits ≥ the k-th, ρ untruncated)."""
    leading = (2, 6)
    t = make_heads(leading, dtype=torch.float32)
    tokens = _greedy_tokens(t)
    got = call(t, tokens=tokens, entropy=True, top_k=4, chunk_rows=5)
    z = fused_logits(t["hp"], t["wp"], t["bp"], 1.0, None).double()
    zr = fused_logits(t["hr"], t["wr"], t["br"], 1.0, None).double()
    kept = torch.where(z >= z.topk(4, -1).values[..., -1:], z, -math.inf)
    lp = torch.log_softmax(kept, -1)
    p = lp.exp()
    want_kl = (p * (lp.nan_to_num(neginf=0.0) - torch.log_softmax(zr, -1))).sum(-1)
    want_lp = lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(got.kl.double(), want_kl, **tol(torch.float32))
    torch.testing.assert_close(got.logprobs.double(), want_lp, **tol(torch.float32))


def test_sampled_token_outside_the_support_is_named():
    leading = (2, 4)
    t = make_heads(leading)
    tokens = _greedy_tokens(t)
    z = fused_logits(t["hp"], t["wp"], t["bp"], 1.0, None)
    tokens[1, 2] = z[1, 2].argmin()  # never in a top-3
    with pytest.raises(ValueError, match=r"sampled token \d+ at position \(1, 2\) is outside"):
        call(t, tokens=tokens, top_k=3)
    out = call(t, tokens=tokens, top_k=3, check=False)
    assert torch.isneginf(out.logprobs[1, 2]) and torch.isfinite(out.kl).all()
    mask = torch.ones(leading, dtype=torch.bool)
    mask[1, 2] = False  # not counted: not checked
    assert torch.isfinite(call(t, tokens=tokens, top_k=3, mask=mask).logprobs).all()


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(support=torch.ones(2, 4, 37, dtype=torch.bool), top_k=3), ValueError,
         r"support and top_k both given"),
        (dict(support=torch.ones(2, 4, 36, dtype=torch.bool)), ValueError,
         r"support must have the shape of the policy logits \(2, 4, 37\)"),
        (dict(support=torch.ones(2, 4, 37)), TypeError, r"support must be a bool tensor"),
        (dict(support=(torch.tensor([0]), torch.tensor([0, 1]))), ValueError,
         r"support offsets must have N \+ 1 = 9 entries"),
        (dict(top_k=0), ValueError, r"top_k must be >= 1"),
        (dict(top_p=1.5), ValueError, r"top_p must lie in \(0, 1\]"),
        (dict(min_p=-0.1), ValueError, r"min_p must lie in \[0, 1\]"),
    ],
)
def test_support_validation(kw, exc, match):
    t = make_heads((2, 4))
    with pytest.raises(exc, match=match):
        call(t, **kw)


# --------------------------------------------------------------------------- expected_grads
def _sequence_loss_plan(coef_kl, coef_lp, seq_len):
    """A loss of the outputs whose per-row gradient depends on later rows: per sequence of
    ``seq_len`` rows, Σ_t coef_kl·KL_t + Σ_t coef_lp·R_t·log π_t, R_t = Σ_{u>t} KL_u (detached):
    the loss as autograd sees it, and the plan of its upstream gradients (rows visited last
    first), recording the order of the rows it is asked about."""
    n = coef_kl.numel()
    seen = torch.zeros(n, dtype=torch.float64)
    order = []

    def plan(rows, out):
        order.append(rows.clone())
        seen[rows] = out[:, 0].double()
        per_seq = seen.view(-1, seq_len)
        to_go = per_seq.flip(-1).cumsum(-1).flip(-1) - per_seq  # Σ_{u>t}: later rows are in
        grads = torch.zeros(rows.shape[0], 4, dtype=out.dtype)
        grads[:, 0] = coef_kl[rows]
        grads[:, 1] = (coef_lp[rows].double() * to_go.view(-1)[rows]).to(out.dtype)
        return grads

    def loss(stats):
        kl = stats.kl.reshape(-1, seq_len)
        to_go = (kl.detach().double().flip(-1).cumsum(-1).flip(-1) - kl.detach().double())
        return (coef_kl * stats.kl.reshape(-1)).sum() + (
            coef_lp * to_go.reshape(-1).to(kl.dtype) * stats.logprobs.reshape(-1)).sum()

    return plan, loss, order


@pytest.mark.parametrize("backend", BACKENDS)
def test_expected_grads_form_the_gradient_in_the_forward(monkeypatch, backend):
    """With the plan of the loss's upstream gradients, the backward multiplies no head (the
    gradients were formed in the forward: 2 GEMMs per chunk in all) and the gradients equal
    the recomputing path's; the rows are visited from the last chunk to the first."""
    leading = (4, 6)
    t = make_heads(leading, dtype=torch.float32, seed=11)
    for k in ("hp", "wp", "bp"):
        t[k].requires_grad_()
    tokens = make_tokens(leading, 37, seed=3, ignored=0.0)
    mask = make_mask(leading, seed=4)
    g = torch.Generator().manual_seed(5)
    coef_kl = torch.rand(24, generator=g) * mask.reshape(-1)
    coef_lp = torch.randn(24, generator=g) * mask.reshape(-1)
    opts = dict(tokens=tokens, mask=mask, temperature=0.9, chunk_rows=5, backend=backend)
    plain = call(t, **opts)
    _, loss, _ = _sequence_loss_plan(coef_kl, coef_lp, 6)
    want = torch.autograd.grad(loss(plain), [t["hp"], t["wp"], t["bp"]])

    calls = []
    original = kl_module._logits
    monkeypatch.setattr(kl_module, "_logits", lambda h, w, *a: calls.append(w) or original(h, w, *a))
    plan, loss, order = _sequence_loss_plan(coef_kl, coef_lp, 6)
    got = call(t, expected_grads=plan, **opts)
    forward_calls = len(calls)
    grads = torch.autograd.grad(loss(got), [t["hp"], t["wp"], t["bp"]])
    chunks = math.ceil(int(mask.sum()) / 5)
    assert forward_calls == 2 * chunks and len(calls) == forward_calls  # none in the backward
    assert [int(o[0]) for o in order] == sorted((int(o[0]) for o in order), reverse=True)
    for a, b in zip(got[:3], plain[:3]):  # the same values, whatever the order of the chunks
        assert torch.equal(a, b)
    for n, a, b in zip(("hp", "wp", "bp"), grads, want):
        torch.testing.assert_close(a, b, rtol=GRAD_REL_TOL[torch.float32],
                                   atol=GRAD_REL_TOL[torch.float32] * float(b.abs().max()))


def test_expected_grads_that_do_not_arrive_are_recomputed(monkeypatch):
    """A plan that differs from the gradients the backward receives (another loss) is not
    used: the backward recomputes, and the gradient is the received loss's."""
    leading = (3, 5)
    t = make_heads(leading, dtype=torch.float32, seed=12)
    for k in ("hp", "wp"):
        t[k].requires_grad_()
    tokens = make_tokens(leading, 37, seed=6, ignored=0.0)
    coef = torch.linspace(0.5, 1.5, 15)
    opts = dict(tokens=tokens, chunk_rows=4)
    plain = call(t, **opts)
    want = torch.autograd.grad((coef * plain.kl.reshape(-1)).sum(), [t["hp"], t["wp"]])

    def plan(rows, out):
        grads = torch.zeros(rows.shape[0], 4)
        grads[:, 0] = coef[rows] * (1 + 1e-3)  # off by 1e-3 relative: more than PLAN_RTOL
        return grads

    calls = []
    original = kl_module._logits
    monkeypatch.setattr(kl_module, "_logits", lambda h, w, *a: calls.append(w) or original(h, w, *a))
    got = call(t, expected_grads=plan, **opts)
    grads = torch.autograd.grad((coef * got.kl.reshape(-1)).sum(), [t["hp"], t["wp"]])
    assert len(calls) == 2 * 4 + 2 * 4  # the forward's, then the recomputing backward's
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_expected_grads_must_be_callable():
    t = make_heads((3,), seed=13)
    with pytest.raises(TypeError, match="expected_grads must be callable or None, got int"):
        call(t, expected_grads=3)


# --------------------------------------------------------------------------- linear_logprobs
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("sampler", [{}, {"top_k": 5}, {"top_p": 0.8}])
def test_linear_logprobs_one_head_against_the_reference(dtype, sampler):
    from klpenalty.linear import linear_logprobs
    from klpenalty import entropy as entropy_of

    leading = (3, 7)
    t = make_heads(leading, dtype=dtype, seed=14)
    tokens = make_tokens(leading, 37, seed=7)
    mask = make_mask(leading, seed=8)
    got = linear_logprobs(t["hp"], t["wp"], tokens, bias=t["bp"], mask=mask, temperature=0.8,
                          entropy=True, logit_scale=0.7, softcap=4.0, chunk_rows=4,
                          check=False, **sampler)
    assert got.kl is None and got.ref_logprobs is None and not got.logprobs.requires_grad
    z = fused_logits(t["hp"], t["wp"], t["bp"], 0.7, 4.0)  # the same input-dtype logits
    counted = mask & (tokens != -100)
    if not sampler:
        want = token_logprobs_reference(z.double(), tokens.clamp_min(0), 0.8)
        torch.testing.assert_close(got.logprobs[counted].double(), want[counted], **tol(dtype))
        want_h = entropy_reference(z.double(), 0.8)
        torch.testing.assert_close(got.entropy[mask].double(), want_h[mask], **tol(dtype))
    else:  # the sampler's π̃: the logits functions on the materialised logits
        want = token_logprobs(z, tokens, temperature=0.8, check=False, **sampler)
        torch.testing.assert_close(got.logprobs[counted], want[counted], **tol(dtype))
        want_h = entropy_of(z, temperature=0.8, **sampler)
        torch.testing.assert_close(got.entropy[mask], want_h[mask], **tol(dtype))
    assert torch.all(got.logprobs[~mask] == 0) and torch.all(got.entropy[~mask] == 0)


def test_linear_logprobs_validation():
    from klpenalty.linear import linear_logprobs

    t = make_heads((4,), seed=15)
    tokens = make_tokens((4,), 37, seed=9, ignored=0.0)
    with pytest.raises(ValueError, match=r"weight must have shape \(V, 12\)"):
        linear_logprobs(t["hp"], t["wr"], tokens)
    with pytest.raises(ValueError, match="tokens"):
        linear_logprobs(t["hp"], t["wp"], tokens[:3])
    with pytest.raises(ValueError, match=r"out of range|\[0, 37\)"):
        linear_logprobs(t["hp"], t["wp"], tokens + 40)
    with pytest.raises(ValueError, match="chunk_rows must be >= 1"):
        linear_logprobs(t["hp"], t["wp"], tokens, chunk_rows=0)
