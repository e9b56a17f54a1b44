"""Native CPU backend: the engine's per-row state in one fused C++ pass per row.

The C++ extension (``csrc/``, one source per op, headers by concern; docs/native.md) implements
the four ops of :mod:`..contract` (``klpenalty::native_token_stats``, ``_backward``, ``_state``
and ``native_sampling_threshold``; the schemas, fakes and autograd are the contract's): the KL,
the token log-probs under both models and the entropy, of the policy truncated to a support or
not, in one read of each row, with the top-k / top-p / min-p threshold of each row computed in
the same per-row pass (just before its walk) where the sampler settings cut, and the threshold
alone. It computes the same per-row state, merge and finalize as :mod:`..engine` (an L1-sized
chunk at a time: its maxima, then the exps and sums) with one row walker specialised on what is
wanted, in float32 vectors (``at::vec::Vectorized``) with a polynomial exp2 (float64 inputs in
double), reads bf16/fp16 directly, and uses one ``at::parallel_for`` over rows per call.

``klpenalty::native_support_from_ids`` (``csrc/support.cpp``) is the contract's kept-set
check of :func:`klpenalty.sampling.threshold_of_ids`, one pass over each row's logits and ids
(``csrc/ids.h``, which the forward given ``ids``/``offsets`` applies in its visit of each row);
``klpenalty::native_divergence`` and its backward (``csrc/divergence.cpp``) are the second walk
of :mod:`..divergence`: one vectorised pass per row over both logits from the forward's
statistics, rows with −inf or NaN entries redone by a careful scalar path. One op
is not part of the contract (schema below): ``klpenalty::native_compute_floor``
(``csrc/compute_floor.cpp``), the benchmark's (:func:`compute_floor`).

**Build.** At the first use in a process (never at ``pip install``), with
``torch.utils.cpp_extension.load`` and ninja, into ``<root>/<name>`` where ``<root>`` is torch's
extension directory (``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) and
``<name>`` holds the instruction set, the Python and torch versions and a hash of the flags and
of every file of ``csrc/`` (sources and headers): a later process (or another machine sharing
the home directory with a different CPU) finds its own build and loads it in milliseconds. The
instruction set is torch's own choice for this CPU (``torch.backends.cpu.get_cpu_capability()``:
AVX512, AVX2, else the portable DEFAULT, e.g. on Arm), passed as explicit flags, never
``-march=native``. One line goes to stderr while compiling.

**Fallback.** No compiler, no ninja, a failed build, an unsupported platform: :func:`available`
is False, one ``RuntimeWarning`` says why and how to get the fast path, and the backend registry
(:mod:`..dispatch`) runs the streaming backend instead. ``klpenalty env`` shows the active path.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import Tensor

from .. import contract

__all__ = [
    "available",
    "status",
    "build_dir",
    "build_name",
    "isa",
    "CSRC",
    "sources",
    "build_units",
    "csrc_files",
    "COMPUTE_FLOOR_TILE",
    "compute_floor",
]

# The extension's C++ folder: one source per op (or per op family) and the headers they share.
CSRC = Path(__file__).with_name("csrc")


def sources() -> list[Path]:
    """The C++ sources compiled into the one extension: every ``.cpp`` file of :data:`CSRC`."""
    return sorted(CSRC.glob("*.cpp"))


# The sources are compiled as this many translation units (each includes some of them, the
# largest first into the lightest unit): every unit parses the ATen headers once (~15 s of
# compiler time each), and ninja builds the units in parallel.
BUILD_UNITS = 2


def build_units(directory: Path) -> list[Path]:
    """The translation units of the build, written into its ``directory``: ``unit<i>.cpp``
    including :func:`sources` by path, :data:`BUILD_UNITS` of them (fewer for fewer sources),
    balanced by the sources' sizes."""
    groups: list[list[Path]] = [[] for _ in range(min(BUILD_UNITS, len(sources())))]
    weight = [0] * len(groups)
    for source in sorted(sources(), key=lambda p: (-p.stat().st_size, p.name)):
        i = weight.index(min(weight))
        groups[i].append(source)
        weight[i] += source.stat().st_size
    units = []
    for i, group in enumerate(groups):
        unit = directory / f"unit{i}.cpp"
        text = "".join(f'#include "{source}"\n' for source in sorted(group))
        if not unit.exists() or unit.read_text() != text:
            unit.write_text(text)
        units.append(unit)
    return units


def csrc_files() -> list[Path]:
    """Every file of :data:`CSRC`, sources and headers: what :func:`build_name` hashes."""
    return sorted(path for path in CSRC.iterdir() if path.is_file())


contract.define_ops("native")  # the schemas; the C++ library registers the CPU kernels

# The benchmark op (not part of the contract): the kernel's inner loop over an L1-resident tile.
_BENCH_LIB = torch.library.Library("klpenalty", "FRAGMENT")  # noqa: TOR901
_BENCH_LIB.define("native_compute_floor(Tensor x, Tensor y, int pairs, int chains) -> float")

# Elements per input of the tile that :func:`compute_floor` walks: the kernel's chunk (kChunk).
COMPUTE_FLOOR_TILE = 2048

# A build lock older than this is left over from a killed build: ``cpp_extension.load`` would
# wait on it forever.
STALE_LOCK_SECONDS = 600

# Without the two CPU_CAPABILITY defines Vectorized<float> silently becomes the scalar generic
# version; without -fopenmp (compile and link) at::parallel_for silently runs serially.
_ISA_FLAGS = {
    "AVX512": (
        "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
        "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512",
    ),
    "AVX2": ("-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"),
    "DEFAULT": ("-DCPU_CAPABILITY=DEFAULT", "-DCPU_CAPABILITY_DEFAULT"),
}
_COMMON_FLAGS = ("-O3", "-fopenmp")
_LDFLAGS = ("-fopenmp",)

FAST_PATH_HINT = (
    "For the fast path, install a C++ compiler (g++ or clang++; or point $CXX at one) and ninja "
    "(`pip install ninja`), then start a new process; `klpenalty env` shows the active path"
)

# Process-wide load state: None = not tried yet, "" = loaded, else the reason it is unavailable.
_error: str | None = None
_warned = False


def isa() -> str:
    """The instruction set the kernel is built for: torch's choice for this CPU (AVX512 or
    AVX2 on x86-64 with them), else DEFAULT (portable code, e.g. Arm NEON)."""
    cap = torch.backends.cpu.get_cpu_capability()
    if platform.machine().lower() in ("x86_64", "amd64") and cap in ("AVX512", "AVX2"):
        return cap
    return "DEFAULT"


def _flags(instruction_set: str) -> list[str]:
    return [*_COMMON_FLAGS, *_ISA_FLAGS[instruction_set]]


def build_name(instruction_set: str | None = None) -> str:
    """Extension name: ISA, Python and torch versions, and a hash of the flags and of every file
    of :data:`CSRC` (its name and bytes: a changed header rebuilds too)."""
    instruction_set = instruction_set or isa()
    digest = hashlib.sha256()
    for path in csrc_files():
        data = path.read_bytes()
        digest.update(f"{path.name}\0{len(data)}\0".encode())
        digest.update(data)
    digest.update("\0".join([*_flags(instruction_set), *_LDFLAGS]).encode())
    digest.update(torch.__version__.encode())
    tv = "".join(ch if ch.isalnum() else "_" for ch in torch.__version__)
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return f"klpenalty_native_{instruction_set.lower()}_{py}_torch{tv}_{digest.hexdigest()[:12]}"


def build_dir(instruction_set: str | None = None) -> Path:
    """Where the extension is built and cached: torch's extension root (``$TORCH_EXTENSIONS_DIR``,
    default ``~/.cache/torch_extensions``) / :func:`build_name`."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return Path(root) / build_name(instruction_set)


def _library(directory: Path) -> Path:
    return directory / f"{directory.name}.so"


def _remove_stale_lock(directory: Path) -> None:
    lock = directory / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
            lock.unlink()
    except FileNotFoundError:
        pass


def _ninja_on_path() -> None:
    """cpp_extension runs ``ninja`` from PATH; pip's ninja lives in the environment's scripts
    directory, which is not on PATH unless the environment is activated."""
    try:
        import ninja  # type: ignore[import-not-found]
    except ImportError:
        if shutil.which("ninja") is None:
            raise RuntimeError("ninja is not installed") from None
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + (os.pathsep + path if path else "")


def _compile(directory: Path, instruction_set: str) -> None:
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler: {cxx!r} not found")
    _ninja_on_path()
    directory.mkdir(parents=True, exist_ok=True)
    _remove_stale_lock(directory)
    print(
        f"klpenalty: compiling the native CPU kernel ({instruction_set}) into {directory}, "
        "once per machine and torch version...",
        file=sys.stderr,
        flush=True,
    )
    try:
        cpp_extension.load(
            name=directory.name,
            sources=[str(unit) for unit in build_units(directory)],
            extra_cflags=_flags(instruction_set),
            extra_ldflags=list(_LDFLAGS),  # load() appends to the lists it is given
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )
    except RuntimeError as exc:  # the compiler's output: keep it, report its first error
        log = directory / "build.log"
        log.write_text(str(exc))
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()] or ["no output"]
        errors = [ln for ln in lines[1:] if "error:" in ln.lower()]  # compiler diagnostics
        first = errors[0] if errors else lines[0]
        raise RuntimeError(f"the build failed: {first[:300]}; full log in {log}") from None


def _load() -> None:
    """Build (if not cached) and load the extension, and register its autograd; raises on failure."""
    if platform.system() not in ("Linux", "Darwin"):
        raise RuntimeError(f"unsupported platform {platform.system()}")
    instruction_set = isa()
    directory = build_dir(instruction_set)
    library = _library(directory)
    if library.exists():
        torch.ops.load_library(str(library))
    else:
        _compile(directory, instruction_set)  # also loads it


def _reason(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return (lines[0] if lines else type(exc).__name__)[:500]


@contract.constant_result
def available() -> bool:
    """Whether the native kernel is loaded, building it at the first call of the process.

    On failure warns once (why, and how to get the fast path) and returns False. Under
    ``torch.compile`` the answer is a constant of the trace.
    """
    global _error, _warned
    if _error is None:
        try:
            _load()
            _error = ""
        except Exception as exc:  # any failure means the portable path, never a crash
            _error = _reason(exc)
    if _error and not _warned:
        _warned = True
        warnings.warn(
            f"klpenalty: the native CPU kernel is unavailable ({_error}); CPU tensors use the "
            f"portable 'streaming' backend, 3-10x slower. {FAST_PATH_HINT}",
            RuntimeWarning,
            stacklevel=2,
        )
    return not _error


def compute_floor(x: Tensor, y: Tensor, pairs: int, chains: int) -> float:
    """The forward's arithmetic without its memory traffic, for ``klpenalty bench``.

    Runs the kernel's one-pass chunk loop of the KL (two exps, three sums and both maxima per
    element pair, ``chains`` float vectors per input in flight: 1, 2, 4 or 8) over the
    L1-resident tile ``x``, ``y`` (1-D, contiguous, float32/bfloat16/float16, best
    :data:`COMPUTE_FLOOR_TILE` elements) until ``pairs`` element pairs are done; the time of a
    call is the least a forward over ``pairs`` element pairs spends computing. Returns a checksum
    of the sums. Raises RuntimeError if the kernel is unavailable.
    """
    if not available():
        raise RuntimeError(f"the native CPU kernel is unavailable ({_error})")
    return torch.ops.klpenalty.native_compute_floor(x, y, int(pairs), int(chains))


def status() -> str:
    """One line for ``klpenalty env``: the active CPU path and the build cache."""
    ok = available()
    where = build_dir()
    if ok:
        return f"native ({isa()}), cache {where}"
    return f"streaming (native unavailable: {_error}), cache {where}"

