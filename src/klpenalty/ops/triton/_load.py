"""The Triton kernels, imported at the first use: Triton is an optional dependency, so this
package imports without it. The host modules take the kernels from :func:`_kernels`; the
package says from :func:`available` and :func:`interpreted` whether and how they run here."""

from __future__ import annotations

import os
import types

from .. import contract

__all__ = ["available", "interpreted"]

_jit = None  # the kernels, once imported (a namespace: see _kernels)
_error: str | None = None  # None = not tried, "" = imported, else why not


def _kernels():
    """The kernels, imported at the first call (imports Triton; raises ImportError where it is
    missing): one namespace of the names the kernel modules export, ``stats_kernel``,
    ``merge_kernel``, ``grad_kernel``, ``threshold_scan_kernel``, ``threshold_select_kernel``,
    ``threshold_kernel``, ``divergence_kernel``,
    ``divergence_merge_kernel``, ``divergence_grad_kernel`` and ``INTERPRETED``."""
    global _jit
    if _jit is None:
        from . import _kernels_common, _kernels_divergence, _kernels_stats, _kernels_threshold

        modules = (_kernels_common, _kernels_stats, _kernels_threshold, _kernels_divergence)
        _jit = types.SimpleNamespace(
            **{name: getattr(module, name) for module in modules for name in module.__all__}
        )
    return _jit


@contract.constant_result
def available() -> bool:
    """Whether Triton imports (tried once per process)."""
    global _error
    if _error is None:
        try:
            _kernels()
            _error = ""
        except Exception as exc:  # any failure to import means the portable path
            _error = f"{type(exc).__name__}: {exc}"[:300]
    return not _error


def interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` when they were
    first imported in this process; then they run on CPU tensors)."""
    if _jit is None:
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
    return bool(_jit.INTERPRETED)
