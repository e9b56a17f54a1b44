"""One TRL GRPO training step on CPU, per KL estimator: time per phase, forwards and peak RSS.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_trl_step.py                   # 2 layers
    PYTHONPATH=src .venv/bin/python benchmarks/bench_trl_step.py --layers 24 --rounds 2
    PYTHONPATH=src .venv/bin/python benchmarks/bench_trl_step.py --iterations2
    PYTHONPATH=src .venv/bin/python benchmarks/bench_trl_step.py --quick           # smoke test

Variants (``--variants``), all ``klpenalty.integrations.trl.GRPOTrainer``:

- ``beta0``: β = 0 (no KL term, no reference model), ``kl_estimator="trl"``;
- ``trl``: TRL's own k3 term, ``kl_estimator="trl"``, β = ``--beta`` (0.04);
- ``k3_ratio`` (run only when named): ``kl_estimator="k3_ratio"``, same β;
- ``exact``: ``kl_estimator="exact"``, same β.

The model is Qwen2-shaped (``transformers.Qwen2Config``; defaults: vocabulary 151936, hidden
896, intermediate 4864, 14 heads, 2 KV heads, 2 layers, tied embeddings, float32), randomly
initialised (seeded), saved to a temporary folder: TRL loads the reference from there (the
policy's ``config._name_or_path``); the policy is loaded from it and every parameter moved by
1 % of its tensor's standard deviation (seeded, the same for every variant), so the KL is not 0.
The tokenizer is a word-level one built here with one word per id ("<pad>", "<eos>", "<unk>",
then "w3".."w{V-1}"), so every sampled id decodes. ``generation_kwargs={"min_new_tokens": T}``
makes every completion exactly T = ``--tokens`` (32) tokens. Each optimizer step trains on
``--completions`` (8) completions, one prompt's group (``per_device_train_batch_size =
num_generations = 8``); TRL's defaults otherwise (``loss_type="dapo"``, gradient
checkpointing on, AdamW, ``max_grad_norm`` 1, ``logging_steps`` 10), ``report_to="none"``,
``use_cpu=True``, ``bf16=False``; torch's threads = the core count (``--threads``).
``--iterations2``: ``num_iterations=2, steps_per_generation=2`` (a generation batch of 2 × 8
completions, 4 optimizer steps per generation, TRL's old log-prob pass at generation).

Each variant's trainer runs its own ``trainer.train()`` in a thread; the threads take turns
(one runs at a time, the others wait in a callback), so the variants' rounds interleave in one
process. A round is one generation batch: 1 optimizer step (4 with ``--iterations2``); the
first round of each variant is a warm-up and is not reported; then ``--rounds`` rounds each.
Per round, by timers wrapped around the trainer's methods on the instance:

- ``step``: the round's wall time in ``trainer.train()`` (from one ``on_step_end`` to the
  next: data, ``training_step``, gradient clipping, optimizer, scheduler);
- ``generation``: ``_generate_and_score_completions`` less the reference and old log-prob
  passes inside it (sampling, decoding, rewards, advantages);
- ``ref pass``: ``_get_per_token_logps_and_entropies`` on ``trainer.ref_model`` (with
  ``"exact"``, its reference pass through ``klpenalty.hf.reference_states`` where the code has
  one); ``old logps``: that method on the policy inside generation;
- ``loss fwd``: ``compute_loss``; ``backward``: ``accelerator.backward``;
- ``optim``: from the end of ``training_step`` to ``on_step_end`` (clip, step, zero_grad);
- forwards, by forward hooks on the models' top modules and their ``.model`` bodies (a call
  of either body is one forward): ``ref fwd/gen batch``, reference forwards per generation
  batch (TRL runs its reference pass in chunks of ``per_device_train_batch_size`` rows, so 2
  with ``--iterations2``); ``ref rows/completion``, the reference's batch rows per completion of
  the generation batch (1: every completion through the reference once); ``policy fwd``, the
  policy's forwards outside sampling (``_generate``), per round.

Medians over rounds; ``x trl``: each column's median over the ``trl`` row's. Peak RSS:
``VmHWM`` (``/proc/self/status``; ``ru_maxrss`` where that is missing) of a fresh subprocess
per variant (``--child``) that builds the same trainer
and runs the warm-up round and one round (``--no-rss`` skips them). Writes
``benchmarks/results/bench_trl_step.{csv,md}`` (``_layers<n>`` appended with ``--layers`` other
than 2, ``_iterations2`` with ``--iterations2``).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = ("beta0", "trl", "exact")
KNOWN = ("beta0", "trl", "k3_ratio", "exact")
PHASES = ("step", "generation", "ref_pass", "old_logps", "loss_fwd", "backward", "optim")
COUNTS = ("ref_fwd_per_gen", "ref_per_completion", "policy_fwd", "policy_rows")
QUICK = {"vocab": 64, "hidden": 16, "intermediate": 32, "heads": 2, "kv_heads": 1,
         "layers": 1, "rounds": 1, "tokens": 8, "completions": 4}
SPECIALS = ("<pad>", "<eos>", "<unk>")


def machine() -> dict:
    """The CPU's model name and its AVX2 / AVX-512 flags (from /proc/cpuinfo)."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    simd = [f for f in ("avx2", "avx512f", "avx512bw", "avx512_bf16") if f in flags]
    return {"name": name, "simd": " ".join(simd) or "none"}


def make_tokenizer(vocab: int):
    """A word-level tokenizer with exactly ``vocab`` ids, each a word; built here."""
    import tokenizers
    import transformers

    words = list(SPECIALS) + [f"w{i}" for i in range(len(SPECIALS), vocab)]
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece()  # joins the words with spaces
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def qwen2_config(args):
    import transformers

    return transformers.Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=max(128, 4 * args.tokens),
        tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=None,
        torch_dtype="float32",
    )


def save_reference(args, folder: str) -> None:
    """The seeded random Qwen2 that is the reference (and the policy's start), saved."""
    import torch
    import transformers

    torch.manual_seed(args.seed)
    transformers.Qwen2ForCausalLM(qwen2_config(args)).save_pretrained(folder)


def load_policy(folder: str, seed: int):
    """The saved model (so ``_name_or_path`` = folder), every parameter moved by 1 % of its
    tensor's standard deviation (seeded)."""
    import torch
    import transformers

    policy = transformers.Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in policy.parameters():
            scale = 0.01 * (float(p.std()) if p.numel() > 1 and float(p.std()) > 0 else 1.0)
            p.add_(scale * torch.randn(p.shape, generator=g))
    return policy


def prompts(vocab: int, n: int = 64, seed: int = 0) -> list[str]:
    """``n`` prompts of 4 to 8 words, the words drawn from the tokenizer's (seeded)."""
    import random

    rng = random.Random(seed)
    lo = len(SPECIALS)
    return [" ".join(f"w{rng.randrange(lo, vocab)}" for _ in range(rng.randint(4, 8)))
            for _ in range(n)]


def even_share(completions, **kwargs):
    """A toy reward: the share of a completion's words whose number is even."""
    out = []
    for c in completions:
        words = c.split()
        out.append(sum(w[1:].isdigit() and int(w[1:]) % 2 == 0 for w in words)
                   / max(len(words), 1))
    return out


class Probe:
    """Timers on one trainer's methods and forward counters on its models, per round."""

    def __init__(self, trainer, gen_rows: int):
        self.trainer = trainer
        self.gen_rows = gen_rows  # completions per generation batch
        self.cur = self._zero()
        self.rounds: list[dict] = []
        self.in_generation = self.in_sampling = False
        self.t_train_end = None
        self._wrap()
        self._hook()

    @staticmethod
    def _zero() -> dict:
        d = {k: 0.0 for k in PHASES}
        d.update(gen_total=0.0, gen_calls=0, ref_fwd=0, ref_rows=0, policy_fwd=0,
                 policy_rows=0)
        return d

    def _wrap(self) -> None:
        tr, probe = self.trainer, self

        def timed(name, fn, on_enter=None, on_exit=None):
            def wrapper(*a, **k):
                if on_enter:
                    on_enter()
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    probe.cur[name] += time.perf_counter() - t0
                    if on_exit:
                        on_exit()
            return wrapper

        def gen_enter():
            probe.in_generation = True
            probe.cur["gen_calls"] += 1

        def gen_exit():
            probe.in_generation = False

        tr._generate_and_score_completions = timed(
            "gen_total", tr._generate_and_score_completions, gen_enter, gen_exit)
        sample = tr._generate

        def sampling(*a, **k):
            probe.in_sampling = True
            try:
                return sample(*a, **k)
            finally:
                probe.in_sampling = False

        tr._generate = sampling
        logps = tr._get_per_token_logps_and_entropies

        def logps_pass(model, *a, **k):
            t0 = time.perf_counter()
            try:
                return logps(model, *a, **k)
            finally:
                dt = time.perf_counter() - t0
                if tr.ref_model is not None and model is tr.ref_model:
                    probe.cur["ref_pass"] += dt
                elif probe.in_generation:
                    probe.cur["old_logps"] += dt

        tr._get_per_token_logps_and_entropies = logps_pass
        tr.compute_loss = timed("loss_fwd", tr.compute_loss)
        tr.accelerator.backward = timed("backward", tr.accelerator.backward)
        step = tr.training_step

        def training_step(*a, **k):
            out = step(*a, **k)
            probe.t_train_end = time.perf_counter()
            return out

        tr.training_step = training_step

    def _hook(self) -> None:
        tr, probe = self.trainer, self

        def counter(kind):
            # a call of the top module also calls its body: count a forward where a body runs
            # (the body's own hook), and a top call only where its body did not run
            state = {"body": 0}

            def body_hook(module, args, kwargs, output):
                if kind == "policy" and probe.in_sampling:
                    return
                state["body"] += 1
                probe.cur[f"{kind}_fwd"] += 1
                probe.cur[f"{kind}_rows"] += _rows(args, kwargs)

            def top_pre(module, args, kwargs):
                module._bench_body_before = state["body"]

            def top_hook(module, args, kwargs, output):
                if kind == "policy" and probe.in_sampling:
                    return
                if state["body"] == module._bench_body_before:
                    probe.cur[f"{kind}_fwd"] += 1
                    probe.cur[f"{kind}_rows"] += _rows(args, kwargs)
            return body_hook, top_pre, top_hook

        models = [("policy", tr.model)]
        if tr.ref_model is not None:
            models.append(("ref", tr.ref_model))
        for kind, model in models:
            top = tr.accelerator.unwrap_model(model)
            body_hook, top_pre, top_hook = counter(kind)
            top.register_forward_pre_hook(top_pre, with_kwargs=True)
            top.register_forward_hook(top_hook, with_kwargs=True)
            body = getattr(top, "model", None)
            if body is not None:
                body.register_forward_hook(body_hook, with_kwargs=True)

    def begin(self) -> None:
        self.cur = self._zero()
        self.t0 = time.perf_counter()

    def end_step(self) -> None:
        if self.t_train_end is not None:
            self.cur["optim"] += time.perf_counter() - self.t_train_end
            self.t_train_end = None

    def end_round(self) -> dict:
        c = self.cur
        c["step"] = time.perf_counter() - self.t0
        c["generation"] = c["gen_total"] - c["ref_pass"] - c["old_logps"]
        c["ref_fwd_per_gen"] = c["ref_fwd"] / max(c["gen_calls"], 1)
        c["ref_per_completion"] = c["ref_rows"] / (max(c["gen_calls"], 1) * self.gen_rows)
        self.rounds.append(c)
        return c


def _rows(args, kwargs) -> int:
    for x in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), *args):
        if hasattr(x, "shape") and len(x.shape) >= 1:
            return int(x.shape[0])
    return 0


def build_trainer(args, variant: str, ref_dir: str, out_dir: str):
    import datasets
    import trl

    from klpenalty.integrations.trl import GRPOTrainer

    estimator = {"beta0": "trl", "trl": "trl", "k3_ratio": "k3_ratio", "exact": "exact"}[variant]
    two = args.iterations2
    steps_per_round = 4 if two else 1
    config = trl.GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=args.completions,
        num_generations=args.completions, max_completion_length=args.tokens,
        generation_kwargs={"min_new_tokens": args.tokens},
        max_steps=steps_per_round * (1 + args.rounds), beta=0.0 if variant == "beta0" else args.beta,
        loss_type="dapo", num_iterations=2 if two else 1, steps_per_generation=2 if two else 1,
        report_to="none", use_cpu=True, bf16=False, save_strategy="no", seed=args.seed,
        disable_tqdm=True, learning_rate=1e-6,
    )
    dataset = datasets.Dataset.from_dict({"prompt": prompts(args.vocab, seed=args.seed)})
    trainer = GRPOTrainer(
        load_policy(ref_dir, args.seed), even_share, args=config, train_dataset=dataset,
        processing_class=make_tokenizer(args.vocab), kl_estimator=estimator,
    )
    return trainer, steps_per_round


class Turns:
    """Runs each trainer's ``train()`` in a thread, one thread at a time: a variant's thread
    runs one round, then waits in ``on_step_end`` until the main thread gives it the next."""

    def __init__(self):
        self.lock = threading.Condition()
        self.turn = None  # the variant allowed to run
        self.errors: dict = {}
        self.finished: set = set()  # the variants whose train() has returned or raised

    def give(self, variant: str) -> None:
        with self.lock:
            if variant not in self.finished:
                self.turn = variant
                self.lock.notify_all()
                self.lock.wait_for(lambda: self.turn is None or variant in self.finished)
                self.turn = None
        if variant in self.errors:
            raise RuntimeError(f"variant {variant} failed") from self.errors[variant]

    def wait(self, variant: str) -> None:
        with self.lock:
            self.lock.wait_for(lambda: self.turn == variant)

    def done(self, finished: str | None = None) -> None:
        with self.lock:
            self.turn = None
            if finished is not None:
                self.finished.add(finished)
            self.lock.notify_all()


def callback(turns: Turns, variant: str, probe: Probe, steps_per_round: int):
    from transformers import TrainerCallback

    class Baton(TrainerCallback):
        steps = 0

        def on_train_begin(self, *a, **k):
            turns.wait(variant)
            probe.begin()

        def on_step_end(self, *a, **k):
            probe.end_step()
            self.steps += 1
            if self.steps % steps_per_round == 0:
                probe.end_round()
                turns.done()
                turns.wait(variant)  # the next round, or the end of train()
                probe.begin()

    return Baton()


def run_variants(args, variants, ref_dir: str, work: str) -> dict:
    """Builds every variant's trainer, then runs 1 + rounds interleaved rounds; returns each
    variant's per-round records (the warm-up round dropped)."""
    turns, threads, probes = Turns(), {}, {}
    for v in variants:
        trainer, spr = build_trainer(args, v, ref_dir, os.path.join(work, v))
        probe = probes[v] = Probe(trainer, args.completions * (2 if args.iterations2 else 1))
        trainer.add_callback(callback(turns, v, probe, spr))

        def target(trainer=trainer, v=v):
            try:
                trainer.train()
            except BaseException as e:  # reported by give()
                turns.errors[v] = e
            finally:
                turns.done(finished=v)

        threads[v] = threading.Thread(target=target, name=f"bench-{v}", daemon=True)
    for v in variants:  # every trainer built first: a new one resets accelerate's state
        threads[v].start()
    for r in range(1 + args.rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for v in order:
            turns.give(v)
            if r and args.verbose:
                c = probes[v].rounds[-1]
                print(f"round {r} {v}: " + "  ".join(f"{k}={c[k]:.3f}" for k in PHASES),
                      flush=True)
    for v in variants:  # the threads leave train() one at a time
        turns.give(v)
        threads[v].join()
    for v in variants:
        if len(probes[v].rounds) < 1 + args.rounds:
            raise RuntimeError(f"variant {v} ran {len(probes[v].rounds)} rounds, not "
                               f"{1 + args.rounds}")
    return {v: probes[v].rounds[1:] for v in variants}


def child(args) -> int:
    """One variant in this fresh process: warm-up round and one round; prints its peak RSS."""
    args.rounds = 1
    with tempfile.TemporaryDirectory() as work:
        run_variants(args, [args.child], args.ref_dir, work)
    print(json.dumps({"variant": args.child, "peak_rss_mib": round(peak_rss_mib())}), flush=True)
    return 0


def peak_rss_mib() -> float:
    """This process's peak RSS: VmHWM of /proc/self/status (its own memory map's high-water
    mark: ru_maxrss would carry over the parent's RSS at fork), else ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def peak_rss(args, variant: str, ref_dir: str, argv: list[str]) -> float | str:
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--child", variant,
           "--ref-dir", ref_dir]
    done = subprocess.run(cmd, capture_output=True, text=True)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)["peak_rss_mib"]
    sys.stderr.write(done.stderr[-4000:])
    return "failed"


def summarise(records: dict, rss: dict) -> list[dict]:
    med = {v: {k: statistics.median(float(r[k]) for r in rs) for k in PHASES + COUNTS}
           for v, rs in records.items()}
    base = med.get("trl")
    out = []
    for v, m in med.items():
        row = {"variant": v, "rounds": len(records[v])}
        for k in PHASES:
            row[f"{k}_s"] = round(m[k], 4)
            if base is not None:
                row[f"{k}_x_trl"] = round(m[k] / base[k], 3) if base[k] > 0 else ""
        for k in COUNTS:
            row[k] = int(m[k]) if float(m[k]).is_integer() else round(m[k], 2)
        row["peak_rss_mib"] = rss.get(v, "")
        if base is not None and isinstance(rss.get(v), (int, float)) and \
                isinstance(rss.get("trl"), (int, float)):
            row["peak_rss_x_trl"] = round(rss[v] / rss["trl"], 3)
        out.append(row)
    return out


def cell(row: dict, key: str, unit: str = "") -> str:
    value = row.get(f"{key}_s", row.get(key, ""))
    if value == "":
        return ""
    ratio = row.get(f"{key}_x_trl", "")
    text = f"{value}{unit}"
    return f"{text} ({ratio}×)" if ratio != "" else text


def table(rows: list[dict]) -> str:
    heads = ["variant", "step", "generation", "ref pass", "old logps", "loss fwd", "backward",
             "optim", "ref fwd/gen batch", "ref rows/completion", "policy fwd", "peak RSS (MiB)"]
    lines = ["| " + " | ".join(heads) + " |", "|---|" + "---:|" * (len(heads) - 1)]
    for r in rows:
        rss = r["peak_rss_mib"]
        if r.get("peak_rss_x_trl", "") != "":
            rss = f"{rss} ({r['peak_rss_x_trl']}×)"
        cells = [r["variant"], *(cell(r, k) for k in PHASES), str(r["ref_fwd_per_gen"]),
                 str(r["ref_per_completion"]), str(r["policy_fwd"]), str(rss)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(KNOWN))
    p.add_argument("--rounds", type=int, default=3, help="measured rounds after 1 warm-up")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--intermediate", type=int, default=4864)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--completions", type=int, default=8, help="completions per optimizer step")
    p.add_argument("--tokens", type=int, default=32, help="tokens per completion")
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--iterations2", action="store_true",
                   help="num_iterations=2, steps_per_generation=2")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes (vocab 64, hidden 16, 1 layer, 1 round) for a smoke test")
    p.add_argument("--no-rss", action="store_true", help="skip the peak-RSS subprocesses")
    p.add_argument("--verbose", action="store_true", help="print every round")
    p.add_argument("--out", default=None,
                   help="output path without extension (default benchmarks/results/"
                        "bench_trl_step, _layers<n> appended with --layers other than 2, _iterations2 with "
                        "--iterations2)")
    p.add_argument("--child", choices=list(KNOWN), help=argparse.SUPPRESS)
    p.add_argument("--ref-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        given = set(a.split("=")[0].lstrip("-").replace("-", "_") for a in (argv or sys.argv[1:])
                    if a.startswith("--"))
        for k, v in QUICK.items():
            if k not in given:
                setattr(args, k, v)
    if args.out is None:
        name = ("bench_trl_step" + (f"_layers{args.layers}" if args.layers != 2 else "")
                + ("_iterations2" if args.iterations2 else ""))
        args.out = os.path.join(HERE, "results", name)
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    if args.child:
        return child(args)
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    work = tempfile.mkdtemp(prefix="bench_trl_step_")
    try:
        ref_dir = os.path.join(work, "reference")
        save_reference(args, ref_dir)
        records = run_variants(args, list(args.variants), ref_dir, work)
        load1 = os.getloadavg()
        t_timed = time.perf_counter() - t0
        child_argv = [a for a in argv if a not in ("--verbose",)]
        rss = {} if args.no_rss else {v: peak_rss(args, v, ref_dir, child_argv)
                                       for v in args.variants}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load2 = os.getloadavg()
    wall = time.perf_counter() - t0
    rows = summarise(records, rss)
    cpu = machine()
    meta = {
        "date": time.strftime("%Y-%m-%d"), "machine": cpu["name"], "simd": cpu["simd"],
        "cores": os.cpu_count(), "torch": torch.__version__, "transformers":
        transformers.__version__, "trl": __import__("trl").__version__,
        "threads": args.threads, "layers": args.layers, "vocab": args.vocab,
        "hidden": args.hidden, "completions": args.completions, "tokens": args.tokens,
        "beta": args.beta, "iterations2": args.iterations2,
        "loadavg_start": " ".join(f"{x:.2f}" for x in load0),
        "loadavg_end_timed": " ".join(f"{x:.2f}" for x in load1),
        "loadavg_end": " ".join(f"{x:.2f}" for x in load2),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".csv", "w", newline="") as f:
        full = [{**r, **meta} for r in rows]
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in full for k in r)))
        w.writeheader()
        w.writerows(full)
    spr = 4 if args.iterations2 else 1
    with open(args.out + ".md", "w") as f:
        f.write(
            f"One TRL GRPO round per variant ({'num_iterations=2, steps_per_generation=2: ' if args.iterations2 else ''}"
            f"one generation batch, {spr} optimizer step{'s' if spr > 1 else ''}), "
            f"{meta['date']}, {cpu['name']} ({cpu['simd']}), {os.cpu_count()} cores, torch "
            f"{torch.__version__}, transformers {meta['transformers']}, trl {meta['trl']}, "
            f"{args.threads} threads. Qwen2-shaped, {args.layers} layer(s), V={args.vocab}, "
            f"H={args.hidden}, tied embeddings, float32; {args.completions} completions of "
            f"{args.tokens} tokens per optimizer step, β={args.beta} (beta0: 0). Medians (s) of "
            f"{args.rounds} interleaved rounds after 1 warm-up, (ratio to `trl`). loadavg "
            f"(1/5/15 min) {meta['loadavg_start']} at the start, {meta['loadavg_end_timed']} "
            f"after the timed rounds, {meta['loadavg_end']} at the end; {t_timed:.0f} s "
            f"timed part, {wall:.0f} s in all. Peak RSS: "
            f"{'not measured (--no-rss)' if args.no_rss else 'one fresh process per variant'}.\n\n"
        )
        f.write(table(rows))
    print(table(rows))
    print(f"wrote {args.out}.csv and {args.out}.md ({wall:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
