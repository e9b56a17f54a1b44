"""The native CPU kernel against the float64 reference: the shared grid, −inf patterns, strides,
offsets, gradients, the error messages, the fallback path and the build cache.

Also run on the native kernel: the backend-parametrised tests of test_streaming.py, and the
fullgraph torch.compile step of test_engine.py (parametrised over the CPU backend)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import klpenalty
from klpenalty.ops import native, streaming
from klpenalty.ops.reference import full_kl_reference, token_logprobs_reference
from tests.conftest import DTYPES, make_logits, tol
from tests.ops.cases import (
    check_kl_and_grads,
    check_minus_inf_patterns,
    check_token_logprobs_and_grads,
)

NINF = float("-inf")
HAS_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler: native cannot build")

# rows longer than one chunk of the kernel (2048) and than one vector block; V = 1; odd V
SHAPES = [((3,), 1), ((2, 3), 37), ((4,), 64), ((2, 2), 2048 + 37), ((3,), 9001)]


def _kl(x, y, mask=None, temperature=1.0, check=True):
    return native.full_kl(x, y, mask, temperature, check=check)


def test_kernel_builds_where_a_compiler_exists():
    assert native.available()
    assert klpenalty.ops.dispatch.get_backend("auto", torch.device("cpu")) is native
    assert native.isa() in ("AVX512", "AVX2", "DEFAULT")
    assert native.isa().lower() in native.build_name()
    assert native.status().startswith(f"native ({native.isa()})")


# --------------------------------------------------------------------------- reference grid
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("leading,vocab", SHAPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_full_kl_values_and_gradients_match_reference(dtype, leading, vocab, temperature):
    x, y = make_logits((*leading, vocab), dtype, seed=vocab)
    mask = torch.ones(leading, dtype=torch.bool)
    mask.view(-1)[-1] = False  # a masked row holding garbage
    x.view(-1, vocab)[-1] = NINF
    y.view(-1, vocab)[-1] = float("nan")
    x.requires_grad_()
    y.requires_grad_()
    check_kl_and_grads(_kl(x, y, mask, temperature), x, y, mask, temperature, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("leading,vocab", SHAPES)
def test_token_logprobs_values_and_gradients_match_reference(dtype, leading, vocab):
    x, _ = make_logits((*leading, vocab), dtype, seed=vocab + 1)
    x.requires_grad_()
    gen = torch.Generator().manual_seed(vocab)
    tokens = torch.randint(0, vocab, leading, generator=gen)
    tokens.view(-1)[0] = -100  # ignored position
    out = native.token_logprobs(x, tokens, 1.3, ignore_index=-100, check=True)
    check_token_logprobs_and_grads(out, x, tokens, 1.3, dtype)


def test_stats_match_the_streaming_op():
    """The same (..., 6) backward stats as the streaming engine, careful flags included."""
    x, y = make_logits((5, 3000), torch.float32, seed=3)
    x[1, 7] = NINF  # policy −inf: the 0·log 0 arithmetic
    y[2, 9] = NINF  # reference −inf where the policy has mass: KL = +inf
    args = (None, 0.9, False, 0, 0)
    kl_n, st_n = torch.ops.klpenalty.native_full_kl(x, y, *args)
    kl_s, st_s = torch.ops.klpenalty.streaming_full_kl(x, y, *args)
    torch.testing.assert_close(kl_n, kl_s, **tol(torch.float32))
    torch.testing.assert_close(st_n, st_s, atol=2e-6, rtol=1e-5)
    assert st_n[:, 5].tolist() == [0.0, 1.0, 1.0, 0.0, 0.0]
    lp_n, lst_n = torch.ops.klpenalty.native_token_logprobs(x, torch.arange(5), 0.9, -100, False, 0, 0)
    lp_s, lst_s = torch.ops.klpenalty.streaming_token_logprobs(x, torch.arange(5), 0.9, -100, False, 0, 0)
    torch.testing.assert_close(lst_n, lst_s, **tol(torch.float32))


# --------------------------------------------------------------------------- −inf patterns
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [10, 2048 + 100])
def test_minus_inf_patterns(dtype, vocab):
    check_minus_inf_patterns(
        lambda a, b: _kl(a, b, check=False), vocab, dtype, [2, 7, vocab - 1]
    )


def test_hand_values_and_rows_without_a_distribution():
    t = torch.tensor
    assert _kl(t([[0.0, NINF]]), t([[0.0, 0.0]])).item() == pytest.approx(0.6931471805599453)
    assert _kl(t([[0.0, 0.0, NINF]]), t([[0.0, NINF, NINF]])).item() == float("inf")
    same = t([[1.0, NINF, -2.0, NINF]])
    assert _kl(same, same.clone()).item() == 0.0
    x, y = make_logits((3, 4, 77), torch.float32, seed=12)
    assert torch.all(_kl(x, x.clone(), temperature=0.3) == 0)  # exactly 0, bit for bit
    rows = torch.zeros(4, 5)
    rows[0] = NINF  # no policy mass
    rows[1, 2] = float("inf")
    rows[2, 3] = float("nan")
    kl = _kl(rows, torch.zeros(4, 5), check=False)
    assert torch.isnan(kl[:3]).all() and kl[3].item() == 0.0
    lp = native.token_logprobs(rows, torch.zeros(4, dtype=torch.long), 1.0, check=False)
    want = streaming.token_logprobs(rows, torch.zeros(4, dtype=torch.long), 1.0, check=False)
    torch.testing.assert_close(lp, want, equal_nan=True)


# --------------------------------------------------------------------------- strides, offsets
def test_non_contiguous_inputs_give_the_contiguous_results():
    x, y = make_logits((2, 6, 301), torch.float32, seed=21)
    views = [
        (x[:, :-1], y[:, :-1]),  # rows with a gap: leading strides only
        (x[..., :-1], y[..., :-1]),  # vocabulary slice: row stride V + 1
        (x.transpose(0, 1), y.transpose(0, 1)),
        (x.transpose(-1, -2).contiguous().transpose(-1, -2), y),  # last-dim stride ≠ 1: copied
    ]
    for a, b in views:
        want = _kl(a.contiguous(), b.contiguous())
        assert torch.equal(_kl(a, b), want)
        tokens = torch.zeros(a.shape[:-1], dtype=torch.long)
        got_lp = native.token_logprobs(a, tokens, 0.8)
        assert torch.equal(got_lp, native.token_logprobs(a.contiguous(), tokens, 0.8))
    xs = x[:, :-1].clone().requires_grad_()
    view = xs[:, ::2]  # a strided view inside autograd
    (g,) = torch.autograd.grad(_kl(view, y[:, :3]).sum(), (xs,))
    (g_ref,) = torch.autograd.grad(_kl(view.contiguous(), y[:, :3]).sum(), (xs,))
    assert torch.equal(g, g_ref)


@pytest.mark.parametrize("offset_x,offset_y", [(1e4, -1e4), (-1e4, 1e4), (3e3, -50.0)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_large_opposite_offsets_keep_float32_accuracy(offset_x, offset_y, temperature):
    x, y = make_logits((6, 3000), torch.float64, seed=17, scale=2.0)
    xs, ys = (x + offset_x).float(), (y + offset_y).float()
    want = full_kl_reference(xs, ys, temperature)  # on the same float32 values
    torch.testing.assert_close(_kl(xs, ys, temperature=temperature).double(), want, **tol(torch.float32))
    tokens = torch.arange(6)
    lp = native.token_logprobs(xs, tokens, temperature)
    torch.testing.assert_close(lp.double(), token_logprobs_reference(xs, tokens, temperature), **tol(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_kl_stays_within_2e6_nats(dtype):
    """KL ≈ 12 at T = 0.7: float lanes summing a whole 2048-element chunk lost up to 4.4e-6
    nats (bf16); partial sums widened into double every 4 blocks keep it below 2e-6."""
    x, y = make_logits((16, 32000), torch.float64, seed=5, scale=5.0)
    y = x + 5.0 * (y - x) / 2.5  # noise of scale 5: KL ≈ 12
    x, y = x.to(dtype), y.to(dtype)
    want = full_kl_reference(x, y, 0.7)
    assert want.mean() > 8
    err = (_kl(x, y, temperature=0.7).double() - want).abs().max().item()
    assert err <= 2e-6


def test_mixed_dtypes_empty_batch_and_threads():
    x, y = make_logits((3, 4, 500), torch.float32, seed=2)
    xb = x.bfloat16().requires_grad_()
    y.requires_grad_()
    kl = _kl(xb, y)
    torch.testing.assert_close(kl.double(), full_kl_reference(xb.detach(), y.detach()), **tol(torch.float32))
    gx, gy = torch.autograd.grad(kl.sum(), (xb, y))
    assert gx.dtype == torch.bfloat16 and gy.dtype == torch.float32
    empty = torch.zeros(0, 7)
    assert _kl(empty, empty).shape == (0,)
    assert native.token_logprobs(empty, torch.zeros(0, dtype=torch.long), 1.0).shape == (0,)
    big_x, big_y = make_logits((64, 4096), torch.float32, seed=4)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _kl(big_x, big_y)
        torch.set_num_threads(2)
        two = _kl(big_x, big_y)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)  # rows are independent: the split cannot change a bit


# --------------------------------------------------------------------------- autograd
def test_gradcheck_in_float64():
    x, y = make_logits((4, 9), torch.float64, seed=9)
    x.requires_grad_()
    y.requires_grad_()
    mask = torch.tensor([True, False, True, True])
    assert torch.autograd.gradcheck(lambda a, b: _kl(a, b, mask, 0.7), (x, y), eps=1e-6, atol=1e-8)
    tokens = torch.tensor([0, 8, -100, 5])
    assert torch.autograd.gradcheck(
        lambda a: native.token_logprobs(a, tokens, 1.7), (x,), eps=1e-6, atol=1e-8
    )
    # double backward: the shared differentiable fallback
    assert torch.autograd.gradgradcheck(lambda a, b: _kl(a, b, mask, 0.7), (x, y), eps=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- errors
def _message(fn):
    with pytest.raises(ValueError) as info:
        fn()
    return str(info.value)


@pytest.mark.parametrize("leading", [(), (2,), (2, 3)])
def test_check_errors_read_exactly_like_the_streaming_ones(leading):
    x, y = make_logits((*leading, 6), torch.float32, seed=1)
    bad_x = x.clone()
    bad_x.view(-1, 6)[-1, 2] = float("nan")
    bad_y = y.clone()
    bad_y.view(-1, 6)[-1, 0] = float("nan")
    no_mass = y.clone()
    no_mass.view(-1, 6)[-1] = NINF
    tokens = torch.zeros(leading, dtype=torch.long)
    tokens.view(-1)[-1] = 6
    cases = [
        lambda b: b.full_kl(bad_x, y, None, 1.0, check=True),
        lambda b: b.full_kl(x, bad_y, None, 1.0, check=True),
        lambda b: b.full_kl(x, no_mass, None, 1.0, check=True),
        lambda b: b.token_logprobs(bad_x, torch.zeros(leading, dtype=torch.long), 1.0, check=True),
        lambda b: b.token_logprobs(x, tokens.int(), 1.0, check=True),
    ]
    for case in cases:
        assert _message(lambda: case(native)) == _message(lambda: case(streaming))
    # check=False: NaN in the result, no error; masked rows may hold anything
    assert torch.isnan(native.full_kl(bad_x, y, None, 1.0, check=False).view(-1)[-1])
    mask = torch.ones(leading, dtype=torch.bool)
    mask.view(-1)[-1] = False
    assert native.full_kl(bad_x, no_mass, mask, 1.0, check=True).view(-1)[-1].item() == 0.0


def test_ops_validate_their_arguments_when_called_directly():
    x, y = make_logits((2, 5), torch.float32)
    ops = torch.ops.klpenalty
    with pytest.raises(TypeError, match="policy_logits must be a floating-point"):
        ops.native_full_kl(x.long(), y, None, 1.0, False, 0, 0)
    with pytest.raises(ValueError, match="same shape"):
        ops.native_full_kl(x, y[:, :4], None, 1.0, False, 0, 0)
    with pytest.raises(ValueError, match="temperature must be finite and > 0"):
        ops.native_full_kl(x, y, None, 0.0, False, 0, 0)
    with pytest.raises(TypeError, match="mask must be a bool tensor"):
        ops.native_full_kl(x, y, torch.ones(2), 1.0, False, 0, 0)
    with pytest.raises(TypeError, match="tokens must be an integer tensor"):
        ops.native_token_logprobs(x, torch.zeros(2), 1.0, -100, False, 0, 0)
    with pytest.raises(IndexError, match="out of range"):  # check=False never reads past a row
        ops.native_token_logprobs(x, torch.tensor([0, 5]), 1.0, -100, False, 0, 0)


# --------------------------------------------------------------------------- fallback, cache
def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **env}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, full_env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, env=full_env, timeout=300, cwd=ROOT,
    )


_FALLBACK_CHILD = """
    import warnings
    import torch, klpenalty
    from klpenalty.ops import native
    from klpenalty.ops.reference import full_kl_reference
    from tests.conftest import make_logits, tol
    x, y = make_logits((3, 50), torch.float32, seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kl = klpenalty.full_kl(x, y)
        kl2 = klpenalty.full_kl(x, y, backend="native")
        lp = klpenalty.token_logprobs(x, torch.zeros(3, dtype=torch.long), backend="native")
    torch.testing.assert_close(kl.double(), full_kl_reference(x, y), **tol(torch.float32))
    assert torch.equal(kl, kl2) and lp.shape == (3,)
    mine = [w for w in caught if "native CPU kernel" in str(w.message)]
    assert len(mine) == 1 and mine[0].category is RuntimeWarning, [str(w.message) for w in caught]
    print("WARNING:", mine[0].message)
    print("STATUS:", native.status())
"""


# answers version queries like the real compiler, fails every compilation
_FAILING_CXX = """#!/bin/sh
case "$1" in --version|-v|-dumpversion|-dumpfullversion) exec c++ "$@";; esac
echo "klpenalty_native.cpp:1:1: error: simulated compiler failure" >&2
exit 1
"""


@pytest.mark.parametrize("missing", [True, False], ids=["no-compiler", "failed-build"])
def test_fallback_without_a_working_compiler_warns_once_and_matches(tmp_path, missing):
    if missing:
        cxx, reasons = "/nonexistent/c++", ["no C++ compiler: '/nonexistent/c++' not found"]
    else:
        cxx = str(tmp_path / "failing-c++")
        with open(cxx, "w") as f:
            f.write(_FAILING_CXX)
        os.chmod(cxx, 0o755)
        reasons = ["the build failed: klpenalty_native.cpp:1:1: error: simulated compiler failure"]
        reasons.append(f"full log in {tmp_path / 'ext'}")
    done = _run(_FALLBACK_CHILD, {"CXX": cxx, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")})
    assert done.returncode == 0, done.stderr
    assert all(reason in done.stdout for reason in reasons), done.stdout
    assert "pip install ninja" in done.stdout
    assert "STATUS: streaming (native unavailable" in done.stdout


def test_fallback_in_process_when_the_loader_fails(monkeypatch):
    def broken():
        raise RuntimeError("simulated build failure")

    monkeypatch.setattr(native, "_load", broken)
    monkeypatch.setattr(native, "_error", None)
    monkeypatch.setattr(native, "_warned", False)
    x, y = make_logits((2, 40), torch.float32, seed=3)
    with pytest.warns(RuntimeWarning, match="simulated build failure") as record:
        kl = native.full_kl(x, y, None, 1.0)
        lp = native.token_logprobs(x, torch.tensor([1, 2]), 1.0)
    assert len(record) == 1
    assert torch.equal(kl, streaming.full_kl(x, y, None, 1.0))
    assert torch.equal(lp, streaming.token_logprobs(x, torch.tensor([1, 2]), 1.0))
    assert klpenalty.ops.dispatch.get_backend("auto", torch.device("cpu")) is streaming


_LOAD_CHILD = """
    import time, torch
    from klpenalty.ops import native
    t0 = time.perf_counter()
    ok = native.available()
    print("LOAD", ok, time.perf_counter() - t0)
    x = torch.randn(2, 3000, generator=torch.Generator().manual_seed(0))
    print("KL", native.full_kl(x, 0.5 * x, None, 1.0).tolist())
"""


@pytest.mark.slow
def test_cold_build_then_a_second_process_loads_from_the_cache(tmp_path, monkeypatch):
    """A fresh cache (with a stale lock left by a killed build): one process compiles, printing
    one line; the next loads the cached library in well under a second, without compiling."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    directory = native.build_dir()
    directory.mkdir(parents=True)
    lock = directory / "lock"
    lock.touch()
    old = time.time() - 2 * native.STALE_LOCK_SECONDS
    os.utime(lock, (old, old))
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path)}
    cold = _run(_LOAD_CHILD, env)
    assert cold.returncode == 0, cold.stderr
    assert cold.stderr.count("klpenalty: compiling the native CPU kernel") == 1
    assert "LOAD True" in cold.stdout
    warm = _run(_LOAD_CHILD, env)
    assert warm.returncode == 0, warm.stderr
    assert "compiling" not in warm.stderr
    load_s = float(warm.stdout.split("LOAD True ")[1].split()[0])
    assert load_s < 1.0
    assert warm.stdout.split("KL")[1] == cold.stdout.split("KL")[1]
