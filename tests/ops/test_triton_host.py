"""The Triton backend's host side: no host synchronisation and a bounded number of eager ATen ops
per call (the kernels write out and stats, and take the upstream gradient's masking), strided
(B, T, V) rows read in place, every launch under the tensors' device, the split heuristic, and
the kernels' finish pinned to the engine's finalize and the contract's finish.

Runs where tests/ops/test_triton.py runs: compiled on a GPU, else on CPU tensors in Triton's
interpreter (the launches' own host work, the interpreter's copies, is left out of the counts).
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from klpenalty.ops import contract, engine
from klpenalty.ops import triton as triton_backend
from klpenalty.ops.triton import _host
from klpenalty.ops.triton import token_stats as ts
from klpenalty.ops.triton._load import _kernels
from klpenalty.ops.triton.threshold import digits
from klpenalty.ops.triton._kernels_stats import _expm1
from klpenalty.ops.reference import token_stats_reference
from tests.helpers import grad_tol, make_logits, patch_torch, tol, triton_interpreter_env
from tests.ops.cases import ref_token_stats_grads, token_stats_case
from tests.ops.test_engine import _CountSyncs

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
NINF = float("-inf")

triton = pytest.importorskip("triton", reason="Triton is not installed: pip install 'klpenalty[triton]'")
tl = triton.language

pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
]


@pytest.fixture(scope="module", autouse=True)
def _interpreter_on_cpu():
    with triton_interpreter_env():
        if not CUDA and not triton_backend.interpreted():
            pytest.fail("Triton was imported before TRITON_INTERPRET=1 was set: run through pytest")
        yield


class _Launches:
    """Replaces :func:`_host.launch`: records (kernel name, device) and runs the launch outside
    the counters (the interpreter's own copies are not the op's host work)."""

    def __init__(self, monkeypatch, counter=None):
        self.calls = []
        self.counter = counter
        original = _host.launch

        def launch(kernel, grid, device, *args, **kwargs):
            self.calls.append((kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel), device))
            before = None if self.counter is None else self.counter.syncs
            with _disable_current_modes():
                original(kernel, grid, device, *args, **kwargs)
            if before is not None:
                self.counter.syncs = before

        monkeypatch.setattr(_host, "launch", launch)

    def names(self):
        return [name for name, _ in self.calls]


class _CountOps(TorchDispatchMode):
    """The ATen ops dispatched on the host (views and allocations included)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _count(fn, *args):
    with _CountOps() as mode:
        result = fn(*args)
    return result, mode.ops


def _case(want_tokens=True, n_b=2, n_t=3, vocab=40, seed=3):
    x, y = (t.to(DEVICE) for t in make_logits((n_b, n_t, vocab), torch.float32, seed=seed))
    tokens = torch.randint(0, vocab, (n_b, n_t), generator=torch.Generator().manual_seed(seed))
    tokens = tokens.to(DEVICE)
    tokens[0, 1] = -100
    mask = torch.ones(n_b, n_t, dtype=torch.bool, device=DEVICE)
    mask[1, 2] = False
    return x, y, (tokens if want_tokens else None), mask


# --------------------------------------------------------------------------- host syncs
@pytest.mark.parametrize("check,expected", [(False, 0), (True, 1)])
def test_forward_and_backward_sync_only_for_the_check(monkeypatch, check, expected):
    """No host read and no tensor built from host data in a Triton forward or backward (all
    four statistics, a mask, a keep mask, split rows); check=True: its one read."""
    c = token_stats_case(torch.float32, device=DEVICE)
    x = c["x"].detach().requires_grad_()
    y = c["y"].detach().requires_grad_()
    with monkeypatch.context() as patch:
        counter = _CountSyncs(patch)
        _Launches(patch, counter)
        # the sampler's threshold too (computed in the kernels): top-k + top-p + min-p
        for chunk, sampler in [(0, (0, 1.0, 0.0)), (16, (0, 1.0, 0.0)), (0, (5, 0.9, 0.05))][
                :(1 if check else 3)]:
            counter.syncs = 0
            out, _ = torch.ops.klpenalty.triton_token_stats(
                x, y, c["tokens"], c["mask"], c["keep"], c["tau"], 0.7, -100, 15, check, 0, chunk,
                *sampler,
            )
            assert counter.syncs == expected
            counter.syncs = 0
            torch.autograd.grad((out * torch.linspace(-1, 1, 4, device=DEVICE)).sum(), (x, y))
            assert counter.syncs == 0


# --------------------------------------------------------------------------- eager ops per call
# Per call, as measured on this file's inputs (views and allocations only): the most the host may
# dispatch around the kernels. The host code that finished rows in torch dispatched 51 (KL), 108
# (all four, tokens and a mask) and 95 (KL, split rows) per forward, 12 to 44 per backward
# (benchmarks/triton_host_ops.py, benchmarks/README.md).
OP_BOUNDS = {"kl": 4, "all": 8, "kl-split": 5, "kl-sampler": 11, "backward-kl": 7,
             "backward-all": 11}


def test_eager_ops_per_call_are_few(monkeypatch):
    """Per call, the ops the host dispatches around the kernels: views, the outputs'
    allocations; the finish, the merge of split rows and the upstream gradient's masking run
    in the kernels (stats_kernel, merge_kernel, grad_kernel)."""
    x, y, tokens, mask = _case()
    launches = _Launches(monkeypatch)
    (out, st), ops = _count(ts.token_stats_op, x, y, None, None, None, None, 1.0, -100, 1,
                            False, 0, 0, 0, 1.0, 0.0)
    assert len(ops) <= OP_BOUNDS["kl"], ops
    assert launches.names() == ["stats_kernel"]
    (out4, st4), ops = _count(ts.token_stats_op, x, y, tokens, mask, None, None, 0.8, -100, 15,
                              False, 0, 0, 0, 1.0, 0.0)
    assert len(ops) <= OP_BOUNDS["all"], ops
    launches.calls.clear()
    (out_s, _), ops = _count(ts.token_stats_op, x, y, None, None, None, None, 1.0, -100, 1,
                             False, 0, 16, 0, 1.0, 0.0)
    assert len(ops) <= OP_BOUNDS["kl-split"], ops
    assert launches.names() == ["stats_kernel", "merge_kernel"]
    torch.testing.assert_close(out_s, out, **tol(torch.float32))
    launches.calls.clear()  # the sampler's threshold: its launches, its buffers
    _, ops = _count(ts.token_stats_op, x, y, None, None, None, None, 1.0, -100, 1, False, 0, 0,
                    5, 0.9, 0.05)
    assert len(ops) <= OP_BOUNDS["kl-sampler"], ops
    # float32 keys: top-k's digits (three of 11, 11 and 10 bits; five of 7 bits before Triton
    # 3.9), a histogram read each (the first with the row's max), the last select, top-k's set
    # listed (its buffers: the list, its length, its results)
    n_digits = len(digits(torch.float32, _kernels().RADIX_DIGIT))
    assert n_digits == (3 if _kernels().RADIX_DIGIT == 11 else 5)
    assert launches.names() == (["threshold_scan_kernel", "threshold_select_kernel"] * n_digits
                                + ["threshold_cand_kernel", "threshold_list_kernel",
                                   "threshold_kernel", "stats_kernel"])
    launches.calls.clear()  # top-p alone: the scan, the band (counted twice), its list
    ts.token_stats_op(x, y, None, None, None, None, 1.0, -100, 1, False, 0, 0, 0, 0.9, 0.0)
    assert launches.names() == ["threshold_scan_kernel", "threshold_cand_kernel",
                                "threshold_band_kernel", "threshold_cand_kernel",
                                "threshold_band_kernel", "threshold_cand_kernel",
                                "threshold_list_kernel", "threshold_kernel", "stats_kernel"]
    grad = torch.ones(2, 3, 4, device=DEVICE).expand(2, 3, 4)  # as autograd hands out.sum()'s
    (gx, _), ops = _count(ts.token_stats_backward_op, grad, x, y, None, None, st, None, None,
                          None, 1.0, -100, 1, True, False, 0, 0)
    assert len(ops) <= OP_BOUNDS["backward-kl"], ops
    grad = torch.linspace(-1, 1, 24, device=DEVICE).reshape(2, 3, 4)
    (gx, gy), ops = _count(ts.token_stats_backward_op, grad, x, y, tokens, None, st4, mask,
                           None, None, 0.8, -100, 15, True, True, 0, 0)
    assert len(ops) <= OP_BOUNDS["backward-all"], ops
    wx, wy = ref_token_stats_grads(x, y, tokens, mask, None, None, 0.8, -100, 15, grad)
    torch.testing.assert_close(gx.double(), wx, **grad_tol(torch.float32))
    torch.testing.assert_close(gy.double(), wy, **grad_tol(torch.float32))
    want = token_stats_reference(x, y, tokens, mask, None, None, 0.8, -100, 15)
    torch.testing.assert_close(out4.double(), want, **tol(torch.float32))


# --------------------------------------------------------------------------- strided rows
def test_the_usual_slice_is_read_in_place(monkeypatch):
    """logits[:, :-1] (B, T − 1, V) and a transpose of (B, T): no copy of the input in the
    forward or the backward op, the same bits as the contiguous input."""
    _Launches(monkeypatch)
    base_x, base_y = (t.to(DEVICE) for t in make_logits((2, 5, 33), torch.float32, seed=8))
    tokens = torch.randint(0, 33, (2, 4), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    g = torch.linspace(-1, 2, 32, device=DEVICE).reshape(2, 4, 4)
    for x, y in ((base_x[:, :-1], base_y[:, :-1]), (base_x.transpose(0, 1)[:4], base_y.transpose(0, 1)[:4])):
        tok = tokens if x.shape[:2] == (2, 4) else tokens.t().contiguous()
        gg = g if x.shape[:2] == (2, 4) else g.transpose(0, 1).contiguous()
        with _CountOps() as mode:
            out, st = ts.token_stats_op(x, y, tok, None, None, None, 0.9, -100, 15, False, 0, 0, 0,
                                          1.0, 0.0)
            gx, gy = ts.token_stats_backward_op(gg, x, y, tok, None, st, None, None, None, 0.9,
                                                 -100, 15, True, True, 0, 0)
        copies = [op for op in mode.ops if "copy" in op or "clone" in op or "contiguous" in op]
        assert not copies, mode.ops
        xc, yc = x.contiguous(), y.contiguous()
        out_c, st_c = ts.token_stats_op(xc, yc, tok, None, None, None, 0.9, -100, 15, False, 0, 0,
                                      0, 1.0, 0.0)
        assert torch.equal(out, out_c) and torch.equal(st, st_c)
        if x.shape[:2] == (2, 4):  # the slice: its gradients too
            gx_c, gy_c = ts.token_stats_backward_op(gg, xc, yc, tok, None, st_c, None, None,
                                                     None, 0.9, -100, 15, True, True, 0, 0)
            assert torch.equal(gx, gx_c) and torch.equal(gy, gy_c)


def test_row_strides_of_the_layouts():
    x = torch.zeros(3, 6, 10)
    assert _host.strides(x[:, :-1], 5)[1:] == (60, 10)
    assert _host.strides(x.transpose(0, 1), 3)[1:] == (10, 60)
    assert _host.strides(x[0], 6)[1:] == (0, 10)
    four = torch.zeros(2, 3, 4, 10)
    assert _host.strides(four[:, :, :-1], 3)[1:] == (40, 10)  # (2, 3) collapse to one stride
    t, sb, st = _host.strides(four[:, :2, :-1], 3)  # they do not: copied
    assert t.is_contiguous() and (sb, st) == (30, 10)
    t, _, _ = _host.strides(x.transpose(1, 2), 10)  # columns strided: copied
    assert t.is_contiguous()


# --------------------------------------------------------------------------- device of the launch
def test_launches_run_under_the_tensors_device(monkeypatch):
    """Triton launches on the current device: each launch makes the tensors' CUDA device
    current; a CPU launch (the interpreter) enters nothing."""
    entered = []

    class Recorder:
        def __init__(self, device):
            self.device = torch.device(device)

        def __enter__(self):
            entered.append(self.device)

        def __exit__(self, *exc):
            entered.append(None)

    seen = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append((grid, entered[-1] if entered else None))

    patch_torch(monkeypatch, torch.cuda, "device", Recorder)
    _host.launch(Kernel(), (3, 1), torch.device("cuda", 1), 1.0, BLOCK=16)
    assert seen == [((3, 1), torch.device("cuda", 1))] and entered[-1] is None
    _host.launch(Kernel(), (2,), torch.device("cpu"))
    assert seen[-1] == ((2,), None) and len(entered) == 2
    # every launch of the ops goes through _host.launch, with the tensors' device
    monkeypatch.undo()
    launches = _Launches(monkeypatch)
    x, y, tokens, mask = _case()
    xg = x.clone().requires_grad_()
    out, _ = torch.ops.klpenalty.triton_token_stats(xg, y, tokens, mask, None, None, 1.0, -100,
                                                   15, False, 0, 16, 0, 1.0, 0.0)
    out.sum().backward()
    torch.ops.klpenalty.triton_token_stats_state(x, y, None, None, 1.0, 15, 0, 0)
    assert launches.names() == ["stats_kernel", "merge_kernel", "grad_kernel", "stats_kernel"]
    assert {device for _, device in launches.calls} == {x.device}


# --------------------------------------------------------------------------- split heuristic
@pytest.mark.parametrize("vocab", [32000, 50257, 128256, 151936])
def test_split_plan_fills_whole_waves(vocab):
    """On 132 SMs: near-integral waves (the last one ≥ 90 % full) or ≥ 8 waves; where no split
    of the row gives that (too few rows), a split all the same (more programs than rows); the
    block divides the split; whole rows from 8 waves of rows on."""
    wave = ts.PROGRAMS_PER_SM * 132
    units = -(-vocab // ts.SPLIT_UNIT)
    counts = {-(-units // k) for k in range(1, units + 1)}  # every split count a plan can have

    def filled(programs):
        waves = programs / wave
        return waves >= 8 or waves / math.ceil(waves) >= 0.9

    for n in (1, 8, 64, 100, 256, 300, 528, 700, 1024, 2048, 4096, 5000, 16384, 32768):
        block, cols = ts.plan_splits(n, vocab, 132)
        splits = -(-vocab // cols)
        assert block <= ts.MAX_BLOCK and (splits == 1 or cols % block == 0)
        if any(filled(n * s) for s in counts):
            assert filled(n * splits), (n, vocab, splits, n * splits / wave)
        else:
            assert splits > 1, (n, vocab)
        if n >= 8 * wave:
            assert splits == 1
    assert -(-128256 // ts.plan_splits(256, 128256, 132)[1]) == 2  # 512 programs: 0.97 waves
    assert ts.plan_splits(1, 128256, 132)[1] == ts.SPLIT_UNIT  # one row: the finest split
    assert ts.plan_splits(64, 1000, 1) == (1024, 1000)  # one unit: never split
    assert ts.split_columns(1, 5000, torch.device("cpu"), vocab_chunk=100) == (128, 128)  # forced


def test_results_do_not_depend_on_the_split_count(monkeypatch):
    """Every statistic with a support, from the heuristic's split (a pretend GPU of 4 SMs) and
    forced splits, within the float32 tolerance of the float64 reference; gradients too."""
    c = token_stats_case(torch.float32, device=DEVICE)
    args = [c[k] for k in ("x", "y", "tokens", "mask", "keep", "tau")]
    want = token_stats_reference(*args, 0.7, -100, 15)
    x, y, tokens, mask, keep, tau = args
    vocab = x.shape[-1]
    # 37 columns in three units of 16, a wave of 16 programs, no fixed costs: two splits
    monkeypatch.setattr(ts, "SPLIT_UNIT", 16)
    monkeypatch.setattr(ts, "PROGRAM_OVERHEAD", 0)
    monkeypatch.setattr(ts, "MERGE_COST", 0)
    monkeypatch.setattr(ts, "_sm_count", lambda device: 4)
    ts.plan_splits.cache_clear()
    try:
        assert -(-vocab // ts.split_columns(6, vocab, DEVICE)[1]) > 1
        for chunk in (0, 16):  # the heuristic's two splits, three forced
            out, _ = torch.ops.klpenalty.triton_token_stats(*args, 0.7, -100, 15, False, 0, chunk,
                                                            0, 1.0, 0.0)
            torch.testing.assert_close(out.double(), want, **tol(torch.float32))
    finally:
        ts.plan_splits.cache_clear()


# --------------------------------------------------------------------------- the kernels' finish
def test_kernel_finish_matches_the_engine_finalize_and_contract_finish():
    """out and stats from the kernels (one program per row, and split rows merged by
    merge_kernel) against engine.stats_finalize + contract.finish on the state op's merged
    state, for every want, with rows without mass, KL = +inf, NaN, an ignored token and tokens
    off the support."""
    c = token_stats_case(torch.float32, device=DEVICE)
    x, y, tokens, mask, keep, tau = (c[k] for k in ("x", "y", "tokens", "mask", "keep", "tau"))
    x, y = x.clone(), y.clone()
    y[1, 0, 5] = NINF  # KL = +inf (policy mass where the reference has none)
    x[1, 2, 3] = float("nan")
    n, vocab = 6, x.shape[-1]
    cases = [(15, True, 16), (15, False, 0), (2, True, 0), (4, False, 0)]
    # (want, a support, split width)
    for want, support, chunk in cases:
        sup_keep, sup_tau = (keep, tau) if support else (None, None)
        out, st = torch.ops.klpenalty.triton_token_stats(
            x, y, tokens, mask, sup_keep, sup_tau, 0.8, -100, want, False, 0, chunk, 0, 1.0, 0.0
        )
        state, _ = torch.ops.klpenalty.triton_token_stats_state(
            x, y, sup_keep, sup_tau, 0.8, want, 0, chunk
        )
        merged = engine.state_from_tensor(state, want)
        kl, h, stats = engine.stats_finalize(merged, None)
        xf, yf = x.reshape(n, vocab), y.reshape(n, vocab)
        keep_rows = None if sup_keep is None else sup_keep.reshape(n, vocab)
        tau_rows = None if sup_tau is None else sup_tau.reshape(n)
        out_p, st_p = contract.finish(
            x, y, xf, yf, tokens, mask, sup_keep, sup_tau, keep_rows, tau_rows, merged,
            kl, h, stats, 0.8, -100, want, False,
        )
        label = f"want={want} support={sup_keep is not None} chunk={chunk}"
        torch.testing.assert_close(out, out_p, equal_nan=True, msg=label, **tol(torch.float32))
        torch.testing.assert_close(st, st_p, equal_nan=True, msg=label, **tol(torch.float32))


def test_expm1_of_the_backward_is_float32_accurate():
    """The backward's e^z − 1 (the token's 1 − p_t) against float64, from −30 to 0.6."""

    @triton.jit  # decorated here: interpreted where this module's fixture set TRITON_INTERPRET
    def run(z_ptr, out_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(out_ptr + i, _expm1(tl.load(z_ptr + i)))

    z = torch.cat([-torch.logspace(-9, math.log10(30), 60), torch.linspace(-0.6, 0.6, 60),
                   torch.tensor([0.0, NINF])]).float().to(DEVICE)
    z = torch.cat([z, z.new_zeros(128 - z.numel())])
    out = torch.empty_like(z)
    run[(1,)](z, out, N=128)
    torch.testing.assert_close(out.double(), torch.expm1(z.double()), **tol(torch.float32))
