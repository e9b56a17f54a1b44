"""One rank of the wrapped-model matrix of ``tests/integrations/test_wrapped.py``.

Run from the repository root as ``python -m tests.integrations.wrapped_worker RANK WORLD
STORE_FILE OUT_DIR GROUP``: the rank joins a gloo group through a FileStore (no ports), runs
every check of GROUP (``torch``: DDP, FSDP2, FSDP1, PEFT; ``deepspeed``: ZeRO-3) in order and writes
``OUT_DIR/rank{RANK}.json``: ``{"results": {check: {"ok": bool, "error": traceback,
"seconds": float}}}``.

Each check builds tiny random Llamas from a config (the same seed on every rank), gives each
rank its own batch, and compares :func:`klpenalty.hf.causal_lm_kl` on the models as a user
holds them (wrapped, sharded) with the same models unwrapped in this process:

- values: against a float64 KL of the model's own logits (``model(...).logits`` upcast; for
  packed rows, each sequence run alone);
- gradients: every parameter's, gathered in full after the backward (FSDP ``full_tensor`` /
  ``summon_full_params``, DeepSpeed ``safe_get_full_grad``), against the mean over the ranks of
  the single-process gradients of the same loss on the logits; a parameter that gets a gradient
  there and None here fails.

The process group times out collectives after :data:`PG_TIMEOUT_S`, so a hang becomes an error.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from klpenalty import divergence, token_stats
from klpenalty.hf import causal_lm_divergence, causal_lm_kl, scored_positions

from ..tolerances import grad_tol, tol

PG_TIMEOUT_S = 60
V, H = 96, 32
# the policy's loss: Σ w_kl·KL + w_lp·log π(token) + w_h·H(π) with per-rank random weights

# Tolerances (tests/tolerances.py, float32 models): values are float32 fused against float64 on
# the same logits, the TOLERANCES entry. Gradients of the parameters are float32 on both sides,
# the fused path and the logits path differing by the float32 rounding of the head and the
# engine (and of the ranks' mean): the GRAD_TOLERANCES entry.
VALUE_TOL = tol(torch.float32)
GRAD_TOL = grad_tol(torch.float32)


def tiny_llama(seed: int, *, tied: bool = False, hidden: int = H):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3,
        tie_word_embeddings=tied, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


class Batch:
    """This rank's batch: (B, T) ids, an attention mask with a left-padded row (or packed rows:
    position ids restarting, no mask), and the loss weights (B, T - 1, 3)."""

    def __init__(self, rank: int, packed: bool = False) -> None:
        g = torch.Generator().manual_seed(100 + rank)
        if packed:
            lengths = [5, 4, 3] if rank == 0 else [3, 6, 3]
            self.segments = [(0, sum(lengths[:i]), sum(lengths[: i + 1])) for i in range(3)]
            self.ids = torch.randint(3, V, (1, sum(lengths)), generator=g)
            self.attention = None
            self.position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
        else:
            self.ids = torch.randint(3, V, (2, 8), generator=g)
            self.attention = torch.ones(2, 8, dtype=torch.long)
            self.ids[1, :2] = 0
            self.attention[1, :2] = 0
            self.position_ids = None
            self.segments = [(0, 0, 8), (1, 0, 8)]
        B, T = self.ids.shape
        self.weights = torch.rand(B, T - 1, 3, generator=g)
        self.counted = scored_positions(self.ids, self.attention, position_ids=self.position_ids)

    def kwargs(self) -> dict:
        return dict(attention_mask=self.attention, position_ids=self.position_ids)

    @torch.no_grad()
    def greedy(self, model) -> "Batch":
        """Each sequence's tokens after its first real one replaced by ``model``'s argmax:
        tokens inside every top-k/top-p support (the largest logit is always kept)."""
        for row, s, e in self.segments:
            first = s if self.attention is None else s + int((self.attention[row, s:e] == 0).sum())
            for t in range(first + 1, e):
                z = model(input_ids=self.ids[row : row + 1, first:t], use_cache=False).logits
                self.ids[row, t] = z[0, -1].argmax()
        return self


def own_logits(model, b: Batch) -> torch.Tensor:
    """(B, T - 1, V) of ``model``'s own forward, each sequence run alone."""
    B, T = b.ids.shape
    out = None
    for row, s, e in b.segments:
        kw = {}
        if b.attention is not None:
            kw["attention_mask"] = b.attention[row : row + 1, s:e]
            from klpenalty.hf import generate_position_ids

            kw["position_ids"] = generate_position_ids(kw["attention_mask"])
        z = model(input_ids=b.ids[row : row + 1, s:e], use_cache=False, **kw).logits[0]
        if out is None:
            out = z.new_zeros(B, T, z.shape[-1])
        out = out.index_put((torch.tensor([row]), torch.arange(s, e)), z)
    return out[:, :-1]


def loss_of(kl, lp, ent, b: Batch) -> torch.Tensor:
    w = b.weights
    return (w[..., 0] * kl + w[..., 1] * lp + w[..., 2] * ent).sum()


def expected(policy, ref, b: Batch, sampler: dict, disabled_ref=None):
    """(float64 values (kl, lp, rlp, ent), {name: mean gradient over the ranks}) of the plain
    models; ``disabled_ref``: a PeftModel whose adapters are disabled for the reference."""
    tokens = b.ids[:, 1:]
    with torch.no_grad():
        if disabled_ref is not None:
            with disabled_ref.disable_adapter():
                zr = own_logits(disabled_ref, b)
        else:
            zr = own_logits(ref, b)
    zp = own_logits(policy, b)
    with torch.no_grad():
        values = token_stats(zp.double(), zr.double(), tokens, mask=b.counted, entropy=True,
                             **sampler)
    s = token_stats(zp, zr, tokens, mask=b.counted, entropy=True, **sampler)
    return values, mean_grads(policy, loss_of(s.kl, s.logprobs, s.entropy, b))


def mean_grads(model, loss) -> dict:
    """{name: the mean over the ranks of ∂loss/∂parameter} (parameters without one left out)."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    mean = {}
    for n, g in zip(params, grads):
        if g is not None:
            g = g.detach().clone()
            dist.all_reduce(g)
            mean[n] = g / dist.get_world_size()
    return mean


def clean(name: str) -> str:
    for prefix in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "module."):
        name = name.replace(prefix, "")
    return name


def assert_close(got, want, what: str, *, atol: float, rtol: float) -> None:
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    diff = (got - want).abs()
    bad = diff > atol + rtol * want.abs()
    if bool(bad.any()):
        raise AssertionError(
            f"{what}: {int(bad.sum())} / {got.numel()} not close (atol {atol}, rtol {rtol}); "
            f"max |diff| {diff.max().item():.3g}, max |want| {want.abs().max().item():.3g}"
        )


def compare(out, values, got_grads: dict, want_grads: dict) -> None:
    for name, a, e in zip(("kl", "logprobs", "ref_logprobs", "entropy"), out, values):
        assert_close(a, e, name, **VALUE_TOL)
    compare_grads(got_grads, want_grads)


def compare_grads(got_grads: dict, want_grads: dict) -> None:
    """Every parameter's gradient (names without the wrappers' prefixes); None where one is
    due fails."""
    want = {clean(n): g for n, g in want_grads.items()}
    got = {clean(n): g for n, g in got_grads.items()}
    missing = [n for n in want if got.get(n) is None]
    assert not missing, f"parameters with grad None where one is due: {missing}"
    for n, g in want.items():
        assert_close(got[n], g, f"grad of {n}", **GRAD_TOL)


def run(policy_w, ref_w, b: Batch, sampler: dict, backward=None):
    out = causal_lm_kl(policy_w, ref_w, b.ids, entropy=True, **b.kwargs(), **sampler)
    loss = loss_of(out.kl, out.logprobs, out.entropy, b)
    (backward or torch.Tensor.backward)(loss)
    return out


# ---------------------------------------------------------------------- the wrappers' checks
def check_wrapped(rank, wrap, full_grads, *, sharded_ref=False, tied=False, packed=False,
                  sampler=None):
    """The plain models against ``wrap(copy of the policy)`` (and of the reference, with
    ``sharded_ref``): values and ``full_grads(wrapped)``, every parameter's full gradient."""
    sampler = sampler or {}
    policy, ref = tiny_llama(1, tied=tied), tiny_llama(2, tied=tied).requires_grad_(False)
    b = Batch(rank, packed).greedy(policy) if sampler else Batch(rank, packed)
    values, want = expected(policy, ref, b, sampler)
    wrapped = wrap(copy.deepcopy(policy))
    ref_w = wrap(copy.deepcopy(ref)) if sharded_ref else ref
    out = run(wrapped, ref_w, b, sampler)
    compare(out, values, full_grads(wrapped), want)


def _plain_grads(model) -> dict:
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _ddp(model):
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model)


def check_ddp(rank, **kw):
    check_wrapped(rank, _ddp, lambda w: _plain_grads(w.module), **kw)


def check_ddp_module_forward_is_one_call(rank):
    """The head's forward is restored after the call: the wrapped model's own forward gives
    its logits again, those of the plain model (DDP does not change the weights)."""
    policy, ref = tiny_llama(1), tiny_llama(2).requires_grad_(False)
    b = Batch(rank)
    wrapped = _ddp(copy.deepcopy(policy))
    run(wrapped, ref, b, {})
    assert "forward" not in wrapped.module.lm_head.__dict__
    with torch.no_grad():
        z = wrapped(input_ids=b.ids, attention_mask=b.attention).logits
        want = policy(input_ids=b.ids, attention_mask=b.attention).logits
    assert z.shape == (*b.ids.shape, V) and torch.equal(z, want)


def _fsdp2(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _dtensor_grads(model) -> dict:
    return {
        n: None if p.grad is None else p.grad.full_tensor()
        for n, p in model.named_parameters() if p.requires_grad
    }


def check_fsdp2(rank, **kw):
    check_wrapped(rank, _fsdp2, _dtensor_grads, **kw)


def _fsdp1(model, use_orig_params: bool):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
                use_orig_params=use_orig_params, device_id=torch.device("cpu"))


def _fsdp1_grads(wrapped) -> dict:
    """Every parameter's full gradient: the sharded flat gradients written into the flat
    parameters' shards, then gathered by summon_full_params (the model is not used again)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    flats = [m._handle.flat_param for m in FSDP.fsdp_modules(wrapped) if m._handle is not None]
    missing = [i for i, f in enumerate(flats) if f.requires_grad and f.grad is None]
    assert not missing, f"FSDP1 flat parameters with grad None: {missing}"
    with torch.no_grad():
        for f in flats:
            if f.grad is not None:
                f.data.copy_(f.grad.reshape(f.data.shape))
    with FSDP.summon_full_params(wrapped, writeback=False):
        return {n: p.detach().clone() for n, p in wrapped.named_parameters()}


def check_fsdp1(rank, *, use_orig_params, **kw):
    check_wrapped(rank, lambda m: _fsdp1(m, use_orig_params), _fsdp1_grads, **kw)


def _zero3(model, *, train: bool):
    import deepspeed
    import deepspeed.ops

    # DeepSpeed's CPU backend JIT-compiles an optional shared-memory collective at its first
    # initialize (a C++ build, minutes here); gloo does the collectives without it
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
    }
    if train:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    else:
        engine, *_ = deepspeed.initialize(model=model, config=config)
    return engine


def check_zero3(rank, *, inner=False, sharded_ref=False, sampler=None):
    from deepspeed.utils import safe_get_full_grad

    sampler = sampler or {}
    policy, ref = tiny_llama(1), tiny_llama(2).requires_grad_(False)
    b = Batch(rank).greedy(policy) if sampler else Batch(rank)
    values, want = expected(policy, ref, b, sampler)
    engine = _zero3(copy.deepcopy(policy), train=True)
    ref_w = _zero3(copy.deepcopy(ref), train=False) if sharded_ref else ref
    # partitioned: outside a forward every parameter is an empty placeholder
    assert all(p.numel() == 0 for p in engine.module.parameters())
    out = run(engine.module if inner else engine, ref_w, b, sampler, backward=engine.backward)
    grads = {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters()}
    compare(out, values, grads, want)


def check_zero3_lora_head_raises(rank):
    """A LoRA layer on the head under ZeRO-3: its base weight is gathered only by the base
    layer's own forward, which the fused head does not call, so it raises, naming both."""
    engine = _zero3(_lora(tiny_llama(1), head=True), train=True)
    try:
        causal_lm_kl(engine, None, Batch(rank).ids)
    except ValueError as e:
        assert "PEFT LoRA layer" in str(e) and "ZeRO-3" in str(e), str(e)
    else:
        raise AssertionError("no error for a LoRA head under ZeRO-3")


def _lora(model, *, head=False, save_head=False):
    import peft

    targets = ["q_proj", "v_proj"] + (["lm_head"] if head else [])
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0,
                             init_lora_weights=False,  # random A and B: the adapters matter
                             modules_to_save=["lm_head"] if save_head else None)
    torch.manual_seed(3)
    model = peft.get_peft_model(model, config)
    if save_head:  # the trainable copy differs from the original head
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "modules_to_save" in n:
                    p.add_(0.3 * torch.randn_like(p))
    return model


def check_peft(rank, *, head=False, save_head=False, gc=False, separate_ref=False):
    from torch.nn.parallel import DistributedDataParallel as DDP

    policy = _lora(tiny_llama(1), head=head, save_head=save_head)
    if gc:
        policy.train()
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref = tiny_llama(2).requires_grad_(False) if separate_ref else None
    b = Batch(rank)
    values, want = expected(policy, ref, b, {}, disabled_ref=None if separate_ref else policy)
    wrapped = DDP(copy.deepcopy(policy))
    out = run(wrapped, ref, b, {})
    compare(out, values, _plain_grads(wrapped.module), want)


def check_errors(rank):
    """A wrapper klpenalty.hf does not know is named in the error."""
    class Holder(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    b = Batch(rank)
    try:
        causal_lm_kl(Holder(tiny_llama(1)), tiny_llama(2), b.ids)
    except TypeError as e:
        assert "Holder" in str(e) and "does not know" in str(e), str(e)
    else:
        raise AssertionError("no error for an unknown wrapper")


# ---------------------------------------------------------------------- the divergences
def check_divergence(rank, wrap, full_grads, kind, *, packed=False, lora=False):
    """causal_lm_divergence of the wrapped student against a wider plain teacher (a
    constant): values against float64 divergence on the models' own logits, and every student
    parameter's full gradient of Σ w·divergence against the ranks' mean on the logits."""
    student = tiny_llama(1)
    if lora:
        student = _lora(student)
    teacher = tiny_llama(2, hidden=48).requires_grad_(False)
    b = Batch(rank, packed)
    kw = dict(beta=0.3, skew=0.2, temperature=0.9)
    with torch.no_grad():
        zt = own_logits(teacher, b)
    zs = own_logits(student, b)
    with torch.no_grad():
        values = divergence(zs.double(), zt.double(), kind, mask=b.counted, **kw)
    w = b.weights[..., 0]
    want = mean_grads(student, (w * divergence(zs, zt, kind, mask=b.counted, **kw)).sum())
    wrapped = wrap(copy.deepcopy(student))
    got = causal_lm_divergence(wrapped, teacher, b.ids, kind=kind, **b.kwargs(), **kw)
    backward = getattr(wrapped, "backward", None)  # a DeepSpeed engine's own
    (backward or torch.Tensor.backward)((w * got).sum())
    assert_close(got, values, kind, **VALUE_TOL)
    compare_grads(full_grads(wrapped), want)


def _zero3_grads(engine) -> dict:
    from deepspeed.utils import safe_get_full_grad

    return {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters()}


TOPK = {"top_k": 7, "top_p": 0.9}
# One process group per entry: starting the processes and importing transformers costs most of
# a group's time (each check takes about a second), so the wrappers of torch share one group;
# DeepSpeed's (its import alone takes ~10 s) runs in its own, after which nothing else runs.
GROUPS = {
    "torch": {
        "ddp": lambda r: check_ddp(r),
        "ddp_tied": lambda r: check_ddp(r, tied=True),
        "ddp_packed": lambda r: check_ddp(r, packed=True),
        "ddp_top_k_top_p": lambda r: check_ddp(r, sampler=TOPK),
        "ddp_head_restored": check_ddp_module_forward_is_one_call,
        "unknown_wrapper_error": check_errors,
        "fsdp2": lambda r: check_fsdp2(r),
        "fsdp2_sharded_ref": lambda r: check_fsdp2(r, sharded_ref=True),
        "fsdp2_tied": lambda r: check_fsdp2(r, tied=True),
        "fsdp2_packed_top_k_top_p": lambda r: check_fsdp2(r, packed=True, sampler=TOPK),
        "fsdp1_flat": lambda r: check_fsdp1(r, use_orig_params=False),
        "fsdp1_orig_params": lambda r: check_fsdp1(r, use_orig_params=True),
        "fsdp1_flat_sharded_ref": lambda r: check_fsdp1(r, use_orig_params=False, sharded_ref=True),
        "fsdp1_orig_params_sharded_ref_tied": lambda r: check_fsdp1(
            r, use_orig_params=True, sharded_ref=True, tied=True),
        "peft_lora_disabled_ref": lambda r: check_peft(r),
        "peft_lora_separate_ref": lambda r: check_peft(r, separate_ref=True),
        "peft_lora_gradient_checkpointing": lambda r: check_peft(r, gc=True),
        "peft_lora_on_head": lambda r: check_peft(r, head=True),
        "peft_modules_to_save_head": lambda r: check_peft(r, save_head=True),
        "divergence_ddp_jsd": lambda r: check_divergence(
            r, _ddp, lambda w: _plain_grads(w.module), "jsd"),
        "divergence_ddp_packed_forward_kl": lambda r: check_divergence(
            r, _ddp, lambda w: _plain_grads(w.module), "forward_kl", packed=True),
        "divergence_fsdp2_skew_reverse_kl": lambda r: check_divergence(
            r, _fsdp2, _dtensor_grads, "skew_reverse_kl"),
        "divergence_fsdp1_tvd": lambda r: check_divergence(
            r, lambda m: _fsdp1(m, True), _fsdp1_grads, "tvd"),
        "divergence_peft_reverse_kl": lambda r: check_divergence(
            r, _ddp, lambda w: _plain_grads(w.module), "reverse_kl", lora=True),
    },
    "deepspeed": {
        "zero3_engine": lambda r: check_zero3(r),
        "zero3_engine_module_sharded_ref": lambda r: check_zero3(r, inner=True, sharded_ref=True),
        "zero3_top_k_top_p": lambda r: check_zero3(r, sampler=TOPK),
        "zero3_lora_head_raises": check_zero3_lora_head_raises,
        "divergence_zero3_skew_forward_kl": lambda r: check_divergence(
            r, lambda m: _zero3(m, train=True), _zero3_grads, "skew_forward_kl"),
    },
}


def main() -> None:
    rank, world, store, out_dir, group = sys.argv[1:6]
    rank, world = int(rank), int(world)
    torch.set_num_threads(1)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=PG_TIMEOUT_S))
    results = {}
    for name, check in GROUPS[group].items():
        start = time.perf_counter()
        try:
            check(rank)
            results[name] = {"ok": True, "error": ""}
        except Exception:  # reported per check by the test
            results[name] = {"ok": False, "error": traceback.format_exc()[-3000:]}
        dist.barrier()
        results[name]["seconds"] = round(time.perf_counter() - start, 1)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"results": results}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
