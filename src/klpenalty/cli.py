"""Command line: ``klpenalty env``."""

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="klpenalty", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="print versions and available backends")
    env.set_defaults(func=_env)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
