"""kl_report: every figure on a batch computed by hand, −inf reference mass, masks, the dict and
text forms, the float64 reference on a random batch, the CLI on a saved file, bad inputs."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch

import klpenalty
from klpenalty import KLReport, kl_report, token_logprobs
from klpenalty.cli import main
from klpenalty.ops.reference import (
    full_kl_reference,
    sampled_kl_reference,
    token_logprobs_reference,
)

from .helpers import make_logits, tol

L = math.log(2.0)
INF = math.inf


def _logits(*rows: tuple[float, ...]) -> torch.Tensor:
    """(len(rows), V) float64 logits log p (−inf where p = 0)."""
    return torch.tensor(rows, dtype=torch.float64).log()


# π and ρ of the hand case (V = 3), with KL(π‖ρ) of each pair:
#   A: π (1/2, 1/4, 1/4), ρ (1/4, 1/2, 1/4)   KL = ½L − ¼L + 0        = L/4
#   U: π = ρ uniform                           KL = 0
#   B: π (1/2, 1/2, 0),   ρ (1/4, 1/4, 1/2)   KL = ½L + ½L + 0 (0·log 0) = L
#   C: π (1/4, 1/4, 1/2), ρ (1/2, 1/4, 1/4)   KL = −¼L + 0 + ½L      = L/4
PI = {"A": (0.5, 0.25, 0.25), "U": (1 / 3,) * 3, "B": (0.5, 0.5, 0.0), "C": (0.25, 0.25, 0.5)}
RHO = {"A": (0.25, 0.5, 0.25), "U": (1 / 3,) * 3, "B": (0.25, 0.25, 0.5), "C": (0.5, 0.25, 0.25)}


def hand_case():
    """2 sequences × 3 positions: (A, token 0) (A, token 1) (U, token 2) | (B, token 0)
    (masked: NaN logits, token 99) (C, token 2)."""
    x = torch.stack([_logits(PI["A"], PI["A"], PI["U"]), _logits(PI["B"], PI["U"], PI["C"])])
    y = torch.stack([_logits(RHO["A"], RHO["A"], RHO["U"]), _logits(RHO["B"], RHO["U"], RHO["C"])])
    x[1, 1] = y[1, 1] = float("nan")
    tokens = torch.tensor([[0, 1, 2], [0, 99, 2]])
    mask = torch.tensor([[True, True, True], [True, False, True]])
    return x, y, tokens, mask


# Per counted position, in index order (0,0) (0,1) (0,2) (1,0) (1,2): r = ρ/π at the token,
# k1 = −log r, k2 = ½ log² r, k3 = r − 1 − log r.
#   (0,0): r = 1/2   (0,1): r = 2   (0,2): r = 1   (1,0): r = 1/2   (1,2): r = 1/2
HAND_KL = [L / 4, L / 4, 0.0, L, L / 4]
HAND_K = {
    "k1": [L, -L, 0.0, L, L],
    "k2": [L * L / 2, L * L / 2, 0.0, L * L / 2, L * L / 2],
    "k3": [L - 0.5, 1 - L, 0.0, L - 0.5, L - 0.5],
}
HAND_SEQ = [slice(0, 3), slice(3, 5)]  # sequence 0: the first three positions, 1: the last two


def _close(a, b):
    assert a == pytest.approx(b, rel=1e-10, abs=1e-12), (a, b)  # float64 inputs


def test_hand_case_estimators_and_sequences():
    rep = kl_report(*hand_case(), top=3)
    assert rep.shape == (2, 3) and rep.vocab_size == 3 and rep.temperature == 1.0
    assert (rep.counted, rep.finite, rep.sequences_used, rep.infinite_kl) == (5, 5, 2, 0)
    seq_kl = [sum(HAND_KL[s]) for s in HAND_SEQ]  # L/2, 5L/4
    _close(rep.exact_total, 7 * L / 4)
    _close(rep.exact_per_token, statistics.fmean(HAND_KL))
    _close(rep.exact_per_sequence, statistics.fmean(seq_kl))
    for name, ks in HAND_K.items():
        s = rep.estimators[name]
        diff = [k - kl for k, kl in zip(ks, HAND_KL)]
        seq_diff = [sum(ks[sl]) - kl for sl, kl in zip(HAND_SEQ, seq_kl)]
        _close(s.mean_per_token, statistics.fmean(ks))
        _close(s.bias_per_token, statistics.fmean(diff))
        _close(s.spread_per_token, statistics.pstdev(diff))
        _close(s.mean_per_sequence, statistics.fmean(sum(ks[sl]) for sl in HAND_SEQ))
        _close(s.bias_per_sequence, statistics.fmean(seq_diff))
        _close(s.spread_per_sequence, statistics.pstdev(seq_diff))
    assert rep.estimators["k1"].negative_share == pytest.approx(1 / 5)  # only (0,1)
    assert rep.estimators["k2"].negative_share == rep.estimators["k3"].negative_share == 0.0
    # written out: k1 sums to 0 on sequence 0 and 2L on sequence 1; k3 to ½ and 2L − 1
    assert [s.index for s in rep.sequences] == [(0,), (1,)]
    assert [s.tokens for s in rep.sequences] == [3, 2]
    for s, exact, k1, k2, k3 in zip(
        rep.sequences, (L / 2, 5 * L / 4), (0.0, 2 * L), (L * L, L * L), (0.5, 2 * L - 1)
    ):
        for got, want in ((s.exact, exact), (s.k1, k1), (s.k2, k2), (s.k3, k3)):
            _close(got, want)
    assert rep.no_mass == 0 and rep.no_mass_first == ()


def test_hand_case_top_positions_and_vocabulary_terms():
    rep = kl_report(*hand_case(), top=3)
    # (1,0) carries L of the total 7L/4; the three L/4 ties follow in index order
    assert [p.index for p in rep.top_positions] == [(1, 0), (0, 0), (0, 1)]
    assert [p.token for p in rep.top_positions] == [0, 0, 1]
    for p, kl, share in zip(rep.top_positions, (L, L / 4, L / 4), (4 / 7, 1 / 7, 1 / 7)):
        _close(p.kl, kl)
        _close(p.share, share)
    _close(rep.top_share, 6 / 7)
    b, a = rep.top_positions[0], rep.top_positions[1]
    _close(b.logprob, math.log(0.5))
    _close(b.ref_logprob, math.log(0.25))
    # B: terms ½L, ½L, 0 (π = 0 at token 2: 0·log 0)
    assert [e.token for e in b.entries] == [0, 1, 2]
    for e, p, q, c, share in zip(
        b.entries, PI["B"], RHO["B"], (L / 2, L / 2, 0.0), (0.5, 0.5, 0.0)
    ):
        _close(e.policy_prob, p)
        _close(e.ref_prob, q)
        _close(e.contribution, c)
        _close(e.share, share)
    # A: terms ½L (token 0), −¼L (token 1), 0 (token 2), largest first; shares of KL_t = L/4
    assert [e.token for e in a.entries] == [0, 2, 1]
    for e, c, share in zip(a.entries, (L / 2, 0.0, -L / 4), (2.0, 0.0, -1.0)):
        _close(e.contribution, c)
        _close(e.share, share)
    top1 = kl_report(*hand_case(), top=1)
    assert [p.index for p in top1.top_positions] == [(1, 0)]
    assert [e.token for e in top1.top_positions[0].entries] == [0]


def test_no_reference_mass_at_the_sampled_token():
    # (0,0): ρ(token 2) = 0, so log ρ(token) = −inf, k = +inf and KL = +inf;
    # (0,1): pair A with token 0, finite; (0,2): ρ has no mass at token 1 where π does,
    # so KL = +inf although the sampled token 0 has ρ-mass (finite estimates)
    x = _logits(PI["A"], PI["A"], PI["A"])[None]
    y = _logits((0.5, 0.5, 0.0), RHO["A"], (0.5, 0.0, 0.5))[None]
    rep = kl_report(x, y, torch.tensor([[2, 0, 0]]))
    assert rep.no_mass == 1 and rep.no_mass_first == (klpenalty.report.TokenAt((0, 0), 2),)
    assert (rep.counted, rep.finite, rep.infinite_kl, rep.sequences_used) == (3, 1, 2, 0)
    assert rep.exact_total == INF and rep.sequences[0].exact == INF
    assert rep.sequences[0].k1 == rep.sequences[0].k3 == INF
    _close(rep.exact_per_token, L / 4)  # the finite position only
    _close(rep.estimators["k1"].bias_per_token, L - L / 4)
    assert rep.exact_per_sequence is None and rep.estimators["k1"].bias_per_sequence is None
    # the two infinite positions split the (infinite) total, in index order
    assert [(p.index, p.share) for p in rep.top_positions] == [((0, 0), 0.5), ((0, 2), 0.5),
                                                                ((0, 1), 0.0)]
    inf_entry = rep.top_positions[1].entries[0]  # token 1: π = 1/4, ρ = 0
    assert inf_entry.token == 1 and inf_entry.contribution == INF and inf_entry.share is None
    assert "no mass at 1 position(s): (0, 0) token 2" in str(rep)


def test_no_mass_lists_the_first_five_in_index_order():
    x = torch.zeros(2, 4, 3)
    y = torch.zeros(2, 4, 3)
    y[..., 1] = float("-inf")
    tokens = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 2]])  # token 1 at 6 positions
    rep = kl_report(x, y, tokens)
    assert rep.no_mass == 6
    assert [t.index for t in rep.no_mass_first] == [(0, 0), (0, 2), (0, 3), (1, 0), (1, 1)]
    assert all(t.token == 1 for t in rep.no_mass_first)
    assert "no mass at 6 position(s) (first 5)" in str(rep)


def test_mask_equals_dropping_the_masked_positions():
    x, y = make_logits((3, 5, 11), torch.float32, seed=1)
    tokens = torch.distributions.Categorical(logits=x).sample()
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[:, 3:] = False
    x[:, 3:] = float("nan")  # masked positions may hold anything
    tokens[:, 3:] = -7
    masked = kl_report(x, y, tokens, mask)
    cut = kl_report(x[:, :3], y[:, :3], tokens[:, :3])
    assert masked.counted == cut.counted == 9
    assert masked.estimators == cut.estimators
    assert [s.exact for s in masked.sequences] == [s.exact for s in cut.sequences]
    assert masked.top_positions == cut.top_positions
    # a sequence with no counted position is left out of the per-sequence statistics
    mask[1] = False
    rep = kl_report(x, y, tokens, mask)
    assert rep.sequences_used == 2 and rep.sequences[1].tokens == 0
    assert rep.sequences[1].exact == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64_reference_on_a_random_batch(dtype):
    x, y = make_logits((2, 3, 4, 37), dtype, seed=2)  # two leading dims: 6 sequences
    tokens = torch.distributions.Categorical(logits=x.double() / 0.7).sample()
    rep = kl_report(x, y, tokens, temperature=0.7, top=4)
    kl = full_kl_reference(x, y, 0.7)  # (2, 3, 4)
    lp = token_logprobs_reference(x, tokens, 0.7)
    ref_lp = token_logprobs_reference(y, tokens, 0.7)
    k = {n: sampled_kl_reference(lp, ref_lp, n) for n in ("k1", "k2", "k3")}
    assert [s.index for s in rep.sequences] == [(i, j) for i in range(2) for j in range(3)]
    got = torch.tensor([[s.exact, s.k1, s.k2, s.k3] for s in rep.sequences], dtype=torch.float64)
    want = torch.stack([kl.sum(-1), *(k[n].sum(-1) for n in ("k1", "k2", "k3"))], -1)
    torch.testing.assert_close(got, want.reshape(6, 4), **tol(dtype))
    for n in ("k1", "k2", "k3"):
        s = rep.estimators[n]
        torch.testing.assert_close(
            torch.tensor(
                [s.mean_per_token, s.bias_per_token, s.spread_per_token], dtype=torch.float64
            ),
            torch.stack([k[n].mean(), (k[n] - kl).mean(), (k[n] - kl).std(correction=0)]),
            **tol(dtype),
        )
    order = kl.flatten().argsort(descending=True)[:4]
    assert [p.index for p in rep.top_positions] == [
        tuple(int(i) for i in torch.unravel_index(f, kl.shape)) for f in order
    ]
    torch.testing.assert_close(
        torch.tensor([p.kl for p in rep.top_positions], dtype=torch.float64),
        torch.stack([kl[p.index] for p in rep.top_positions]),
        **tol(dtype),
    )
    full = kl_report(x, y, tokens, temperature=0.7, top=37)  # all V = 37 terms: they sum to KL_t
    for p in full.top_positions:
        _close(sum(e.contribution for e in p.entries), float(kl[p.index]))
        _close(sum(e.share for e in p.entries), 1.0)


def test_temperature_divides_both_models():
    x, y = make_logits((2, 4, 9), torch.float64, seed=3)
    tokens = torch.distributions.Categorical(logits=x).sample()
    hot = kl_report(x, y, tokens, temperature=2.0)
    plain = kl_report(x / 2, y / 2, tokens)
    for a, b in zip(hot.sequences, plain.sequences):
        for f in ("exact", "k1", "k2", "k3"):
            _close(getattr(a, f), getattr(b, f))
    assert hot.temperature == 2.0


def test_two_dim_logits_are_one_sequence():
    x, y, tokens, mask = hand_case()
    rep = kl_report(x[0], y[0], tokens[0])
    assert rep.shape == (3,) and [s.index for s in rep.sequences] == [()]
    _close(rep.sequences[0].exact, L / 2)
    assert rep.top_positions[0].index == (0,)


def test_empty_batch():
    rep = kl_report(torch.zeros(0, 4, 5), torch.zeros(0, 4, 5), torch.zeros(0, 4, dtype=torch.long))
    assert rep.counted == 0 and rep.sequences == () and rep.top_positions == ()
    assert rep.exact_per_token is None and rep.estimators["k1"].negative_share is None
    assert "KL report: 0 sequence(s)" in str(rep)


def test_dict_is_plain_and_json_round_trips():
    rep = kl_report(*hand_case(), top=2)
    d = rep.to_dict()

    def plain(obj):
        if isinstance(obj, dict):
            return all(isinstance(k, str) and plain(x) for k, x in obj.items())
        if isinstance(obj, list):
            return all(plain(x) for x in obj)
        return obj is None or type(obj) in (int, float, str, bool)

    assert plain(d)
    assert json.loads(json.dumps(d)) == d
    assert d["shape"] == [2, 3] and d["counted"] == 5
    assert d["top_positions"][0]["index"] == [1, 0]
    assert d["top_positions"][0]["entries"][0]["token"] == 0
    assert set(d["estimators"]) == {"k1", "k2", "k3"}
    assert d["estimators"]["k1"]["negative_share"] == pytest.approx(0.2)
    assert d["sequences"][1] == {
        "index": [1], "tokens": 2, "exact": pytest.approx(5 * L / 4), "k1": pytest.approx(2 * L),
        "k2": pytest.approx(L * L), "k3": pytest.approx(2 * L - 1),
    }
    assert KLReport.from_dict(json.loads(json.dumps(d))) == rep
    inf = kl_report(_logits(PI["A"])[None], _logits((0.5, 0.5, 0.0))[None], torch.tensor([[2]]))
    assert json.loads(json.dumps(inf.to_dict()))["exact_total"] == INF
    assert KLReport.from_dict(inf.to_dict()) == inf and "no mass at 1" in str(inf)


def test_text_is_a_fixed_width_table():
    rep = kl_report(*hand_case(), top=2)
    text = str(rep)
    lines = text.splitlines()
    assert lines[0] == "KL report: 2 sequence(s) × 3 position(s), V = 3, temperature 1"
    head = next(i for i, line in enumerate(lines) if "bias/tok" in line)
    table = lines[head : head + 5]  # header, exact KL, k1, k2, k3
    assert [line.split()[0] for line in table[1:]] == ["exact", "k1", "k2", "k3"]
    assert len({len(line) for line in table[2:]}) == 1  # the estimator rows line up
    assert table[2].split()[-1] == "20.0%" and f"{7 * L / 20:.4g}" in table[1]
    assert "top 2 position(s) by KL: 71.4% of the total" in text
    assert "  (1, 0)" in text and "reference gives every sampled token some mass" in text
    assert "sequences (2 of 2)" in text
    assert "sequences" not in rep.format(max_sequences=0).split("by KL")[1]


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(policy_logits=torch.zeros(3), ref_logits=torch.zeros(3)), ValueError,
         r"sequence dim T, got shape=\(3,\)"),
        (dict(ref_logits=torch.zeros(2, 3, 4)), ValueError, "same shape"),
        (dict(policy_logits=torch.zeros(2, 3, 3, dtype=torch.long)), TypeError, "policy_logits"),
        (dict(tokens=torch.zeros(2, 3)), TypeError, "tokens must be an integer"),
        (dict(tokens=torch.zeros(2, 4, dtype=torch.long)), ValueError,
         r"tokens must have shape \(2, 3\)"),
        (dict(tokens=[[0, 1, 2]]), TypeError, "tokens must be a torch.Tensor"),
        (dict(mask=torch.ones(2, 3)), TypeError, "mask must be a bool"),
        (dict(mask=torch.ones(2, 3, 1, dtype=torch.bool)), ValueError, "mask must have shape"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(top=0), ValueError, "top must be >= 1"),
        (dict(top=2.0), TypeError, "top must be an int"),
        (dict(top=True), TypeError, "top must be an int"),
        (dict(check=1), TypeError, "check must be a bool"),
        (dict(backend="gpu"), ValueError, "backend"),
    ],
)
def test_bad_arguments(change, error, match):
    x, y, tokens, mask = hand_case()
    args = dict(policy_logits=x, ref_logits=y, tokens=tokens, mask=mask) | change
    with pytest.raises(error, match=match):
        kl_report(**args)


def test_bad_values_at_counted_positions():
    x, y, tokens, mask = hand_case()
    bad = tokens.clone()
    bad[1, 2] = 3
    range_error = r"tokens must lie in \[0, 3\).*the first 3 at index \(1, 2\)"
    with pytest.raises(ValueError, match=range_error):
        kl_report(x, y, bad, mask)
    bad[1, 2] = -100  # an ignore_index of token_logprobs is no exception here
    with pytest.raises(ValueError, match="the first -100 at index"):
        kl_report(x, y, bad, mask)
    zero = tokens.clone()
    zero[1, 0] = 2  # π_B(2) = 0: the policy cannot have sampled it
    zero_error = r"probability 0 under the policy.*first 2 at index \(1, 0\)"
    with pytest.raises(ValueError, match=zero_error):
        kl_report(x, y, zero, mask)
    tokens[1, 1] = 0
    with pytest.raises(ValueError, match="policy_logits contains NaN"):
        kl_report(x, y, tokens)  # the NaN position counts without the mask
    # check=False skips the reads; the impossible token leaves the statistics as non-finite
    rep = kl_report(x, y, zero, mask, check=False)
    assert rep.counted == 5 and rep.finite == 4


def test_runs_without_grad_and_leaves_inputs_alone():
    x, y = make_logits((2, 3, 5), torch.float32, seed=4)
    x.requires_grad_(True)
    tokens = torch.distributions.Categorical(logits=x.detach()).sample()
    rep = kl_report(x, y, tokens)
    assert isinstance(rep, KLReport) and x.grad is None
    torch.testing.assert_close(
        torch.tensor([s.k1 for s in rep.sequences]),
        (token_logprobs(x, tokens) - token_logprobs(y, tokens)).sum(-1).detach(),
    )


# ---- the CLI: klpenalty report FILE.pt ----


def _save(tmp_path, **tensors):
    path = tmp_path / "batch.pt"
    torch.save(tensors, path)
    return str(path)


def test_cli_prints_the_table_and_json(tmp_path, capsys):
    x, y, tokens, mask = hand_case()
    path = _save(tmp_path, policy_logits=x, ref_logits=y, tokens=tokens, mask=mask)
    assert main(["report", path, "--top", "2"]) == 0
    assert capsys.readouterr().out == str(kl_report(x, y, tokens, mask, top=2))
    assert main(["report", path, "--json", "--temperature", "0.5"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got == kl_report(x, y, tokens, mask, temperature=0.5).to_dict()
    assert got["temperature"] == 0.5


def test_cli_without_mask(tmp_path, capsys):
    x, y, tokens, _ = hand_case()
    path = _save(tmp_path, policy_logits=x[0], ref_logits=y[0], tokens=tokens[0])
    assert main(["report", path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["counted"] == 3


@pytest.mark.parametrize(
    "content, match",
    [
        (dict(policy_logits=torch.zeros(1, 2, 3), ref_logits=torch.zeros(1, 2, 3)),
         r"missing key\(s\) \['tokens'\]; the file has \['policy_logits', 'ref_logits'\]"),
        (dict(policy_logits=torch.zeros(1, 2, 3), ref_logits=torch.zeros(1, 2, 3), tokens=[0, 1]),
         "tokens must be a torch.Tensor, got list"),
        (dict(policy_logits=torch.zeros(1, 2, 3), ref_logits=torch.zeros(1, 2, 3),
              tokens=torch.zeros(1, 2, dtype=torch.long), mask=torch.ones(1, 2)),
         "mask must be a bool tensor"),
        ([torch.zeros(2)], "must hold a dict with keys"),
    ],
)
def test_cli_bad_files(tmp_path, content, match):
    path = tmp_path / "bad.pt"
    torch.save(content, path)
    with pytest.raises(SystemExit, match=f"klpenalty report: {path}: .*{match}"):
        main(["report", str(path)])


def test_cli_missing_or_unreadable_file(tmp_path):
    with pytest.raises(SystemExit, match="no such file"):
        main(["report", str(tmp_path / "nope.pt")])
    (tmp_path / "text.pt").write_text("not a tensor file")
    with pytest.raises(SystemExit, match="cannot be read by torch.load"):
        main(["report", str(tmp_path / "text.pt")])
