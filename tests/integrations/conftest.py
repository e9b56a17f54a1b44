"""What ``make test`` collects here, and what only ``make test-integrations`` does.

The files below need packages that the core install does not have (the ``trl`` extra, peft
and DeepSpeed, and verl's and OpenRLHF's source installed without their dependencies). ``make
test-integrations`` installs them and sets ``KLPENALTY_INTEGRATIONS=1``, which collects these
files too; a missing package then fails the run instead of being skipped. ``make test`` leaves
them out (so it neither fails nor skips there) and runs the rest of this folder: the verl and
OpenRLHF wrappers against the stacks' documented formulas, and the shared exact-KL term.
"""

from __future__ import annotations

import os

NEEDS_EXTRAS = [
    "test_trl.py",
    "test_bench_trl_step.py",
    "test_bench_divergence_trl.py",
    "test_trl_torchrun.py",
    "test_trl_distillation.py",
    "trl_setup.py",
    "trl_torchrun_worker.py",
    "test_stack_sources.py",
    "test_wrapped.py",
]

collect_ignore = [] if os.environ.get("KLPENALTY_INTEGRATIONS") == "1" else NEEDS_EXTRAS
