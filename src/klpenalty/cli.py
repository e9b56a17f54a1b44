"""Command line: ``klpenalty env | demo``."""

from __future__ import annotations

import argparse
import platform
import sys

__all__ = ["main"]


def _env(_: argparse.Namespace) -> int:
    import torch

    import klpenalty
    from klpenalty.ops.dispatch import available_backends

    print(f"klpenalty {klpenalty.__version__}")
    print(f"python    {platform.python_version()} ({platform.machine()})")
    print(f"torch     {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"cuda      {torch.cuda.is_available()}")
    print(f"backends  {', '.join(available_backends())}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from klpenalty.demo.runner import run_demo

    return run_demo(args, argv=getattr(args, "argv", None))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="klpenalty", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="print versions and available backends")
    env.set_defaults(func=_env)
    from klpenalty.demo.runner import add_arguments as _demo_arguments

    demo = sub.add_parser(
        "demo",
        help="RLHF on a tiny language model with and without the KL penalty (about a minute)",
        description="PPO on a tiny GPT whose reward counts 'helpful', for several KL "
        "coefficients in parallel; writes demo.png, report.md and metrics.json.",
    )
    _demo_arguments(demo)
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
