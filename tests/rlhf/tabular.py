"""Tiny tabular problems whose expectations are finite sums, in float64: one state (every token
enumerated) and a tabular autoregressive policy (every sequence enumerated), so an expected
gradient is computed exactly by autograd, with no sampling (tests/rlhf/test_gradients.py has
the method and the tolerances' reasoning).
"""

from __future__ import annotations

import math

import torch

from klpenalty import token_logprobs

F64 = torch.float64
TOL_STATE = 1e-12  # one state, ≤ 4 terms: rounding ~1e-16
TOL_SEQ = 1e-10  # ≤ 40 sequences × 3 positions: rounding ~1e-14
DIFFERS = 1e-3  # a biased form misses by O(0.1) on these random logits


def assert_equal_grad(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(actual, expected, rtol=0.0, atol=tol)


def assert_differs(actual: torch.Tensor, other: torch.Tensor) -> None:
    gap = float((actual - other).abs().max())
    assert gap > DIFFERS, f"expected a biased gradient, but it matches to {gap:.2e}"


class OneState:
    """Logits x (policy, a parameter), y (reference), z (an older policy), vocabulary V."""

    def __init__(self, vocab: int = 4, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(vocab, generator=g, dtype=F64).requires_grad_(True)
        self.y = torch.randn(vocab, generator=g, dtype=F64)
        self.z = self.x.detach() + 0.7 * torch.randn(vocab, generator=g, dtype=F64)
        self.tokens = torch.arange(vocab)  # one "sample" per vocabulary entry
        self.p = torch.softmax(self.x.detach(), -1)
        self.q = torch.softmax(self.y, -1)
        self.p_old = torch.softmax(self.z, -1)

    def logprobs(self):
        """(log π(a), log ρ(a), log π_old(a)) for every token a, (V,) each, via the library."""
        v = self.tokens.numel()
        lp = token_logprobs(self.x.expand(v, v), self.tokens)
        ref = token_logprobs(self.y.expand(v, v), self.tokens)
        old = token_logprobs(self.z.expand(v, v), self.tokens)
        return lp, ref, old

    def expected_grad(self, per_token: torch.Tensor, weights: torch.Tensor | None = None):
        """E_a[∇ per_token(a)] with a ~ weights (default π), exactly."""
        w = self.p if weights is None else weights
        (g,) = torch.autograd.grad((w.detach() * per_token).sum(), self.x, retain_graph=True)
        return g

    def grad_reverse_kl(self) -> torch.Tensor:
        """∇_x KL(π‖ρ) by autograd of a plain log_softmax formula."""
        lp = torch.log_softmax(self.x, -1)
        kl = (lp.exp() * (lp - torch.log_softmax(self.y, -1))).sum()
        (g,) = torch.autograd.grad(kl, self.x)
        return g

    def grad_forward_kl(self) -> torch.Tensor:
        """∇_x KL(ρ‖π) by autograd."""
        lq = torch.log_softmax(self.y, -1)
        kl = (lq.exp() * (lq - torch.log_softmax(self.x, -1))).sum()
        (g,) = torch.autograd.grad(kl, self.x)
        return g

    def kl(self) -> float:
        return float((self.p * (self.p.log() - self.q.log())).sum())


class Tree:
    """All sequences of a tabular autoregressive policy, padded to the horizon.

    ``eos`` (optional): a token that ends the sequence, so sequences have different lengths
    and are right-padded; padded positions use an extra logit row holding ±500, so that any
    unmasked use of them gives inf or NaN.
    """

    def __init__(self, vocab: int, horizon: int, *, eos: int | None = None, seed: int = 0,
                 temperature: float = 1.0) -> None:
        states: dict[tuple[int, ...], int] = {}
        sequences: list[tuple[int, ...]] = []

        def grow(prefix: tuple[int, ...]) -> None:
            states[prefix] = len(states)
            for a in range(vocab):
                seq = prefix + (a,)
                if len(seq) == horizon or a == eos:
                    sequences.append(seq)
                else:
                    grow(seq)

        grow(())
        pad = len(states)
        n, h = len(sequences), horizon
        self.tokens = torch.zeros(n, h, dtype=torch.long)
        self.mask = torch.zeros(n, h, dtype=torch.bool)
        self.row = torch.full((n, h), pad, dtype=torch.long)
        for i, seq in enumerate(sequences):
            for t, a in enumerate(seq):
                self.tokens[i, t], self.mask[i, t], self.row[i, t] = a, True, states[seq[:t]]
        g = torch.Generator().manual_seed(seed)
        theta = torch.randn(pad + 1, vocab, generator=g, dtype=F64)
        ref = torch.randn(pad + 1, vocab, generator=g, dtype=F64)
        self.old = theta + 0.5 * torch.randn(pad + 1, vocab, generator=g, dtype=F64)
        theta[pad], ref[pad] = -500.0, 500.0  # padding: log π(0) = -1000·k, log ρ(0) = 0
        theta[pad, 1], ref[pad, 1] = 500.0, -500.0
        self.theta = theta.requires_grad_(True)
        self.ref = ref
        self.temperature = temperature
        self.scores = torch.randn(n, generator=g, dtype=F64)  # a sequence-level reward
        self.n_states = pad

    # --- library-side views -------------------------------------------------------------
    def logits(self, table: torch.Tensor) -> torch.Tensor:
        return table[self.row]  # (S, H, V)

    def logprobs(self, table: torch.Tensor) -> torch.Tensor:
        return token_logprobs(self.logits(table), self.tokens, temperature=self.temperature)

    # --- independent ground truth ---------------------------------------------------------
    def _plain_logprobs(self, table: torch.Tensor) -> torch.Tensor:
        lsm = torch.log_softmax(table / self.temperature, -1)[self.row]  # (S, H, V)
        lp = lsm.gather(-1, self.tokens.unsqueeze(-1)).squeeze(-1)
        return torch.where(self.mask, lp, torch.zeros((), dtype=F64))

    def prob(self, table: torch.Tensor) -> torch.Tensor:
        """(S,) probability of each sequence under softmax(table / T)."""
        return self._plain_logprobs(table).sum(-1).exp()

    def seq_kl(self, sample: torch.Tensor, first: torch.Tensor, second: torch.Tensor):
        """E_{seq ~ sample}[Σ_t log first(a_t) − log second(a_t)] (differentiable)."""
        per_token = self._plain_logprobs(first) - self._plain_logprobs(second)
        return (self.prob(sample) * per_token.sum(-1)).sum()

    def state_value(self, f, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        """(S, H) f(log first(·|s_t), log second(·|s_t)) at each real position, 0 on padding."""
        a = torch.log_softmax(first / self.temperature, -1)[self.row]
        b = torch.log_softmax(second / self.temperature, -1)[self.row]
        return torch.where(self.mask, f(a, b), torch.zeros((), dtype=F64))

    def state_kl(self, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        """(S, H) exact KL(first(·|s_t)‖second(·|s_t)) at each real position, 0 on padding."""
        return self.state_value(kl_of_logs, first, second)

    def grad(self, value: torch.Tensor) -> torch.Tensor:
        (g,) = torch.autograd.grad(value, self.theta, retain_graph=True)
        return g

    def grad_reverse(self) -> torch.Tensor:
        """∇KL_seq(π‖ρ)."""
        return self.grad(self.seq_kl(self.theta, self.theta, self.ref))

    def grad_forward(self) -> torch.Tensor:
        """∇KL_seq(ρ‖π) (sequences drawn from ρ)."""
        return self.grad(self.seq_kl(self.ref, self.ref, self.theta))

    def grad_per_state(self, f, states_from: torch.Tensor | None = None) -> torch.Tensor:
        """Σ_t E_{s_t}[∇ f(log π(·|s_t), log ρ(·|s_t))], the state distribution held fixed."""
        weights = self.prob(self.theta if states_from is None else states_from).detach()
        return self.grad((weights[:, None] * self.state_value(f, self.theta, self.ref)).sum())

    def grad_pathwise(self, states_from: torch.Tensor | None = None) -> torch.Tensor:
        """Σ_t E_{s_t}[∇KL_t(π‖ρ)] with the state distribution held fixed."""
        return self.grad_per_state(kl_of_logs, states_from)

    def grad_pathwise_forward(self) -> torch.Tensor:
        """Σ_t E_{s_t ~ π}[∇KL_t(ρ‖π)], states held fixed."""
        return self.grad_per_state(lambda a, b: kl_of_logs(b, a))

    def grad_discounted(self, gamma: float) -> torch.Tensor:
        """Σ_t E[∇KL_t] + E_π[Σ_t ∇log π(a_t|s_t)·Σ_{u>t} γ^{u−t}·KL_u] (real tokens lead)."""
        lead = self.mask.long().cumprod(-1).bool()  # the trees pad on the right only
        if not torch.equal(lead, self.mask):
            raise ValueError("grad_discounted counts positions: it needs right-padded rows")
        h = self.mask.shape[-1]
        t, u = torch.arange(h)[:, None], torch.arange(h)[None, :]
        weight = torch.where(u > t, float(gamma) ** (u - t).to(F64), torch.zeros((), dtype=F64))
        future = (self.state_kl(self.theta, self.ref) @ weight.T).detach()  # (S, H)
        p = self.prob(self.theta).detach()
        score = (p[:, None] * self._plain_logprobs(self.theta) * future).sum()
        return self.grad_pathwise() + self.grad(score)

    def expected_grad(self, per_sequence: torch.Tensor, sample: torch.Tensor | None = None):
        """E_{seq ~ sample (default π)}[∇ per_sequence(seq)], exactly."""
        weights = self.prob(self.theta if sample is None else sample).detach()
        return self.grad((weights * per_sequence).sum())


def kl_of_logs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """KL(e^a‖e^b) over the last dim, from two log-distributions."""
    return (a.exp() * (a - b)).sum(-1)


def jsd_of_logs(a: torch.Tensor, b: torch.Tensor, beta: float) -> torch.Tensor:
    """β·KL(ν‖M) + (1−β)·KL(π‖M), M = β·ν + (1−β)·π, with a = log π, b = log ν."""
    log_m = torch.logaddexp(math.log(beta) + b, math.log(1.0 - beta) + a)
    return beta * kl_of_logs(b, log_m) + (1.0 - beta) * kl_of_logs(a, log_m)


def pg_loss(logprobs: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(S,) REINFORCE loss −Σ_t log π(a_t)·stopgrad(G_t), G_t = Σ_{u≥t} r_u (γ = 1)."""
    returns = rewards.flip(-1).cumsum(-1).flip(-1).detach()
    return -torch.where(mask, logprobs * returns, torch.zeros((), dtype=logprobs.dtype)).sum(-1)


def token_sum(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(S,) sum over real tokens."""
    return torch.where(mask, per_token, torch.zeros((), dtype=per_token.dtype)).sum(-1)


def gradient_variance(tree: Tree, per_sequence: torch.Tensor) -> float:
    """Σ_seq P(seq)·‖∇per_sequence(seq) − E[∇]‖² over the policy's parameters (not padding)."""
    p = tree.prob(tree.theta).detach()
    grads = torch.stack([
        torch.autograd.grad(per_sequence[i], tree.theta, retain_graph=True)[0][: tree.n_states]
        for i in range(per_sequence.numel())
    ])  # (S, states, V)
    mean = (p[:, None, None] * grads).sum(0)
    return float((p * (grads - mean).square().sum((1, 2))).sum())


# the trees the tests enumerate
TREES = {
    "V3H3": dict(vocab=3, horizon=3, seed=0),
    "V4H2": dict(vocab=4, horizon=2, seed=1),
    "V3H3-eos": dict(vocab=3, horizon=3, eos=0, seed=2),
    "V4H3-eos": dict(vocab=4, horizon=3, eos=2, seed=3),
}
