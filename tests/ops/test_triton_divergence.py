"""The Triton backend's second walk (``triton_divergence`` and its backward) against the
streaming op in float64 on the same values: every kind in float32 and bfloat16, −inf entries in
the student, the teacher and both, masked rows holding NaN, rows with a zero upstream gradient,
V not a multiple of the block, split rows, exact zeros for identical inputs, logits far below
the row's maximum, float64 inputs (the streaming ops) and the empty batch, the host side (no
host sync, the launches, the upstream gradient read in place), the mixture's log-ratio in
float32, ``klpenalty.divergence(..., backend="triton")`` end to end, and the kernels lowered
to PTX for sm_90 (tests/ops/test_triton_compiled.py reads their machine code).

With a GPU the kernels run compiled on CUDA tensors; without one on CPU tensors in Triton's
interpreter (``TRITON_INTERPRET=1``, set by this module's fixture). Shapes are small.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import klpenalty
from klpenalty.ops import contract
from klpenalty.ops.divergence import Divergence
from klpenalty.ops.reference import divergence_reference
from klpenalty.ops.triton import divergence as tdiv
from klpenalty.ops.triton import token_stats as ts
from tests.helpers import grad_tol, make_logits, tol
from tests.ops.test_engine import _CountSyncs

triton = pytest.importorskip("triton", reason="Triton is not installed: pip install 'klpenalty[triton]'")
tl = triton.language

# (these import the kernel modules, which import Triton)
from klpenalty.ops.triton._kernels_divergence import _minus_log_mix  # noqa: E402
# _interpreter_on_cpu: that module's autouse fixture (TRITON_INTERPRET=1 while these tests run
# where no GPU exists), in force here too
from tests.ops.test_triton_host import _count, _interpreter_on_cpu, _Launches  # noqa: E402,F401

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
NINF = -math.inf
KINDS = list(Divergence)
PARAM = 0.3  # β of the JSD, λ of the skew KLs (the other kinds ignore it)
TEMPERATURE = 0.8
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the interpreter evaluates masked-off lanes and unselected branches too: numpy warns
pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning"),
]


ops = torch.ops.klpenalty


def _pair(dtype, vocab, seed=0):
    """(3, 4, V) student/teacher logits on DEVICE with −inf entries in the student, the
    teacher and both, and a masked row (the mask returned) holding NaN in both."""
    x, y = make_logits((3, 4, vocab), torch.float32, seed=seed)
    x[0, 0, 1 % vocab] = NINF  # the student gives a token no mass
    y[0, 1, 2 % vocab] = NINF  # the teacher gives a token no mass
    x[0, 2, : vocab // 2 + 1] = NINF  # neither has mass on those
    y[0, 2, : vocab // 2 + 1] = NINF
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[2, 3] = False
    x[2, 3] = float("nan")
    y[2, 3, ::2] = float("nan")
    return x.to(dtype).to(DEVICE), y.to(dtype).to(DEVICE), mask.to(DEVICE)


def _stats(x, y, mask, backend="triton"):
    """The forward op's stats (the KL's walk: both models' shifts and log-sums)."""
    _, stats = getattr(ops, f"{backend}_token_stats")(
        x, y, None, mask, None, None, TEMPERATURE, -100, int(contract.Want.KL), False, 0, 0, 0,
        1.0, 0.0)
    return stats


def _float64_walk(x, y, mask, grad, kind):
    """The streaming op and its backward in float64 on the same values."""
    xd, yd = x.double(), y.double()
    st = _stats(xd, yd, mask, "streaming")
    value, gbar = ops.streaming_divergence(xd, yd, st, mask, None, None, TEMPERATURE, kind, PARAM)
    gx = ops.streaming_divergence_backward(grad.double(), xd, yd, st, gbar, mask, None, None,
                                           TEMPERATURE, kind, PARAM)
    return value, gbar, gx


def _check_against_float64(x, y, mask, kind, grad):
    st = _stats(x, y, mask)
    value, gbar = ops.triton_divergence(x, y, st, mask, None, None, TEMPERATURE, kind, PARAM)
    gx = ops.triton_divergence_backward(grad, x, y, st, gbar, mask, None, None, TEMPERATURE, kind,
                                        PARAM)
    want_v, want_g, want_x = _float64_walk(x, y, mask, grad, kind)
    assert value.dtype == gbar.dtype == torch.float32 and gx.dtype == x.dtype
    assert value.shape == gbar.shape == x.shape[:-1] and gx.shape == x.shape
    dtype = x.dtype
    torch.testing.assert_close(value.double(), want_v, equal_nan=True, **tol(dtype))
    torch.testing.assert_close(gbar.double(), want_g, equal_nan=True, **tol(dtype))
    torch.testing.assert_close(gx.double(), want_x, equal_nan=True, **grad_tol(dtype))
    return value, gx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name.lower())
def test_every_kind_matches_the_streaming_op_in_double_precision(kind, dtype):
    """Value, ḡ and ∂/∂x against the float64 op on the same values, at V = 7, 33, 300 (one
    partial block, one full and a partial one, several blocks and a partial one); masked rows
    (NaN logits) exactly 0 with a zero gradient; a row whose upstream gradient is 0 holds NaN
    and gets exactly 0; the KLs' +inf where mass meets none."""
    for vocab in (7, 33, 300):
        x, y, mask = _pair(dtype, vocab, seed=vocab)
        x[1, 0, 3] = float("nan")  # counted, but its upstream gradient is 0
        grad = torch.randn(3, 4, generator=torch.Generator().manual_seed(vocab)).to(DEVICE)
        grad[1, 0] = 0.0
        value, gx = _check_against_float64(x, y, mask, kind, grad)
        assert value[2, 3].item() == 0.0 and torch.all(gx[2, 3] == 0)
        assert torch.isnan(value[1, 0]) and torch.all(gx[1, 0] == 0)
        finite = torch.isfinite(value)
        if kind == Divergence.REVERSE_KL:  # a finite student logit against the teacher's −inf
            assert value[0, 1].item() == math.inf and finite[0, 0]
        elif kind == Divergence.FORWARD_KL:
            assert value[0, 0].item() == math.inf and finite[0, 1]
        else:  # the mixtures and the TVD are finite wherever either model has mass
            assert finite[0, :3].all()


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name.lower())
def test_split_rows_match_whole_rows(kind, monkeypatch):
    """Rows split into programs of 32 columns (16-column blocks) whose partial sums the merge
    kernel adds: the float64 op's values, a masked row 0."""
    x, y, mask = _pair(torch.float32, 100, seed=4)
    grad = torch.linspace(-1.0, 1.0, 12).reshape(3, 4).to(DEVICE)
    st = _stats(x, y, mask)
    whole = ops.triton_divergence(x, y, st, mask, None, None, TEMPERATURE, kind, PARAM)
    launches = _Launches(monkeypatch)
    monkeypatch.setattr(tdiv, "split_columns", lambda n, vocab, device: (16, 32))
    value, _ = _check_against_float64(x, y, mask, kind, grad)
    assert launches.names()[-3:-1] == ["divergence_kernel", "divergence_merge_kernel"]
    torch.testing.assert_close(value, whole[0], equal_nan=True, **tol(torch.float32))
    assert value[2, 3].item() == 0.0


def _support(x, which):
    """(keep, tau) of a support case for student logits x (3, 4, V): a bool kept set (not a
    threshold set: the largest logit of some rows dropped), the threshold of the 9 largest
    (float32, the compute dtype), or both (the row's largest kept in each)."""
    keep = tau = None
    if which in ("keep", "both"):
        g = torch.Generator().manual_seed(21)
        keep = (torch.rand(x.shape, generator=g) < 0.5).to(x.device)
        keep[..., 0] = True
        if which == "both":
            keep.scatter_(-1, x.float().argmax(-1, keepdim=True), True)
    if which in ("tau", "both"):
        tau = x.float().topk(9, -1).values[..., -1].contiguous()
    return keep, tau


@pytest.mark.parametrize("which", ["keep", "tau", "both"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name.lower())
def test_the_student_on_a_support_matches_float64(kind, dtype, which, monkeypatch):
    """keep / tau: value, ḡ and ∂/∂x against the float64 streaming op with the same support
    (the forward's stats over it), a masked row 0; the gradient exactly 0 off the support. In
    float32 with both, rows split into programs of 32 columns (the merge kernel)."""
    split = which == "both" and dtype == torch.float32
    x, y = make_logits((3, 4, 70), dtype, seed=8)
    x, y = x.to(DEVICE), y.to(DEVICE)
    mask = torch.ones(3, 4, dtype=torch.bool, device=DEVICE)
    mask[1, 2] = False
    keep, tau = _support(x, which)
    if split:
        monkeypatch.setattr(tdiv, "split_columns", lambda n, vocab, device: (16, 32))
    grad = torch.linspace(-1.0, 1.0, 12).reshape(3, 4).to(DEVICE)
    want = int(contract.Want.KL)
    _, st = ops.triton_token_stats(x, y, None, mask, keep, tau, TEMPERATURE, -100, want, False,
                                   0, 0, 0, 1.0, 0.0)
    value, gbar = ops.triton_divergence(x, y, st, mask, keep, tau, TEMPERATURE, kind, PARAM)
    gx = ops.triton_divergence_backward(grad, x, y, st, gbar, mask, keep, tau, TEMPERATURE,
                                        kind, PARAM)
    xd, yd = x.double(), y.double()
    _, sd = ops.streaming_token_stats(xd, yd, None, mask, keep, tau, TEMPERATURE, -100, want,
                                      False, 0, 0, 0, 1.0, 0.0)
    want_v, want_g = ops.streaming_divergence(xd, yd, sd, mask, keep, tau, TEMPERATURE, kind,
                                              PARAM)
    want_x = ops.streaming_divergence_backward(grad.double(), xd, yd, sd, want_g, mask, keep,
                                               tau, TEMPERATURE, kind, PARAM)
    torch.testing.assert_close(value.double(), want_v, **tol(dtype))
    torch.testing.assert_close(gbar.double(), want_g, **tol(dtype))
    torch.testing.assert_close(gx.double(), want_x, **grad_tol(dtype))
    off = ~contract.kept_mask(x, keep, tau)
    assert off.any() and torch.all(gx[off] == 0) and torch.all(gx[1, 2] == 0)
    if kind == Divergence.FORWARD_KL:  # the teacher's mass off the support: +inf
        assert torch.isposinf(value[mask]).all()
    else:
        assert torch.isfinite(value).all() and value[1, 2].item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_identical_inputs_give_exactly_zero(dtype):
    """x = y (also with −inf entries): every kind's value exactly 0, with the Triton forward's
    stats; the reverse KL's and the JSD's gradients exactly 0 too (π·g = 0 at every entry)."""
    x, _ = make_logits((2, 3, 45), dtype, seed=6)
    x = x.to(DEVICE)
    x[0, 1, ::4] = NINF
    st = _stats(x, x, None)
    for kind in KINDS:
        value, gbar = ops.triton_divergence(x, x, st, None, None, None, TEMPERATURE, kind, PARAM)
        assert torch.all(value == 0), (kind, value)
        if kind in (Divergence.REVERSE_KL, Divergence.JSD):
            gx = ops.triton_divergence_backward(torch.ones(2, 3, device=DEVICE), x, x, st, gbar,
                                                None, None, None, TEMPERATURE, kind, PARAM)
            assert torch.all(gbar == 0) and torch.all(gx == 0), kind


def test_logits_far_below_the_maximum_stay_finite():
    """Student entries 95 and 300 nats below the teacher's: the mixtures' log-ratios do not
    overflow (e^δ is never formed above δ = 1), every kind matches float64."""
    x = torch.tensor([[0.0, -95.0, -300.0, 3.0, 1.0], [2.0, -300.0, 0.5, -40.0, 0.0]])
    y = torch.tensor([[0.0, 0.0, 0.0, 1.0, -200.0], [0.0, 1.0, 2.0, 3.0, 4.0]])
    x, y = x.to(DEVICE), y.to(DEVICE)
    for kind in KINDS:
        value, _ = _check_against_float64(x, y, None, kind, torch.tensor([1.0, -0.5]).to(DEVICE))
        assert torch.isfinite(value).all(), kind


def test_float64_inputs_and_the_empty_batch():
    """Float64 inputs run the streaming ops (float64 math, the same bits); no rows: empty
    outputs."""
    x, y, mask = _pair(torch.float64, 33)
    st = _stats(x, y, mask)
    for kind in (Divergence.JSD, Divergence.TVD):
        got = ops.triton_divergence(x, y, st, mask, None, None, TEMPERATURE, kind, PARAM)
        want = ops.streaming_divergence(x, y, st, mask, None, None, TEMPERATURE, kind, PARAM)
        assert got[0].dtype == torch.float64
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, equal_nan=True, rtol=0, atol=0)
    e = torch.zeros(0, 7, device=DEVICE)
    st = torch.zeros(0, contract.STATS_COLS, device=DEVICE)
    value, gbar = ops.triton_divergence(e, e, st, None, None, None, 1.0, int(Divergence.JSD), PARAM)
    assert value.shape == gbar.shape == (0,) and value.dtype == torch.float32
    gx = ops.triton_divergence_backward(value, e, e, st, gbar, None, None, None, 1.0,
                                        int(Divergence.JSD), PARAM)
    assert gx.shape == (0, 7) and gx.dtype == torch.float32


def test_an_unknown_kind_is_a_value_error():
    x, y, _ = _pair(torch.float32, 7)
    st = _stats(x, y, None)
    with pytest.raises(ValueError, match="kind must be one of"):
        ops.triton_divergence(x, y, st, None, None, None, 1.0, 6, PARAM)
    with pytest.raises(ValueError, match="kind must be one of"):
        ops.triton_divergence_backward(torch.ones(3, 4, device=DEVICE), x, y, st,
                                       torch.zeros(3, 4, device=DEVICE), None, None, None, 1.0,
                                       -1, PARAM)


def test_host_side_no_sync_and_the_gradient_read_in_place(monkeypatch):
    """No host read in either op; the launches (one program per row here, the grad kernel);
    the expanded gradient of ``value.sum()`` read through its stride (no copy); strided rows
    (``logits[:, :-1]``) read in place, the same bits as contiguous ones."""
    base_x, base_y = (t.to(DEVICE) for t in make_logits((2, 5, 40), torch.float32, seed=3))
    x, y = base_x[:, :-1], base_y[:, :-1]
    mask = torch.ones(2, 4, dtype=torch.bool, device=DEVICE)
    st = _stats(x.contiguous(), y.contiguous(), mask)
    counter = _CountSyncs(monkeypatch)
    launches = _Launches(monkeypatch, counter)
    (value, gbar), fwd_ops = _count(tdiv.divergence_op, x, y, st, mask, None, None, TEMPERATURE,
                                    int(Divergence.JSD), PARAM)
    grad = torch.ones((), device=DEVICE).expand(2, 4)
    gx, bwd_ops = _count(tdiv.divergence_backward_op, grad, x, y, st, gbar, mask, None, None,
                         TEMPERATURE, int(Divergence.JSD), PARAM)
    assert counter.syncs == 0
    assert launches.names() == ["divergence_kernel", "divergence_grad_kernel"]
    assert "clone" not in fwd_ops + bwd_ops and "copy_" not in fwd_ops + bwd_ops, (fwd_ops, bwd_ops)
    assert len(fwd_ops) <= 8 and len(bwd_ops) <= 8, (fwd_ops, bwd_ops)
    want = tdiv.divergence_op(x.contiguous(), y.contiguous(), st, mask, None, None, TEMPERATURE,
                              int(Divergence.JSD), PARAM)
    assert torch.equal(value, want[0]) and torch.equal(gbar, want[1])
    want_x = tdiv.divergence_backward_op(torch.ones(2, 4, device=DEVICE), x.contiguous(),
                                         y.contiguous(), st, gbar, mask, None, None, TEMPERATURE,
                                         int(Divergence.JSD), PARAM)
    assert torch.equal(gx, want_x)


def test_the_mixture_log_ratio_is_float32_accurate():
    """la − log(wa·e^la + wb·e^lb) in the kernels' float32 against float64, δ = lb − la from
    −inf through 0 (exactly 0 there) to +inf, both weights."""

    @triton.jit  # decorated here: interpreted where this module's fixture set TRITON_INTERPRET
    def run(d_ptr, out_ptr, wa, wb, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(out_ptr + i, _minus_log_mix(tl.zeros([N], tl.float32), tl.load(d_ptr + i), wa, wb))

    pos = torch.logspace(-9, math.log10(300.0), 60, dtype=torch.float64)
    ends = torch.tensor([NINF, math.inf, 0.5, 1.0], dtype=torch.float64)
    d = torch.cat([-pos.flip(0), torch.tensor([0.0], dtype=torch.float64), pos, ends])
    d = torch.cat([d, d.new_zeros(128 - d.numel())]).float()
    for wa in (0.3, 0.9):
        wb = 1.0 - wa
        out = torch.empty_like(d).to(DEVICE)
        run[(1,)](d.to(DEVICE), out, wa, wb, N=128)
        dd = d.double()
        want = -torch.log(wa + wb * torch.exp(dd))  # la = 0
        want = torch.where(dd > 1.0, -dd - torch.log(wb + wa * torch.exp(-dd)), want)
        want = torch.where(dd.abs() < 1e-3, -torch.log1p(wb * torch.expm1(dd)), want)
        torch.testing.assert_close(out.cpu().double(), want, rtol=1e-6, atol=0)
        assert out[60].item() == 0.0  # δ = 0


@pytest.mark.parametrize("kind", list(klpenalty.DIVERGENCES))
def test_public_divergence_end_to_end(kind):
    """klpenalty.divergence(..., backend="triton"): the float64 reference's values and
    gradients (the reverse KL through the statistics kernels, the others through the second
    walk), masked positions 0 with a zero gradient, float64 logits through the streaming ops."""
    x, y = make_logits((2, 3, 37), torch.float32, seed=8)
    x[0, 1, 5] = NINF
    y[1, 0, :4] = NINF
    x[1, 0, :4] = NINF
    mask = torch.tensor([[True, True, False], [True, True, True]])
    x[0, 2] = float("nan")
    x, y, mask = x.to(DEVICE), y.to(DEVICE), mask.to(DEVICE)
    xs = x.clone().requires_grad_()
    got = klpenalty.divergence(xs, y, kind, beta=PARAM, skew=PARAM, mask=mask,
                               temperature=TEMPERATURE, backend="triton")
    (gx,) = torch.autograd.grad(got.sum(), xs)
    xd = x.double().requires_grad_()
    want = klpenalty.divergence(xd, y.double(), kind, beta=PARAM, skew=PARAM, mask=mask,
                                temperature=TEMPERATURE, backend="streaming")
    (gd,) = torch.autograd.grad(want.sum(), xd)
    ref = divergence_reference(x.double().nan_to_num(0.0), y.double(), kind, PARAM, PARAM,
                               TEMPERATURE).masked_fill(~mask, 0.0)
    torch.testing.assert_close(got.double(), ref, **tol(torch.float32))
    torch.testing.assert_close(got.double(), want, **tol(torch.float32))
    torch.testing.assert_close(gx.double(), gd, equal_nan=True, **grad_tol(torch.float32))
    assert got[0, 2].item() == 0.0 and torch.all(gx[0, 2] == 0)
    got64 = klpenalty.divergence(x.double(), y.double(), kind, beta=PARAM, skew=PARAM,
                                 mask=mask, temperature=TEMPERATURE, backend="triton")
    torch.testing.assert_close(got64, want.detach(), rtol=0, atol=0)


@pytest.mark.slow
def test_the_kernels_compile_for_a_cuda_target():
    """The three kernels lower to PTX for sm_90 (no GPU needed): the forward and the backward
    for every kind (with a mask), the forward's split variant and the backward without a mask
    for one, both with a keep and a threshold for one, the merge kernel: what the interpreter
    cannot catch."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = textwrap.dedent(f"""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from klpenalty.ops.triton import _kernels_divergence as k
        t = GPUTarget("cuda", 90, 32)
        rows = {{"T": "i32", **{{f"stride_{{a}}{{d}}": "i64" for a in "xyk" for d in "bt"}}}}
        sup = {{"keep_ptr": "*u8", "tau_ptr": "*fp32"}}
        scalars = {{"inv_t": "fp32", "w": "fp32", "wc": "fp32"}}
        fwd = {{"x_ptr": "*bf16", "y_ptr": "*fp32", **sup, "stats_ptr": "*fp32", "mask_ptr": "*u8",
               "value_ptr": "*fp32", "gbar_ptr": "*fp32", **rows, "V": "i32", "cols": "i32",
               "n_splits": "i32", **scalars}}
        bwd = {{"x_ptr": "*bf16", "y_ptr": "*fp32", **sup, "stats_ptr": "*fp32", "g_ptr": "*fp32",
               "gbar_ptr": "*fp32", "mask_ptr": "*u8", "gx_ptr": "*bf16", **rows,
               "stride_g": "i64", "V": "i32", **scalars}}
        merge = {{"parts_ptr": "*fp32", "value_ptr": "*fp32", "gbar_ptr": "*fp32",
                 "n_splits": "i32"}}
        cols_f = {tdiv._columns("divergence_kernel")!r}
        cols_b = {tdiv._columns("divergence_grad_kernel")!r}
        specs = []
        no = dict(HAS_KEEP=False, HAS_TAU=False)
        both = dict(HAS_KEEP=True, HAS_TAU=True)
        for kind in range({len(KINDS)}):
            specs.append((k.divergence_kernel, fwd, dict(KIND=kind, HAS_MASK=True, FINISH=True,
                          BLOCK={tdiv.MAX_BLOCK}, **no, **cols_f)))
            specs.append((k.divergence_grad_kernel, bwd, dict(KIND=kind, HAS_MASK=True,
                          BLOCK={tdiv.MAX_BLOCK}, TILES={ts.GRAD_TILES}, **no, **cols_b)))
        specs.append((k.divergence_kernel, fwd, dict(KIND=2, HAS_MASK=False, FINISH=False,
                                                     BLOCK={tdiv.MAX_BLOCK}, **both, **cols_f)))
        specs.append((k.divergence_grad_kernel, bwd, dict(KIND=1, HAS_MASK=False,
                      BLOCK={tdiv.MAX_BLOCK}, TILES={ts.GRAD_TILES}, **both, **cols_b)))
        specs.append((k.divergence_merge_kernel, merge, dict(SPLITS=8)))
        for fn, sig, c in specs:
            s = {{**sig, **{{name: "constexpr" for name in c}}}}
            assert ".entry" in triton.compile(ASTSource(fn=fn, signature=s, constexprs=c),
                                              target=t).asm["ptx"]
        print("OK", len(specs))
    """)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0 and f"OK {2 * len(KINDS) + 3}" in done.stdout, done.stderr[-3000:]
