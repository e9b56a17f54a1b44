"""The +inf rule, whatever the precision: a finite policy logit where the reference logit is −inf
gives KL = +inf, also where that entry's probability underflows in the compute dtype (50-700
nats below the row's maximum), on every backend's row walk and in the merge of vocabulary
slices (the engine's, the Triton splits', the native chunks'). Log-probs, the entropy and the
gradients of the other outputs stay finite and exact on such rows.

Every backend: ``streaming``, ``native`` and ``triton`` (on CPU tensors in Triton's
interpreter). The float64 reference (``ops/reference.py``) applies the rule from the logits.
"""

from __future__ import annotations

import pytest
import torch

import klpenalty
from klpenalty.ops import engine
from klpenalty.ops.reference import (
    entropy_reference,
    full_kl_reference,
    token_logprobs_reference,
)
from tests.conftest import triton_interpreter_env
from tests.tolerances import DTYPES, GRAD_REL_TOL, tol

NINF = float("-inf")
INF = float("inf")
NATS = [50, 100, 104, 110, 200, 700]  # fp32 e^u underflows past ~104 nats (subnormals: ~87-104)
BACKENDS = ["streaming", "native", "triton"]
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")

pytestmark = [  # the interpreter evaluates masked-off lanes too (−inf − −inf): numpy warns
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning"),
]


@pytest.fixture(params=BACKENDS)
def backend(request):
    """A backend name; triton runs in its interpreter where no GPU exists."""
    name = request.param
    if name == "native" and DEVICE.type != "cpu":
        pytest.skip("the native backend runs on CPU tensors")
    if name != "triton":
        yield name
        return
    pytest.importorskip("triton", reason="Triton is not installed: pip install 'klpenalty[triton]'")
    from klpenalty.ops import triton as triton_backend

    with triton_interpreter_env():
        if not CUDA and not triton_backend.interpreted():
            pytest.fail("Triton was imported before TRITON_INTERPRET=1 was set")
        yield name


def _rows(dtype, temperature, nats, vocab=5001, seed=0):
    """Seven rows of V = 5001 (not a multiple of any chunk, block or tile), in float64.

    Rows 0-3 hold a finite policy logit ``nats`` (in tempered units) below the row's maximum
    where the reference is −inf: at the first column; at the last column; at the last column of
    a row whose second half lies that low; at column 1 of a row whose first 4096 columns lie
    that low (the first native chunks and Triton block are walked with a maximum far below the
    row's, and their +inf is rescaled when the maximum rises). Rows 4-6 are finite: row 4 the same low entry with a
    finite reference logit, row 5 a −inf in both models there (padding), row 6 policy −inf
    entries, one of them where the reference is −inf too.
    Returns (x, y) rounded to ``dtype``, and the list of +inf rows.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(7, vocab, generator=g, dtype=torch.float64)
    y = x + 0.5 * torch.randn(7, vocab, generator=g, dtype=torch.float64)
    low = lambda r: x[r].max() - nats * temperature  # noqa: E731
    half = vocab // 2
    x[0, 0], y[0, 0] = low(0), NINF
    x[1, -1], y[1, -1] = low(1), NINF
    x[2, half:] = low(2) + 0.1 * torch.rand(vocab - half, generator=g)
    y[2, -1] = NINF
    x[3, :4096] = low(3) + 0.1 * torch.rand(4096, generator=g)  # a whole Triton block
    y[3, 1] = NINF
    x[4, 7], y[4, 7] = low(4), low(4)
    x[5, 9], y[5, 9] = NINF, NINF
    x[6, :3], y[6, 1] = NINF, NINF
    return x.to(dtype), y.to(dtype), [0, 1, 2, 3]


def _close_grads(got, want, dtype):
    """Gradients against float64, relative to the largest entry (GRAD_REL_TOL)."""
    rel = GRAD_REL_TOL[dtype]
    torch.testing.assert_close(got.double(), want, rtol=rel, atol=rel * float(want.abs().max()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.05])  # 0.05: offending logit 2.5-35 below max
@pytest.mark.parametrize("nats", NATS)
def test_underflowed_policy_mass_where_the_reference_has_none_is_inf(backend, dtype, temperature, nats):
    x, y, inf_rows = (t.to(DEVICE) if torch.is_tensor(t) else t for t in _rows(dtype, temperature, nats))
    want = full_kl_reference(x, y, temperature)
    assert torch.isposinf(want[inf_rows]).all()
    x.requires_grad_()
    y.requires_grad_()
    kl = klpenalty.full_kl(x, y, temperature=temperature, backend=backend)
    assert torch.isposinf(kl[inf_rows]).all(), kl
    finite = [4, 5, 6]
    torch.testing.assert_close(kl[finite].double(), want[finite], **tol(dtype))
    if temperature != 1.0:  # at T = 0.05 float32 itself is ~1e-5 off (u − w ~ 100s): values only
        return
    # the gradient of the finite rows is exact; the +inf rows with no upstream gradient get 0
    grad_out = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.5, -0.5, 2.0], device=DEVICE)
    gx, gy = torch.autograd.grad(kl, (x, y), grad_out)
    assert torch.isfinite(gx).all() and torch.isfinite(gy).all()
    assert (gx[inf_rows] == 0).all() and (gy[inf_rows] == 0).all()
    xr, yr = (torch.nan_to_num(t.detach()[finite].double(), neginf=-1e4) for t in (x, y))
    xr.requires_grad_()
    yr.requires_grad_()
    ref = (full_kl_reference(xr, yr, temperature) * grad_out[finite].double()).sum()
    wx, wy = torch.autograd.grad(ref, (xr, yr))
    _close_grads(gx[finite], wx, dtype)
    _close_grads(gy[finite], wy, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("nats", [104, 700])
def test_log_probs_and_entropy_of_an_inf_row_are_finite_and_exact(backend, dtype, nats):
    """On rows with KL = +inf the one-pass call's log-probs and entropy are exact, and their
    gradients (no upstream gradient into the KL) are finite and exact."""
    temperature = 0.5
    x, y, inf_rows = _rows(dtype, temperature, nats)
    x, y = x.to(DEVICE).requires_grad_(), y.to(DEVICE)
    tokens = torch.tensor([0, 5, 8, 3, 7, 1, 4], device=DEVICE)  # rows 0, 4: the low entry
    st = klpenalty.token_stats(x, y, tokens, entropy=True, temperature=temperature, backend=backend)
    assert torch.isposinf(st.kl[inf_rows]).all()
    for got, want in (
        (st.logprobs, token_logprobs_reference(x.detach(), tokens, temperature)),
        (st.ref_logprobs, token_logprobs_reference(y, tokens, temperature)),
        (st.entropy, entropy_reference(x.detach(), temperature)),
    ):
        torch.testing.assert_close(got.double(), want, **tol(dtype))
    g_lp = torch.linspace(-1.0, 1.0, 7, device=DEVICE)
    g_h = torch.linspace(0.5, 2.0, 7, device=DEVICE)
    (gx,) = torch.autograd.grad((st.logprobs * g_lp + st.entropy * g_h).sum(), x)
    assert torch.isfinite(gx).all()
    xr = torch.nan_to_num(x.detach().double(), neginf=-1e4).requires_grad_()
    ref = token_logprobs_reference(xr, tokens, temperature) * g_lp.double()
    ref = ref + entropy_reference(xr, temperature) * g_h.double()
    (wx,) = torch.autograd.grad(ref.sum(), xr)
    _close_grads(gx, wx, dtype)


def test_an_inf_row_with_upstream_gradient_has_a_non_finite_kl_gradient(backend):
    """The KL's gradient on a row with KL = +inf is not finite where the row's upstream gradient
    is nonzero, whether π at the offending entry is representable (50 nats) or not (700)."""
    for nats in (50, 700):
        x, y, inf_rows = _rows(torch.float32, 1.0, nats)
        x = x.to(DEVICE).requires_grad_()
        kl = klpenalty.full_kl(x, y.to(DEVICE), backend=backend)
        (gx,) = torch.autograd.grad(kl[0], x)
        assert not torch.isfinite(gx[0]).all()
        assert (gx[1:] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("nats", [104, 700, 1000])  # 1000: past float64's underflow too
@pytest.mark.parametrize("low_first", [True, False])
def test_merge_keeps_inf_of_a_slice_far_below_the_row_max(backend, dtype, nats, low_first):
    """Two rows whose first or last vocabulary slice lies ``nats`` below the row's maximum, the
    offending entry in it, so that slice's rescale factor underflows in the merge: streaming
    tiles of 2^18 columns (V = 300007), native chunks, Triton's two splits of 5 blocks of 4096
    (V = 32771)."""
    vocab, cut = (32771, 5 * 4096) if backend == "triton" else (300007, 1 << 18)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, vocab, generator=g, dtype=torch.float64)
    y = x + 0.5 * torch.randn(2, vocab, generator=g, dtype=torch.float64)
    low = slice(0, cut) if low_first else slice(cut, vocab)
    x[:, low] -= nats + 10.0
    y[0, low.start + 5] = NINF
    x, y = x.to(dtype).to(DEVICE), y.to(dtype).to(DEVICE)
    kl = klpenalty.full_kl(x, y, backend=backend)  # two rows: Triton splits each in two
    assert torch.isposinf(kl[0]) and torch.isfinite(kl[1]), kl
    torch.testing.assert_close(kl[1:].double(), full_kl_reference(x[1:], y[1:]), **tol(dtype))


def test_engine_merge_keeps_inf_when_the_rescale_factor_underflows():
    """The vocabulary-slice merge (tiles, Triton splits, the all-reduce of ranks): a slice with
    a = +inf whose maximum is far below the common one stays +inf, in either merge order and
    after the rescale to the global maxima alone (as the all-reduce does)."""
    t = 1.0
    x = torch.tensor([[0.0, 1.0, 2.0, -800.0, -801.0]])
    y = torch.tensor([[0.0, 1.0, 2.0, NINF, -1.0]])
    ws = engine.Workspace(1, 5, torch.float32, x.device)

    def part(c0, c1, careful):
        return engine.stats_partial(
            x[:, c0:c1], y[:, c0:c1], t, ws, careful, kl=True, entropy=True
        )[0]

    for careful in (None, True):
        a, b = part(0, 3, careful), part(3, 5, careful)
        assert torch.isposinf(b.a).all() and torch.isfinite(b.b).all()
        for left, right in ((a, b), (b, a)):
            kl, h, _ = engine.stats_finalize(engine.stats_merge(left, right, t), None)
            assert torch.isposinf(kl).all() and torch.isfinite(h).all()
        big_x, big_y = torch.maximum(a.m_x, b.m_x), torch.maximum(a.m_y, b.m_y)
        rescaled = engine.stats_rescale(b, big_x, big_y, t)
        assert torch.isposinf(rescaled.a).all() and rescaled.s_x.item() == 0.0
        assert rescaled.b.item() == 0.0


def _random_case(g: torch.Generator):
    """A random (N, V) pair with −inf patterns and entries up to ~1000 tempered nats below the
    row maximum, in a random dtype and temperature."""
    n = int(torch.randint(1, 5, (1,), generator=g))
    vocab = int(torch.randint(1, 400, (1,), generator=g))
    dtype = DTYPES[int(torch.randint(0, 4, (1,), generator=g))]
    temperature = [0.05, 0.3, 1.0, 2.5][int(torch.randint(0, 4, (1,), generator=g))]
    scale = [1.0, 20.0, 200.0][int(torch.randint(0, 3, (1,), generator=g))]
    x = torch.randn(n, vocab, generator=g, dtype=torch.float64) * scale
    y = x + torch.randn(n, vocab, generator=g, dtype=torch.float64) * scale * 0.3
    drop = torch.rand(n, vocab, generator=g) < 0.1  # some entries far below their row's max
    x = torch.where(drop, x - torch.rand(n, vocab, generator=g, dtype=torch.float64) * 1000 * temperature, x)
    for t, p in ((y, 0.05), (x, 0.05)):
        t.masked_fill_(torch.rand(n, vocab, generator=g) < p * float(torch.rand(1, generator=g)), NINF)
    x[:, 0] = x[:, 0].clamp_min(-1e3)  # a finite policy entry per row: every row defines π
    y[:, -1] = y[:, -1].clamp_min(-1e3)
    return x.to(dtype), y.to(dtype), temperature


@pytest.mark.parametrize("seed", range(3))
def test_random_inputs_inf_decision_agrees_with_float64(backend, seed):
    """On random inputs the +inf/finite decision of the KL is float64's, always; the finite
    values agree within the table."""
    g = torch.Generator().manual_seed(100 + seed)
    cases = 12 if backend == "triton" else 60
    n_inf = 0
    for _ in range(cases):
        x, y, temperature = _random_case(g)
        want = full_kl_reference(x, y, temperature)
        got = klpenalty.full_kl(x.to(DEVICE), y.to(DEVICE), temperature=temperature, backend=backend)
        got = got.cpu().double()
        assert torch.equal(torch.isposinf(got), torch.isposinf(want)), (x.dtype, temperature, got, want)
        finite = torch.isfinite(want)
        torch.testing.assert_close(got[finite], want[finite], **tol(x.dtype))
        n_inf += int(torch.isposinf(want).sum())
    assert n_inf > 0  # the search reached the rule
