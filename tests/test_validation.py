"""Bad input raises ValueError/TypeError naming the argument with its shape and dtype."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from klpenalty import full_kl, kl_penalized_reward, sampled_kl, shaped_rewards, token_logprobs
from klpenalty._validation import as_real

X = torch.randn(2, 3, 5)
Y = torch.randn(2, 3, 5)
R = torch.randn(2, 3)
TOK = torch.randint(0, 5, (2, 3))
NAN_X = X.clone()
NAN_X[1, 2, 4] = float("nan")
NAN_Y = Y.clone()
NAN_Y[0, 0, 0] = float("nan")

CASES = [
    # (call, exception, words that must appear in the message)
    (lambda: full_kl(X, torch.randn(2, 3, 6)), ValueError, ["policy_logits", "ref_logits", "(2, 3, 5)", "(2, 3, 6)"]),
    (lambda: full_kl(X, torch.randn(3, 3, 5)), ValueError, ["ref_logits", "(3, 3, 5)"]),
    (lambda: full_kl(X, Y[0]), ValueError, ["ref_logits", "(3, 5)"]),
    (lambda: full_kl(X.long(), Y), TypeError, ["policy_logits", "torch.int64"]),
    (lambda: full_kl(X, Y.int()), TypeError, ["ref_logits", "torch.int32"]),
    (lambda: full_kl(X.numpy(), Y), TypeError, ["policy_logits", "ndarray"]),
    (lambda: full_kl(torch.tensor(1.0), torch.tensor(1.0)), ValueError, ["policy_logits", "(..., V)"]),
    (lambda: full_kl(X, Y, mask=torch.ones(2, 3)), TypeError, ["mask", "bool", "torch.float32"]),
    (lambda: full_kl(X, Y, mask=torch.ones(3, dtype=torch.bool)), ValueError, ["mask", "(2, 3)", "(3,)"]),
    (lambda: full_kl(X, Y, mask=torch.ones(2, 3, 5, dtype=torch.bool)), ValueError, ["mask", "(2, 3, 5)"]),
    (lambda: full_kl(X, Y, temperature=0.0), ValueError, ["temperature", "> 0"]),
    (lambda: full_kl(X, Y, temperature=-1), ValueError, ["temperature"]),
    (lambda: full_kl(X, Y, temperature=float("nan")), ValueError, ["temperature"]),
    (lambda: full_kl(X, Y, temperature="1"), TypeError, ["temperature"]),
    (lambda: full_kl(X, Y, temperature=1e300), ValueError, ["temperature", "float32"]),
    (lambda: full_kl(X, Y, temperature=1e-40), ValueError, ["temperature", "float32"]),
    (lambda: full_kl(NAN_X, Y), ValueError, ["policy_logits", "NaN", "(2, 3, 5)"]),
    (lambda: full_kl(X, NAN_Y), ValueError, ["ref_logits", "NaN"]),
    (lambda: full_kl(X, Y, backend="fastest"), ValueError, ["backend", "'auto'", "'streaming'"]),
    (lambda: kl_penalized_reward(X, Y, R[0]), ValueError, ["reward", "(2, 3)", "(3,)"]),
    (lambda: kl_penalized_reward(X, Y, R.unsqueeze(-1)), ValueError, ["reward", "(2, 3, 1)"]),
    (lambda: kl_penalized_reward(X, Y, R.long()), TypeError, ["reward", "torch.int64"]),
    (lambda: kl_penalized_reward(X, Y, R, beta=-0.1), ValueError, ["beta", ">= 0"]),
    (lambda: kl_penalized_reward(X, Y, R, beta=float("inf")), ValueError, ["beta"]),
    (lambda: token_logprobs(X, TOK.float()), TypeError, ["tokens", "integer", "torch.float32"]),
    (lambda: token_logprobs(X, TOK.bool()), TypeError, ["tokens", "torch.bool"]),
    (lambda: token_logprobs(X, TOK + 5), ValueError, ["tokens", "[0, 5)"]),
    (lambda: token_logprobs(X, TOK - 5), ValueError, ["tokens", "[0, 5)"]),
    (lambda: token_logprobs(X, TOK[0]), ValueError, ["tokens", "(2, 3)", "(3,)"]),
    (lambda: token_logprobs(X.half().long(), TOK), TypeError, ["logits", "torch.int64"]),
    (lambda: token_logprobs(NAN_X, TOK), ValueError, ["logits", "NaN"]),
    (lambda: sampled_kl(R, R[0]), ValueError, ["ref_logprobs", "(3,)"]),
    (lambda: sampled_kl(R.long(), R), TypeError, ["logprobs", "torch.int64"]),
    (lambda: sampled_kl(R, R, estimator="k4"), ValueError, ["estimator", "'k1'", "'k2'", "'k3'", "'abs'"]),
    (lambda: shaped_rewards(torch.ones(3), R, R > 0, 0.1), ValueError, ["scores", "(2,)", "(3,)"]),
    (lambda: shaped_rewards(torch.ones(2), R, (R > 0).float(), 0.1), TypeError, ["mask", "bool"]),
    (lambda: shaped_rewards(torch.ones(2), R, torch.ones(2, 4, dtype=torch.bool), 0.1), ValueError, ["mask", "(2, 4)"]),
]


@pytest.mark.parametrize("call, exc, words", CASES)
def test_bad_input_raises_with_a_clear_message(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


def test_all_minus_inf_row_is_named_not_nan():
    x = torch.randn(2, 4)
    x[1] = float("-inf")
    with pytest.raises(ValueError, match=re.escape("all -inf")):
        full_kl(x, torch.randn(2, 4))


@pytest.mark.parametrize(
    "value, expected",
    [
        (3, 3.0),
        (2.5, 2.5),
        (np.float32(0.25), 0.25),
        (np.float64(-1.5), -1.5),
        (np.int64(7), 7.0),
        (np.uint8(200), 200.0),
        (np.array(0.5), 0.5),
        (torch.tensor(0.75), 0.75),
        (torch.tensor([4], dtype=torch.int32), 4.0),
        (torch.tensor([[2.0]], requires_grad=True), 2.0),
        (float("inf"), float("inf")),  # finiteness is the caller's check
    ],
)
def test_as_real_accepts_numbers_numpy_scalars_and_one_element_tensors(value, expected):
    out = as_real("x", value)
    assert type(out) is float and out == expected


@pytest.mark.parametrize(
    "value, words",
    [
        (True, ["bool"]),
        (np.bool_(False), ["bool"]),
        ("1.0", ["str"]),
        (1j, ["complex"]),
        (np.complex128(1.0), ["complex128"]),
        (np.ones(2), ["ndarray"]),
        (None, ["NoneType"]),
        (torch.ones(2, 3), ["shape=(2, 3)", "torch.float32"]),
        (torch.tensor(True), ["shape=()", "torch.bool"]),
        (torch.tensor(1 + 1j), ["torch.complex64"]),
    ],
)
def test_as_real_rejects_everything_else_naming_the_argument(value, words):
    with pytest.raises(TypeError, match="my_arg") as info:
        as_real("my_arg", value)
    for word in words:
        assert word in str(info.value)


def test_temperature_and_beta_accept_numpy_scalars():
    torch.testing.assert_close(full_kl(X, Y, temperature=np.float32(0.5)), full_kl(X, Y, temperature=0.5))
    torch.testing.assert_close(
        kl_penalized_reward(X, Y, R, beta=np.float64(0.1)), kl_penalized_reward(X, Y, R, beta=0.1)
    )
