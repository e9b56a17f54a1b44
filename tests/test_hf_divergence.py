"""klpenalty.hf.causal_lm_divergence on tiny random causal LMs (no downloads): a student and a
teacher of another architecture and hidden size, against klpenalty.divergence on the models'
own (materialised) logits, values and the gradient of every student parameter."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import klpenalty  # noqa: E402
from klpenalty.hf import causal_lm_divergence, generate_position_ids  # noqa: E402
from klpenalty.ops.reference import divergence_reference  # noqa: E402

from .helpers import grad_tol, tol  # noqa: E402

V, B, T = 64, 3, 9


def tiny(config: str, model: str, hidden: int, seed: int, **extra) -> torch.nn.Module:
    cfg = getattr(transformers, config)(
        vocab_size=V, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3, pad_token_id=0,
        **extra,
    )
    torch.manual_seed(seed)
    return getattr(transformers, model)(cfg).eval().double()


@pytest.fixture(scope="module")
def pair():
    student = tiny("Qwen2Config", "Qwen2ForCausalLM", 32, seed=1)
    teacher = tiny("LlamaConfig", "LlamaForCausalLM", 48, seed=2).requires_grad_(False)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, V, (B, T), generator=g)
    attention = torch.ones(B, T, dtype=torch.long)
    attention[1, :3] = 0  # left padding
    ids[1, :3] = 0
    return student, teacher, ids, attention


def _materialised(student, teacher, ids, attention):
    """Both models' own (B, T - 1, V) logits (the teacher's without gradients) and the counted
    positions, as a plain training loop aligns them."""
    pos = generate_position_ids(attention)
    zs = student(input_ids=ids, attention_mask=attention, position_ids=pos).logits[:, :-1]
    with torch.no_grad():
        zt = teacher(input_ids=ids, attention_mask=attention, position_ids=pos).logits[:, :-1]
    return zs, zt, (attention[:, 1:] * attention[:, :-1]).bool()


@pytest.mark.parametrize("kind", klpenalty.DIVERGENCES)
def test_matches_the_materialised_logits(pair, kind):
    student, teacher, ids, attention = pair
    student.zero_grad()
    got = causal_lm_divergence(student, teacher, ids, attention, kind, temperature=0.9,
                               beta=0.3, skew=0.2)
    assert got.shape == (B, T - 1) and got.dtype == torch.float64
    got.sum().backward()
    fused = {n: p.grad.clone() for n, p in student.named_parameters()}
    student.zero_grad()
    zs, zt, counted = _materialised(student, teacher, ids, attention)
    want = torch.where(counted, divergence_reference(zs, zt, kind, 0.3, 0.2, 0.9), 0.0)
    torch.testing.assert_close(got, want.detach(), **tol(torch.float64))
    want.sum().backward()
    for name, p in student.named_parameters():
        assert fused[name] is not None, name
        torch.testing.assert_close(fused[name], p.grad, **grad_tol(torch.float64), msg=name)
    assert all(p.grad is None for p in teacher.parameters())


@pytest.mark.parametrize("kind", ["forward_kl", "jsd", "tvd"])
def test_the_sampled_support_matches_the_materialised_logits(pair, kind):
    """top_p / min_p on the student (the sampler's, with its temperature): the same truncated
    π̃ as klpenalty.divergence on the student's own logits, values and every student
    parameter's gradient; a top_k that cuts everything but one token: KL(ν‖π̃) = +inf."""
    student, teacher, ids, attention = pair
    student.zero_grad()
    got = causal_lm_divergence(student, teacher, ids, attention, kind, temperature=0.9,
                               beta=0.3, top_p=0.8, min_p=0.02)
    w = torch.linspace(0.5, 1.5, got.numel(), dtype=torch.float64).reshape(got.shape)
    (got * w).sum().backward()
    fused = {n: p.grad.clone() for n, p in student.named_parameters()}
    student.zero_grad()
    zs, zt, counted = _materialised(student, teacher, ids, attention)
    want = klpenalty.divergence(zs, zt, kind, mask=counted, temperature=0.9, beta=0.3,
                                top_p=0.8, min_p=0.02)
    torch.testing.assert_close(got, want.detach(), **tol(torch.float64))
    (want * w).sum().backward()
    for name, p in student.named_parameters():
        torch.testing.assert_close(fused[name], p.grad, **grad_tol(torch.float64), msg=name)
    with torch.no_grad():
        one = causal_lm_divergence(student, teacher, ids, attention, "forward_kl", top_k=1)
    assert torch.isposinf(one[counted]).all() and torch.all(one[~counted] == 0)


def test_bad_kind_raises_before_the_models_run(pair):
    student, teacher, ids, attention = pair
    with pytest.raises(ValueError, match="kind must be one of"):
        causal_lm_divergence(student, teacher, ids, attention, "kl")


def test_errors_name_the_student_and_the_teacher(pair):
    student, _, ids, attention = pair
    cfg = transformers.LlamaConfig(vocab_size=V + 8, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2)
    other = transformers.LlamaForCausalLM(cfg).double()
    with pytest.raises(ValueError, match="student_model and teacher_model must have the same vocabulary"):
        causal_lm_divergence(student, other, ids, attention, "jsd")


def test_expected_grads_give_the_same_parameter_gradients(pair, monkeypatch):
    """A plan of the loss's upstream gradients (rows index the (B, T - 1) values row-major):
    the student's gradients are formed in the forward (no head multiplied in the backward) and
    equal the recomputing path's."""
    from klpenalty.linear import kl as kl_module

    student, teacher, ids, attention = pair
    w = torch.linspace(-1.0, 1.0, B * (T - 1), dtype=torch.float64)
    calls = []
    original = kl_module._logits
    monkeypatch.setattr(kl_module, "_logits", lambda h, *a: calls.append(1) or original(h, *a))
    grads, counts = [], []
    for plan in (None, lambda rows, values: w[rows]):
        student.zero_grad()
        calls.clear()
        got = causal_lm_divergence(student, teacher, ids, attention, "jsd", chunk_rows=5,
                                   expected_grads=plan)
        forward = len(calls)
        (got.reshape(-1) * w).sum().backward()
        counts.append((forward, len(calls) - forward))
        grads.append({n: p.grad.clone() for n, p in student.named_parameters()})
    assert counts[0][1] == counts[0][0] > 0 and counts[1] == (counts[0][0], 0)
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], **grad_tol(torch.float64))
