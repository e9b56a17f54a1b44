"""Command line: ``klpenalty env | bench | demo | report``."""

from __future__ import annotations

import argparse
import platform
import sys

from . import __version__

__all__ = ["main"]

# --help shows plain text: the module docstring above is reStructuredText for the docs
DESCRIPTION = (
    "klpenalty: the exact KL penalty for RLHF. Commands: env (versions and backends), "
    "bench (time the exact KL), demo (RLHF and distillation on a tiny language model), "
    "report (the exact KL of saved logits next to the sampled estimators)."
)


def _env(_: argparse.Namespace) -> int:
    import torch

    from klpenalty.ops import native
    from klpenalty.ops.dispatch import available_backends

    print(f"klpenalty {__version__}")
    print(f"python    {platform.python_version()} ({platform.machine()})")
    print(f"torch     {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"cuda      {torch.cuda.is_available()}")
    print(f"backends  {', '.join(available_backends())}")
    print(f"cpu path  {native.status()}")
    return 0


def _shape(text: str) -> tuple[int, int, int]:
    from klpenalty.bench import SHAPES

    if text in SHAPES:
        return SHAPES[text]
    try:
        dims = tuple(int(d) for d in text.replace("x", ",").split(","))
    except ValueError:
        dims = ()
    if len(dims) != 3 or min(dims) < 1:
        raise argparse.ArgumentTypeError(
            f"shape must be B,T,V (three positive ints) or one of {list(SHAPES)}, got {text!r}"
        )
    return dims  # type: ignore[return-value]


def _bench(args: argparse.Namespace) -> int:
    from klpenalty import bench

    rows = []
    for dtype in args.dtype:
        rows += bench.run_benchmark(
            args.shape,
            dtype,
            modes=tuple(args.mode),
            names=args.providers,
            repeats=args.repeats,
            memory=not args.no_memory,
            error=not args.no_error,
            threads=args.threads,
            load=args.load,
            clock=args.clock,
            log=(lambda s: print(s, file=sys.stderr)) if not args.quiet else None,
        )
    table = bench.format_table(rows)
    print(table, end="")
    if args.csv:
        bench.write_csv(rows, args.csv)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(table)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from klpenalty.demo.runner import run_demo

    return run_demo(args, argv=getattr(args, "argv", None))


REPORT_KEYS = ("policy_logits", "ref_logits", "tokens")  # required; "mask" is optional


def _report(args: argparse.Namespace) -> int:
    import json

    import torch

    from klpenalty.report import kl_report

    def fail(message: str) -> SystemExit:
        return SystemExit(f"klpenalty report: {args.file}: {message}")

    try:
        data = torch.load(args.file, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise fail("no such file") from None
    except Exception as e:  # not a torch.save file, or one holding more than tensors
        raise fail(f"cannot be read by torch.load(weights_only=True): {e}") from None
    if not isinstance(data, dict):
        raise fail(
            f"must hold a dict with keys {list(REPORT_KEYS)} (and optionally 'mask'), "
            f"got a {type(data).__name__}"
        )
    missing = [k for k in REPORT_KEYS if k not in data]
    if missing:
        raise fail(f"missing key(s) {missing}; the file has {sorted(map(str, data))}")
    try:
        report = kl_report(
            data["policy_logits"], data["ref_logits"], data["tokens"], data.get("mask"),
            temperature=args.temperature, top=args.top,
        )
    except (TypeError, ValueError) as e:  # names the key (the argument), shape and dtype
        raise fail(str(e)) from None
    if args.json:  # an infinite KL is written as Infinity, as Python's json does
        print(json.dumps(report.to_dict(), indent=1))
    else:
        print(report, end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="klpenalty", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="print versions and available backends")
    env.set_defaults(func=_env)
    b = sub.add_parser(
        "bench",
        help="time the exact KL: seed formula, F.kl_div, every backend, and the read floor",
        description="Benchmark the exact KL at one shape (see benchmarks/README.md).",
    )
    b.add_argument(
        "--shape", type=_shape, default=(4, 512, 32000), help="B,T,V or S1/S2/S3 (4,512,32000)"
    )
    b.add_argument("--dtype", nargs="+", choices=["fp32", "bf16", "fp16"], default=["fp32"])
    b.add_argument("--mode", nargs="+", choices=["fwd", "fwdbwd"], default=["fwd", "fwdbwd"])
    b.add_argument(
        "--providers", nargs="+", default=None, help="default: seed, kl_div and every backend"
    )
    b.add_argument("--repeats", type=int, default=5, help="timed rounds (median reported)")
    b.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    b.add_argument(
        "--load", type=int, default=0, help="busy processes running meanwhile (default 0)"
    )
    b.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    b.add_argument(
        "--clock", choices=["wall", "thread"], default="wall",
        help="thread: this thread's CPU time (with --threads 1, on a machine shared with others)",
    )
    b.add_argument("--no-error", action="store_true", help="skip the float64 error check")
    b.add_argument("--csv", default=None, help="append the rows to this CSV file")
    b.add_argument("--markdown", default=None, help="append the table to this markdown file")
    b.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    b.set_defaults(func=_bench)
    from klpenalty.demo.runner import add_arguments as _demo_arguments

    demo = sub.add_parser(
        "demo",
        help="RLHF on a tiny language model with and without the KL penalty (about a minute); "
        "--distill: on-policy distillation of it",
        description="PPO on a tiny GPT whose reward counts 'helpful', for several KL "
        "coefficients in parallel; writes demo.png, report.md and metrics.json. --compare: "
        "every KL recipe under PPO and GRPO over a β grid. --distill: on-policy distillation "
        "of the tiny GPT into a smaller student, one run per recipe (sampled k1, vOPD, exact "
        "reverse, forward and JS divergences, SFT); writes distill.png, distill.md and "
        "distill.json.",
    )
    _demo_arguments(demo)
    demo.set_defaults(func=_demo)
    rep = sub.add_parser(
        "report",
        help="the exact KL of saved logits next to the k1, k2, k3 estimates of their tokens",
        description="Load FILE (torch.save of a dict with policy_logits (..., T, V), "
        "ref_logits (..., T, V), tokens (..., T) and optionally a bool mask (..., T)) and print "
        "klpenalty.kl_report: the exact KL per sequence next to the sampled estimators, their "
        "bias and spread, reference no-mass positions, and the positions with the most KL.",
    )
    rep.add_argument("file", metavar="FILE.pt", help="the torch.save'd dict of tensors")
    rep.add_argument("--top", type=int, default=5,
                     help="positions with the most KL to list, and vocabulary entries each (5)")
    rep.add_argument("--temperature", type=float, default=1.0,
                     help="sampling temperature, divides both models' logits (1)")
    rep.add_argument("--json", action="store_true", help="print the report as JSON")
    rep.set_defaults(func=_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
