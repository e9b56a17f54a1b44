"""klpenalty.hf.causal_lm_kl on tiny, randomly initialised Hugging Face causal LMs (no downloads)
against the plain path: ``model(input_ids, attention_mask, position_ids).logits`` shifted, then
the float64 reference (values) and full_kl / token_logprobs / entropy (gradients)."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import klpenalty.hf as hf  # noqa: E402
from klpenalty import entropy, full_kl, token_logprobs  # noqa: E402
from klpenalty.hf import (  # noqa: E402
    SUPPORTED_ARCHITECTURES,
    causal_lm_kl,
    generate_position_ids,
    scored_positions,
)
from klpenalty.ops.reference import (  # noqa: E402
    entropy_reference,
    full_kl_reference,
    token_logprobs_reference,
)

from .helpers import grad_tol, tol  # noqa: E402

V = 96  # vocabulary
B, T, PROMPT = 3, 10, 4  # batch, sequence, prompt length (before padding)
# Initialisation std 0.3 gives logits of std ~1.5 after a 32-wide head, so the KL is ~0.1-1
# rather than the ~0.01 of two near-uniform models (HF's default 0.02).
INIT = 0.3
DECODER = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=INIT,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

# config.model_type -> (config class, model class, config overrides). The transforms are set
# far from identity (soft-cap 2 on logits of std ~1.5, scales 0.5 and 1/3) so that a path
# ignoring them fails.
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=8)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=8)),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(head_dim=8, final_logit_softcapping=2.0, query_pre_attn_scalar=8),
    ),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(logit_scale=0.5)),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(logits_scaling=3.0)),
    "phi": ("PhiConfig", "PhiForCausalLM", {}),  # LM head with a bias
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",  # LM head tied to the token embedding
        dict(n_embd=32, n_layer=2, n_head=4, n_positions=32, vocab_size=V,
             initializer_range=INIT, bos_token_id=1, eos_token_id=2, pad_token_id=0),
    ),
}


def make_model(arch: str, seed: int, **overrides) -> torch.nn.Module:
    """A tiny randomly initialised causal LM in eval mode (no dropout)."""
    config_name, model_name, extra = ARCHS[arch]
    kwargs = dict(extra) if arch == "gpt2" else {**DECODER, **extra}
    kwargs.update(overrides)
    config = getattr(transformers, config_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    if arch == "phi":  # HF initialises biases to 0: give the head's bias values that matter
        with torch.no_grad():
            model.lm_head.bias.normal_(0.0, 1.0)
    return model


def model_pair(arch: str, **overrides):
    """Policy and a different reference (another seed), the reference frozen."""
    return make_model(arch, 1, **overrides), make_model(arch, 2, **overrides).requires_grad_(False)


def batch(left_padding: bool):
    """(input_ids, attention_mask, response) (B, T): prompt of PROMPT tokens then a response;
    row 1 is 3 tokens shorter (padded on the left or the right), row 2 two."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, V, (B, T), generator=g)
    attention = torch.ones(B, T, dtype=torch.long)
    response = torch.zeros(B, T, dtype=torch.bool)
    for row, pad in enumerate([0, 3, 2]):
        first, end = (pad, T) if left_padding else (0, T - pad)  # the real tokens
        ids[row, :first] = ids[row, end:] = 0  # pad_token_id
        attention[row, :first] = attention[row, end:] = 0
        response[row, first + PROMPT : end] = True
    return ids, attention, response


def plain_logits(model, ids, attention, position_ids):
    """The unfused path: the model's own forward, shifted: (B, T - 1, V)."""
    return model(input_ids=ids, attention_mask=attention, position_ids=position_ids).logits[:, :-1]


def check_against_plain(
    policy, ref, ids, attention, counted, tokens, temperature, dtype=torch.float32, **kwargs
):
    """causal_lm_kl(...) against the plain path: values vs float64 on the plain logits, and the
    gradients of a loss of all four outputs w.r.t. the policy's LM head and a body weight."""
    out = causal_lm_kl(policy, ref, ids, attention, temperature=temperature, entropy=True, **kwargs)
    for t in out:
        assert t.shape == (B, T - 1) and t.dtype == dtype
    position_ids = generate_position_ids(attention)
    zp = plain_logits(policy, ids, attention, position_ids)
    with torch.no_grad():
        zr = plain_logits(ref, ids, attention, position_ids)
    expected = {
        "kl": full_kl_reference(zp.detach(), zr, temperature),
        "logprobs": token_logprobs_reference(zp.detach(), tokens.clamp_min(0), temperature),
        "ref_logprobs": token_logprobs_reference(zr, tokens.clamp_min(0), temperature),
        "entropy": entropy_reference(zp.detach(), temperature),
    }
    for name, want in expected.items():
        got = getattr(out, name)
        torch.testing.assert_close(got[counted].double(), want[counted], **tol(dtype))
        assert torch.all(got[~counted] == 0), name
    assert out.kl[counted].min() > 0.05  # the two models differ

    # the same loss on the plain path's logits
    g = torch.Generator().manual_seed(3)
    w = [torch.randn(B, T - 1, generator=g) for _ in range(3)]
    loss = (out.kl * w[0] + out.logprobs * w[1] + out.entropy * w[2]).sum()
    masked_tokens = torch.where(counted, tokens, -100)
    opts = dict(temperature=temperature)
    plain = (
        full_kl(zp, zr, mask=counted, **opts) * w[0]
        + token_logprobs(zp, masked_tokens, **opts) * w[1]
        + entropy(zp, mask=counted, **opts) * w[2]
    ).sum()
    head = policy.get_output_embeddings().weight
    body_weight = next(p for n, p in policy.named_parameters() if ".0." in n and p.dim() == 2)
    got = torch.autograd.grad(loss, (head, body_weight))
    want = torch.autograd.grad(plain, (head, body_weight))
    # Both paths run the same body ops on the same weights: the gradients differ only by the
    # float32 rounding of the head and the engine, of the size the logit-gradient entry bounds.
    for a, b in zip(got, want):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, **grad_tol(dtype))
    return out


def test_importing_needs_no_transformers(monkeypatch):
    import klpenalty

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now fails
    for name in [m for m in sys.modules if m == "klpenalty.hf" or m.startswith("klpenalty.hf.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(klpenalty, "hf", hf)  # restored after the re-import rebinds it
    with pytest.raises(ImportError):
        import transformers  # noqa: F401
    fresh = importlib.import_module("klpenalty.hf")
    assert fresh is not hf and fresh.SUPPORTED_ARCHITECTURES == SUPPORTED_ARCHITECTURES
    assert "hf" not in klpenalty.__all__


def test_supported_list_is_the_tested_list():
    assert set(SUPPORTED_ARCHITECTURES) == set(ARCHS)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_matches_plain_path_left_padding_and_labels(arch):
    policy, ref = model_pair(arch)
    head = policy.get_output_embeddings()
    if arch == "gpt2":
        assert head.weight is policy.transformer.wte.weight  # tied
    assert (head.bias is not None) == (arch == "phi")
    ids, attention, response = batch(left_padding=True)
    # HF labels: -100 on prompt and padding; other tokens than input_ids, to show that the
    # labels are what is scored
    labels = torch.where(response, (ids + 5) % V, -100)
    counted = response[:, 1:].clone()
    temperature = 0.7 if arch in ("llama", "gemma2", "gpt2") else 1.0
    check_against_plain(
        policy, ref, ids, attention, counted, labels[:, 1:], temperature, labels=labels
    )


def test_response_mask_right_padding():
    policy, ref = model_pair("qwen2")
    ids, attention, response = batch(left_padding=False)
    counted = response[:, 1:]
    check_against_plain(
        policy, ref, ids, attention.bool(), counted, ids[:, 1:], 1.0, response_mask=response
    )


def test_labels_and_response_mask_combine(monkeypatch):
    policy, ref = model_pair("llama")
    ids, attention, response = batch(left_padding=True)
    labels = ids.masked_fill(attention == 0, -100)  # scores the prompt too
    counted = response[:, 1:] & (labels[:, 1:] != -100)
    check_against_plain(
        policy, ref, ids, attention, counted, ids[:, 1:], 1.0, labels=labels, response_mask=response
    )
    # labels alone count every real token whose predicting position is real too: not the
    # first real token of a left-padded row, predicted from padding (whose hidden state this
    # model happens to zero, so only the mask shows it)
    seen = spy_linear_kl(monkeypatch)
    out = causal_lm_kl(policy, ref, ids, attention, labels=labels)
    real = attention.bool()
    assert torch.equal(seen["mask"], real[:, 1:] & real[:, :-1])
    assert torch.equal(scored_positions(ids, attention, labels=labels), seen["mask"])
    assert torch.equal(out.kl != 0, seen["mask"])


def test_float64_models_give_float64():
    policy, ref = (m.double() for m in model_pair("llama"))
    ids, attention, response = batch(left_padding=True)
    check_against_plain(
        policy, ref, ids, attention, response[:, 1:], ids[:, 1:], 0.8, torch.float64,
        response_mask=response,
    )


def test_different_architectures_and_hidden_sizes():
    policy = make_model("qwen2", 1, hidden_size=48, intermediate_size=96)
    ref = make_model("llama", 2).requires_grad_(False)
    ids, attention, response = batch(left_padding=True)
    check_against_plain(
        policy, ref, ids, attention, response[:, 1:], ids[:, 1:], 1.0, response_mask=response
    )


def test_reference_that_requires_grad_gets_gradients():
    policy, ref = make_model("llama", 1), make_model("llama", 2)  # ref not frozen
    ids, attention, response = batch(left_padding=False)
    counted = response[:, 1:]
    out = causal_lm_kl(policy, ref, ids, attention, response_mask=response)
    position_ids = generate_position_ids(attention)
    plain = full_kl(
        plain_logits(policy, ids, attention, position_ids),
        plain_logits(ref, ids, attention, position_ids),
        mask=counted,
    )
    weight = ref.lm_head.weight
    got = torch.autograd.grad((out.kl + out.ref_logprobs).sum(), weight)[0]
    masked_tokens = torch.where(counted, ids[:, 1:], -100)
    ref_lp = token_logprobs(plain_logits(ref, ids, attention, position_ids), masked_tokens)
    want = torch.autograd.grad((plain + ref_lp).sum(), weight)[0]
    assert want.abs().max() > 0
    torch.testing.assert_close(got, want, **grad_tol(torch.float32))


def test_frozen_reference_runs_without_autograd():
    policy, ref = model_pair("llama")
    modes = []
    ref.model.register_forward_hook(lambda *_: modes.append(torch.is_grad_enabled()))
    ids, attention, _ = batch(left_padding=False)
    causal_lm_kl(policy, ref, ids, attention)
    assert modes == [False]


def spy_linear_kl(monkeypatch) -> dict:
    """Record the arguments causal_lm_kl hands to linear_kl (which still runs)."""
    seen = {}
    real_linear_kl = hf.kl.linear_kl

    def spy(policy_hidden, policy_weight, ref_hidden, ref_weight, **kwargs):
        seen.update(kwargs, policy_hidden=policy_hidden, ref_hidden=ref_hidden)
        return real_linear_kl(policy_hidden, policy_weight, ref_hidden, ref_weight, **kwargs)

    monkeypatch.setattr(hf.kl, "linear_kl", spy)
    return seen


def test_lm_heads_never_called_and_only_shifted_positions_reach_linear_kl(monkeypatch):
    policy, ref = model_pair("gpt2")

    def boom(*args, **kwargs):
        raise AssertionError("an LM head module was called on the whole sequence")

    for model in (policy, ref):
        monkeypatch.setattr(model.get_output_embeddings(), "forward", boom)
    seen = spy_linear_kl(monkeypatch)
    ids, attention, response = batch(left_padding=True)
    out = causal_lm_kl(policy, ref, ids, attention, response_mask=response)
    assert seen["policy_hidden"].shape == seen["ref_hidden"].shape == (B, T - 1, 32)
    assert torch.equal(seen["mask"], response[:, 1:])
    assert torch.equal(scored_positions(ids, attention, response_mask=response), seen["mask"])
    assert torch.equal(seen["tokens"], ids[:, 1:])
    assert out.kl.shape == (B, T - 1)
    with pytest.raises(AssertionError, match="LM head module was called"):
        policy(input_ids=ids)  # the patch is live: the plain path would have raised


def test_position_ids_default_is_generates():
    attention = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    want = torch.tensor([[1, 1, 0, 1, 2], [0, 1, 2, 1, 1], [0, 1, 2, 3, 4]])
    assert torch.equal(generate_position_ids(attention), want)
    assert torch.equal(generate_position_ids(attention.bool()), want)
    # left padding: the default equals passing generate's ids, and differs from 0, 1, 2, ...
    # (GPT-2's learned absolute positions; rotary ones see only differences of positions)
    policy, ref = model_pair("gpt2")
    ids, attention, response = batch(left_padding=True)
    default = causal_lm_kl(policy, ref, ids, attention, response_mask=response)
    explicit = causal_lm_kl(
        policy, ref, ids, attention, response_mask=response,
        position_ids=generate_position_ids(attention),
    )
    arange = causal_lm_kl(
        policy, ref, ids, attention, response_mask=response,
        position_ids=torch.arange(T).expand(B, T),
    )
    torch.testing.assert_close(default.kl, explicit.kl, rtol=0, atol=0)
    assert not torch.allclose(default.kl[1:], arange.kl[1:])  # rows 1, 2 are left-padded


def test_ppo_step_from_the_docs():
    """The PPO step of docs/hf.md runs: finite loss, gradients to the policy only."""
    from klpenalty import next_token_kl, shaped_rewards

    policy_model, ref_model = make_model("llama", 1), make_model("llama", 2)
    input_ids, attention_mask, response_mask = batch(left_padding=True)
    scores, beta, temperature = torch.randn(B), 0.1, 0.9
    # -- as in the docs --
    ref_model.requires_grad_(False)
    mask = scored_positions(input_ids, attention_mask, response_mask=response_mask)
    with torch.no_grad():
        old = causal_lm_kl(policy_model, ref_model, input_ids, attention_mask,
                           response_mask=response_mask, temperature=temperature)
    rewards = shaped_rewards(scores, next_token_kl(old.kl, mask), mask, beta)
    returns = rewards.flip(-1).cumsum(-1).flip(-1)
    out = causal_lm_kl(policy_model, ref_model, input_ids, attention_mask,
                       response_mask=response_mask, temperature=temperature)
    ratio = torch.exp(out.logprobs - old.logprobs)
    pg = -torch.min(ratio * returns, ratio.clamp(0.8, 1.2) * returns)
    loss = ((pg + beta * out.kl) * mask).sum() / mask.sum()
    loss.backward()
    # --
    assert torch.isfinite(loss) and old.kl.grad_fn is None
    torch.testing.assert_close(out.kl, old.kl, rtol=0, atol=0)  # same weights, same KL
    assert policy_model.lm_head.weight.grad.abs().max() > 0
    assert all(p.grad is None for p in ref_model.parameters())


def test_entropy_only_on_request():
    policy, ref = model_pair("llama")
    ids, attention, _ = batch(left_padding=False)
    out = causal_lm_kl(policy, ref, ids, attention)
    assert out.entropy is None and out.logprobs is not None and out.ref_logprobs is not None


def test_unsupported_architecture_raises():
    config = transformers.GPTNeoXConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4,
    )
    other = transformers.GPTNeoXForCausalLM(config).eval()
    policy, _ = model_pair("llama")
    ids = torch.randint(V, (B, T))
    with pytest.raises(ValueError, match=r"ref_model \(GPTNeoXForCausalLM\) has config.model_type=.gpt_neox.*.llama."):
        causal_lm_kl(policy, other, ids)
    with pytest.raises(ValueError, match=r"policy_model \(GPTNeoXForCausalLM\) has config.model_type='gpt_neox'"):
        causal_lm_kl(other, policy, ids)


def test_model_without_head_or_not_a_model_raises():
    policy, ref = model_pair("llama")
    ids = torch.randint(V, (B, T))
    with pytest.raises(ValueError, match=r"policy_model \(LlamaModel.*LM head"):
        causal_lm_kl(policy.model, ref, ids)
    with pytest.raises(TypeError, match="ref_model must be a Hugging Face causal LM"):
        causal_lm_kl(policy, "gpt2", ids)
    with pytest.raises(TypeError, match=r"ref_model \(Linear\) has no config.model_type"):
        causal_lm_kl(policy, torch.nn.Linear(2, 2), ids)


def test_head_that_is_not_a_plain_linear_or_elsewhere_raises():
    class Adapted(torch.nn.Linear):  # e.g. a LoRA layer: its forward adds to weight @ h
        def forward(self, h):
            return super().forward(h) + 1.0

    policy, ref = model_pair("llama")
    ids = torch.randint(V, (B, T))
    adapted = Adapted(32, V, bias=False)
    adapted.weight = ref.lm_head.weight
    ref.lm_head = adapted
    with pytest.raises(ValueError, match=r"ref_model \(LlamaForCausalLM\)'s LM head .* is Adapted, not an nn.Linear"):
        causal_lm_kl(policy, ref, ids)
    policy.lm_head.to("meta")
    with pytest.raises(ValueError, match=r"policy_model's LM head is on meta and the hidden states it receives on cpu"):
        causal_lm_kl(policy, model_pair("llama")[1], ids)


def test_vocabulary_mismatch_raises():
    policy = make_model("llama", 1)
    ref = make_model("qwen2", 2, vocab_size=V + 1)
    with pytest.raises(ValueError, match=r"same vocabulary size.*out_features=96.*out_features=97"):
        causal_lm_kl(policy, ref, torch.randint(V, (B, T)))


def test_capped_policy_with_uncapped_reference_raises():
    policy, ref = make_model("gemma2", 1), make_model("gemma", 2)
    with pytest.raises(ValueError, match=r"policy_model \(gemma2\) soft-caps"):
        causal_lm_kl(policy, ref, torch.randint(V, (B, T)))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(input_ids=torch.rand(B, T)), TypeError, r"input_ids must be an integer.*float32"),
        (dict(input_ids=torch.zeros(T, dtype=torch.long)), ValueError,
         r"input_ids must have shape \(B, T\)"),
        (dict(input_ids=[[1, 2]]), TypeError, "input_ids must be a torch.Tensor"),
        (dict(attention_mask=torch.ones(B, T + 1, dtype=torch.long)), ValueError,
         r"attention_mask must have shape \(3, 10\).*\(3, 11\)"),
        (dict(attention_mask=torch.ones(B, T)), TypeError,
         r"attention_mask must be an integer.*float32"),
        (dict(labels=torch.zeros(B, T - 1, dtype=torch.long)), ValueError,
         r"labels must have shape \(3, 10\)"),
        (dict(labels=torch.zeros(B, T)), TypeError, "labels must be an integer"),
        (dict(response_mask=torch.ones(B, T, dtype=torch.long)), TypeError,
         r"response_mask must be a bool.*int64"),
        (dict(response_mask=torch.ones(B, 1, dtype=torch.bool)), ValueError,
         r"response_mask must have shape \(3, 10\).*\(3, 1\)"),
        (dict(position_ids=torch.arange(T)[None]), ValueError,
         r"position_ids must have shape \(3, 10\).*\(1, 10\)"),
        (dict(temperature=0.0), ValueError, "temperature must be finite and > 0"),
        (dict(entropy="yes"), TypeError, "entropy must be a bool"),
        (dict(backend="fast"), ValueError, "backend must be one of"),
        (dict(labels=torch.full((B, T), V + 3)), ValueError,
         rf"labels must lie in \[0, {V}\).*27 do not, the first {V + 3} at index \(0, 1\)"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(kwargs, error, match):
    policy, ref = model_pair("llama")
    args = dict(input_ids=torch.randint(V, (B, T)), attention_mask=None)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        causal_lm_kl(policy, ref, args.pop("input_ids"), args.pop("attention_mask"), **args)


def test_labels_are_read_only_where_scored():
    policy, ref = model_pair("llama")
    ids, attention, response = batch(left_padding=False)
    labels = torch.where(response, ids, V + 3)  # out of range, but never scored
    got = causal_lm_kl(policy, ref, ids, attention, labels=labels, response_mask=response)
    want = causal_lm_kl(policy, ref, ids, attention, response_mask=response)
    for a, b in zip(got, want):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0)


# --------------------------------------------------------------------------- packed rows
def test_packed_rows_equal_each_sequence_run_alone():
    """One packed row (position_ids restarting, no attention mask) against each sequence run
    alone: the same values where scored, the boundary positions not scored, the same
    gradients as the sum over the sequences."""
    policy, ref = model_pair("llama")
    lengths = [4, 3, 5]
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(3, V, (1, sum(lengths)), generator=g)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    out = causal_lm_kl(policy, ref, ids, position_ids=position_ids, entropy=True)
    counted = scored_positions(ids, position_ids=position_ids)
    ends = torch.tensor(lengths).cumsum(0)[:-1] - 1  # the last position of each sequence
    assert not counted[0, ends].any() and int(counted.sum()) == sum(lengths) - len(lengths)
    for field in out:
        assert torch.all(field[~counted] == 0)
    w = torch.rand(1, sum(lengths) - 1, generator=g)
    loss = ((out.kl + out.logprobs + out.entropy) * w).sum()
    got = torch.autograd.grad(loss, list(policy.parameters()))
    start, alone = 0, 0.0
    for n in lengths:
        seq = ids[:, start : start + n]
        one = causal_lm_kl(policy, ref, seq, entropy=True)
        for field, part in zip(out, one):
            torch.testing.assert_close(field[:, start : start + n - 1], part, **tol(torch.float32))
        zp = policy(input_ids=seq).logits[:, :-1]
        with torch.no_grad():
            zr = ref(input_ids=seq).logits[:, :-1]
        torch.testing.assert_close(
            one.kl.double(), full_kl_reference(zp.detach(), zr), **tol(torch.float32)
        )
        ws = w[:, start : start + n - 1]
        alone = alone + ((full_kl(zp, zr) + token_logprobs(zp, seq[:, 1:]) + entropy(zp)) * ws).sum()
        start += n
    want = torch.autograd.grad(alone, list(policy.parameters()))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **grad_tol(torch.float32))


def test_packed_position_ids_with_an_attention_mask_raise():
    policy, ref = model_pair("llama")
    ids = torch.randint(3, V, (1, 7))
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    with pytest.raises(ValueError, match=r"position_ids restart between two real tokens.*"
                                         r"index \(0, 3\).*from 2 to 0"):
        causal_lm_kl(policy, ref, ids, torch.ones(1, 7, dtype=torch.long),
                     position_ids=position_ids)
    # padding next to a restart is fine: the pad and its neighbour are not both real
    attention = torch.tensor([[1, 1, 1, 0, 0, 0, 0]])
    out = causal_lm_kl(policy, ref, ids, attention, position_ids=position_ids)
    assert torch.all(out.kl[0, 2:] == 0) and torch.all(out.kl[0, :2] > 0)


# --------------------------------------------------------------------------- sampler support
def test_top_k_top_p_match_the_logits_functions():
    """causal_lm_kl with the sampler's settings equals token_stats with them on the model's
    own logits (tokens: the policy's argmax, inside every support)."""
    from klpenalty import token_stats

    policy, ref = model_pair("gemma2")  # a soft-capped head: the thresholds see capped logits
    ids, attention, response = batch(left_padding=True)
    position_ids = generate_position_ids(attention)
    with torch.no_grad():  # the responses decoded greedily, one token at a time
        for t in range(1, T):
            greedy = plain_logits(policy, ids, attention, position_ids)[:, t - 1].argmax(-1)
            ids[:, t] = torch.where(response[:, t], greedy, ids[:, t])
    for sampler in (dict(top_k=5), dict(top_p=0.8, min_p=0.05)):
        out = causal_lm_kl(policy, ref, ids, attention, response_mask=response, entropy=True,
                           temperature=0.9, **sampler)
        zp = plain_logits(policy, ids, attention, position_ids)
        with torch.no_grad():
            zr = plain_logits(ref, ids, attention, position_ids)
        want = token_stats(zp.double(), zr.double(), ids[:, 1:], mask=response[:, 1:],
                           entropy=True, temperature=0.9, **sampler)
        for got, w in zip(out, want):
            torch.testing.assert_close(got.double(), w, **tol(torch.float32))
        full = causal_lm_kl(policy, ref, ids, attention, response_mask=response, temperature=0.9)
        assert not torch.allclose(full.logprobs, out.logprobs)  # the support cuts
        with pytest.raises(ValueError, match="outside the support"):
            causal_lm_kl(policy, ref, ids, attention, top_k=1)  # prompt tokens are random


# --------------------------------------------------------------------------- wrappers
def test_reference_none_needs_a_peft_policy():
    policy, _ = model_pair("llama")
    with pytest.raises(ValueError, match=r"ref_model=None .* PeftModel policy; policy_model is "
                                         r"LlamaForCausalLM"):
        causal_lm_kl(policy, None, torch.randint(V, (B, T)))


def test_unhandled_wrappers_are_named():
    policy, ref = model_pair("llama")
    ids = torch.randint(V, (B, T))

    class Holder(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    with pytest.raises(TypeError, match=r"policy_model \(Holder\) is a wrapper klpenalty.hf "
                                        r"does not know .*LlamaForCausalLM"):
        causal_lm_kl(Holder(policy), ref, ids)
    with pytest.raises(ValueError, match=r"ref_model is a torch.nn.DataParallel"):
        causal_lm_kl(policy, torch.nn.DataParallel(ref), ids)


def test_head_forward_is_restored_even_after_an_error():
    policy, ref = model_pair("cohere")  # the model's own logit scale is switched off, then back
    ids = torch.randint(3, V, (B, T))
    want = policy(input_ids=ids).logits
    with pytest.raises(ValueError, match="outside the support"):
        causal_lm_kl(policy, ref, ids, top_k=1)
    for model in (policy, ref):
        assert "forward" not in model.lm_head.__dict__
        assert model.logit_scale == 0.5
    torch.testing.assert_close(policy(input_ids=ids).logits, want, rtol=0, atol=0)


def test_head_receiving_other_than_hidden_states_raises():
    policy, ref = model_pair("llama")
    ids = torch.randint(3, V, (B, T))
    inner = policy.forward

    def last_position_only(**kw):  # as generate's logits_to_keep=1 would
        return inner(**kw, logits_to_keep=1)

    policy.forward = last_position_only
    with pytest.raises(ValueError, match=r"policy_model's LM head received shape=\(3, 1, 32\)"):
        causal_lm_kl(policy, ref, ids)


# ------------------------------------------------------------------------- reference_states
@pytest.mark.parametrize("arch", ["llama", "gemma2", "phi", "granite"])
def test_reference_states_reused_equal_the_model(arch):
    """causal_lm_kl with the reference's states captured once equals causal_lm_kl with the
    model (values and the policy's gradients), and the states' log-probs are log ρ(token)."""
    policy, ref = model_pair(arch)
    ids, attention, response = batch(left_padding=True)
    counted = scored_positions(ids, attention, response_mask=response)
    opts = dict(response_mask=response, temperature=0.8, entropy=True)
    states = hf.reference_states(ref, ids, attention, response_mask=response, temperature=0.8)
    assert states.hidden.shape == (B, T, 32) and not states.hidden.requires_grad
    # a plain model's head is used in place, not copied
    assert states.weight.data_ptr() == ref.get_output_embeddings().weight.data_ptr()
    position_ids = generate_position_ids(attention)
    with torch.no_grad():
        zr = plain_logits(ref, ids, attention, position_ids)
    want = token_logprobs_reference(zr, ids[:, 1:], 0.8)
    torch.testing.assert_close(states.logprobs[counted].double(), want[counted], **tol(torch.float32))
    assert torch.all(states.logprobs[~counted] == 0)
    head = policy.get_output_embeddings().weight
    results = []
    for reference in (ref, states, states):  # the states serve any number of calls
        out = causal_lm_kl(policy, reference, ids, attention, **opts)
        (grad,) = torch.autograd.grad((out.kl + out.logprobs).sum(), head)
        results.append((out, grad))
    for out, grad in results[1:]:
        for a, b in zip(out, results[0][0]):
            assert torch.equal(a, b)
        assert torch.equal(grad, results[0][1])
    torch.testing.assert_close(results[1][0].ref_logprobs, states.logprobs, rtol=0, atol=0)


def test_reference_states_of_a_peft_model_with_adapters_disabled():
    peft = pytest.importorskip("peft")
    base = make_model("llama", 1)
    policy = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                         init_lora_weights=False))
    ids, attention, response = batch(left_padding=False)
    states = hf.reference_states(policy, ids, attention, response_mask=response,
                                 disable_adapters=True)
    got = causal_lm_kl(policy, states, ids, attention, response_mask=response)
    want = causal_lm_kl(policy, None, ids, attention, response_mask=response)
    for a, b in zip(got[:3], want[:3]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert got.kl.max() > 0.01  # the adapters move the policy away from its base


def test_reference_states_bad_arguments_raise():
    policy, ref = model_pair("llama")
    ids, attention, _ = batch(left_padding=False)
    with pytest.raises(ValueError, match="disable_adapters=True needs a PeftModel"):
        hf.reference_states(ref, ids, attention, disable_adapters=True)
    states = hf.reference_states(ref, ids, attention)
    with pytest.raises(ValueError, match=r"ReferenceStates must hold hidden \(B, T, H_r\) = "
                                         r"\(2, 10, H_r\)"):
        causal_lm_kl(policy, states, ids[:2], attention[:2])
    with pytest.raises(TypeError, match="disable_adapters must be a bool"):
        hf.reference_states(ref, ids, attention, disable_adapters=1)


# ------------------------------------------------------------------------ causal_lm_logprobs
def greedy_response(model, ids, attention, response):
    """``ids`` with each response token replaced, left to right, by the model's most likely
    next token (so it lies on any sampler's support)."""
    ids = ids.clone()
    with torch.no_grad():
        for t in range(1, ids.shape[1]):
            z = plain_logits(model, ids, attention, generate_position_ids(attention))
            ids[:, t] = torch.where(response[:, t], z[:, t - 1].argmax(-1), ids[:, t])
    return ids


@pytest.mark.parametrize("sampler", [{}, {"top_p": 0.8}, {"top_k": 5, "min_p": 0.05}])
def test_causal_lm_logprobs_are_causal_lm_kls_without_gradients(sampler):
    """The no-grad pass gives the log-probs and entropies of causal_lm_kl (of π̃ on the
    sampler's support), and builds no graph."""
    policy, ref = model_pair("llama")
    ids, attention, response = batch(left_padding=True)
    counted = scored_positions(ids, attention, response_mask=response)
    opts = dict(response_mask=response, temperature=0.7, entropy=True, **sampler)
    ids = greedy_response(policy, ids, attention, response)  # the tokens lie on the support
    got = hf.causal_lm_logprobs(policy, ids, attention, **opts)
    want = causal_lm_kl(policy, ref, ids, attention, **opts)
    assert got.kl is None and got.ref_logprobs is None and not got.logprobs.requires_grad
    for a, b in ((got.logprobs, want.logprobs), (got.entropy, want.entropy)):
        torch.testing.assert_close(a[counted], b[counted].detach(), **tol(torch.float32))
        assert torch.all(a[~counted] == 0)
    if sampler:  # truncated: π̃(token) > π(token)
        full = hf.causal_lm_logprobs(policy, ids, attention, response_mask=response,
                                     temperature=0.7)
        assert bool((got.logprobs[counted] > full.logprobs[counted]).any())


def test_causal_lm_logprobs_take_the_kept_sets_as_ids_and_offsets():
    """A support given as (ids, offsets) over the B·(T − 1) positions (empty where not
    scored) gives the values of the sampler rule that made it."""
    policy, _ = model_pair("llama")
    ids, attention, response = batch(left_padding=False)
    counted = scored_positions(ids, attention, response_mask=response)
    ids = greedy_response(policy, ids, attention, response)
    with torch.no_grad():
        z = plain_logits(policy, ids, attention, generate_position_ids(attention))
        keep = z.argsort(-1, descending=True).argsort(-1) < 6  # the 6 most likely
    keep &= counted.unsqueeze(-1)
    rows = keep.reshape(-1, keep.shape[-1])
    kept = rows.nonzero()[:, 1]
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), rows.sum(-1).cumsum(0)])
    got = hf.causal_lm_logprobs(policy, ids, attention, response_mask=response,
                                support=(kept, offsets))
    want = hf.causal_lm_logprobs(policy, ids, attention, response_mask=response, top_k=6)
    # the same kept sets (ids walked as their mask, top-k's few kept logits sparsely: the sums
    # in another order)
    torch.testing.assert_close(got.logprobs, want.logprobs, **tol(torch.float32))
    with pytest.raises(ValueError, match="support offsets"):
        hf.causal_lm_logprobs(policy, ids, attention, support=(kept, offsets[:-1]))
