"""The Triton kernels' machine code for an H100/H200 (sm_90), read without a GPU.

``benchmarks/triton_sass.py`` records the launches the host code makes (V = 128256, one program
per row), compiles each with the kernel's own JIT binder for sm_90 (the specialisation a GPU run
gets: 16-byte-aligned pointers, ``tt.divisibility = 16`` on ints ≡ 0 mod 16) and disassembles it
with the ``cuobjdump`` that ships with Triton. One subprocess per session (the kernels here are
imported in interpreter mode); Triton's cache makes a rerun quick.

What is asserted, for the forward and the backward, bf16 and fp32, the KL alone and all four
statistics: the column loop (the range of a backward branch) reads with 128-bit vector loads
only, holds no barrier and no shuffle (every reduction in it stays inside a thread) and so no
load after one; no kernel uses local memory; the forward's loop stays within an instruction
budget per element pair, which sets how close to the memory floor an H200 can run it
(benchmarks/README.md); the sampler's threshold kernel (top-k + top-p + min-p before a KL)
keeps its column loops free of cross-thread reductions and within their budgets, its split
scan reads with 128-bit loads and histograms in shared memory within its budget; the
divergences' kernels (the JSD, the skew forward KL, the TVD) read and write as the statistics'
do and stay within their budgets.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton", reason="Triton is not installed: pip install 'klpenalty[triton]'")
import torch  # noqa: E402

from klpenalty.ops.triton._load import _kernels  # noqa: E402
from klpenalty.ops.triton.threshold import digits  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "triton_sass.py")
NVBIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")

# Instructions per element pair in the forward's loop: what the kernels reach (Triton 3.6 and
# 3.9, see benchmarks/README.md) plus a little room; an H200 streams bf16 at 4.1 pairs/clock/SM
# against 128 thread-instructions/clock/SM, so ~31 per pair is the most that can keep up.
FORWARD_BUDGET = {("kl", "bf16"): 23.0, ("all four", "bf16"): 26.0,
                  ("kl", "fp32"): 21.0, ("all four", "fp32"): 24.0}


@pytest.fixture(scope="session")
def compiled():
    if not os.access(os.path.join(NVBIN, "ptxas"), os.X_OK):
        pytest.skip(f"this Triton ships no ptxas in {NVBIN}: nothing can compile for sm_90")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.join(ROOT, "src"), ROOT,
                                                      env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, SCRIPT, "--json"], capture_output=True, text=True,
                          env=env, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert results[-1]["triton"] == triton.__version__  # the subprocess compiled with this Triton
    return [r for r in results if "kernel" in r]


def test_the_triton_asked_for():
    """`make test-triton-3.6` sets KLPENALTY_EXPECT_TRITON: the run must import that Triton."""
    want = os.environ.get("KLPENALTY_EXPECT_TRITON")
    if want:
        assert triton.__version__ == want, (triton.__version__, triton.__file__)


def _launches(compiled, kernel):
    found = [r for r in compiled if r["kernel"] == kernel]
    assert found, f"no {kernel} launch recorded"
    return found


def test_every_case_launches_both_kernels_with_the_gpu_specialisation(compiled):
    """The recorded launches are the real ones: aligned pointers, divisible row strides and V."""
    padded = [r for r in compiled if r["vocab"] % 16]
    assert padded and all(r["stride"] % 16 == 0 for r in padded)
    for r in compiled:
        if r["kernel"] == "threshold_select_kernel":  # top-k's selects read histograms only
            assert r["signature"]["hist_ptr"] == "*i32", r["signature"]
        elif r["kernel"] in ("threshold_band_kernel", "threshold_list_kernel"):  # and these
            assert r["signature"]["cstate_ptr"] == "*i32", r["signature"]  # the row's counts
        else:
            assert r["signature"]["x_ptr"] in ("*bf16", "*fp32"), r["signature"]
        attrs = " ".join(r["attrs"].values())
        assert "tt.divisibility" in attrs and "16" in attrs, r["attrs"]
    cases = {(r["case"], r["dtype"], r["kernel"]) for r in compiled}
    for case, dtype in FORWARD_BUDGET:
        assert (case, dtype, "stats_kernel") in cases and (case, dtype, "grad_kernel") in cases


def test_no_local_memory(compiled):
    for r in compiled:
        assert r["local"] == 0 and r["resources"].get("LOCAL", 0) == 0, (r["kernel"], r["case"])
        assert r["resources"].get("STACK", 0) == 0, (r["kernel"], r["case"], r["resources"])


@pytest.mark.parametrize("kernel", ["stats_kernel", "grad_kernel", "divergence_kernel",
                                    "divergence_grad_kernel"])
def test_the_column_loop_reads_16_bytes_a_load_without_barriers(kernel, compiled):
    for r in _launches(compiled, kernel):
        loop, name = r["loop"], (r["case"], r["dtype"])
        assert loop is not None, f"no column loop found in {kernel} {name}"
        if r["support"] is None:  # x and y only: every load a 128-bit one
            assert loop["ldg"] == loop["ldg128"] > 0, (name, loop)
            # each thread reads its columns of x and y once an iteration: 16 bytes a load
            width = 2 if r["dtype"] == "bf16" else 4
            assert loop["ldg128"] == 2 * loop["elems_per_thread"] * width // 16, (name, loop)
        else:  # the keep mask (uint8) comes in 8-byte loads of the same columns
            assert loop["ldg128"] == 4 and loop["ldg"] == 6, (name, loop)
        if r["vocab"] % 16 and kernel.endswith("grad_kernel"):
            # the gradients are (N, V) contiguous: rows of V ≢ 0 mod 16 are not 16-byte
            # aligned, so the stores go element by element (re-laid out through shared memory)
            continue
        assert loop["bar"] == 0 and loop["ldg_after_bar"] == 0, (name, loop)
        assert loop["shfl"] == 0, (name, loop)
        if kernel.endswith("grad_kernel"):  # the gradients written with 128-bit stores as well
            assert loop["stg"] == loop["stg128"] > 0, (name, loop)


def test_forward_instructions_per_element_pair(compiled):
    for r in _launches(compiled, "stats_kernel"):
        key = (r["case"], r["dtype"])
        if key in FORWARD_BUDGET:
            assert r["loop"]["per_pair"] <= FORWARD_BUDGET[key], (key, r["loop"])


# Instructions per element of the row's threshold kernel's column loops, in its order: the
# k-th's tie group (the read of ``_group_floor``, where the float below the k-th has its x/T),
# the Z read, top-p's search with float32 masses, the float64 check of its answer, the float64
# search (where the check fails), the last kept logit's tie group: Triton 3.9, plus a little
# room.
THRESHOLD_BUDGET = (26.0, 95.0, 150.0, 105.0, 260.0, 26.0)
# 16-bit logits add a loop over the window of keys (chunks of 512, 256 under Triton 3.6,
# reading the window's histograms, not the row; reductions across threads there): Z, τ_m and
# each chunk's mass from the window before the Z read (top-p's answer reads one chunk again
# after it, no loop). Instructions a key (112-126 under Triton 3.9, 147-180 under 3.6).
WINDOW_BUDGET = 190.0
# The split scan's column loop (one read of the row), by (pass 0, the window of keys counted):
# pass 0 with top-k's first histogram (or alone); a later digit's histogram, alone (fp32) and
# with top-p's window of keys (bf16: two histograms in the read); top-p alone's window of keys
# with Z's float64 exponentials below it (ZSUM). Triton 3.9, plus a little room (fp32's 11-bit
# digits, 2048 bins: 26.1 in pass 0, 18.6-20.8 after it).
SCAN_BUDGET = {(True, False): 28.0, (False, False): 22.0, (False, True): 33.0,
               (True, True): 72.0}
# Triton 3.6 lowers ``tl.histogram`` per warp: each iteration adds the warp's
# counts of every bin to shared memory, so top-k's digits are of 7 bits there (128 bins: 62-67
# instructions an element, ~3× 3.9's) and the window holds 512 keys (137-159 instructions an
# element, 2-5× 3.9's with 2048; benchmarks/README.md states what that predicts)
if _kernels().RADIX_DIGIT < 8:
    SCAN_BUDGET = {(True, False): 72.0, (False, False): 68.0, (False, True): 150.0,
                   (True, True): 170.0}


def test_the_threshold_kernel_loops(compiled):
    """The sampler's threshold kernel (launched before the forward where the settings cut):
    its column loops reduce nothing across threads (no barrier, no shuffle inside) and stay
    within their instruction budgets per element; on bf16 its loop over the window of keys
    within its budget per key; top-p alone on bf16 (Z from the window's scan) has no Z
    read."""
    found = _launches(compiled, "threshold_kernel")
    assert {r["dtype"] for r in found} == {"bf16", "fp32"}
    assert any(r["constexprs"]["ZSUM"] for r in found)
    for r in found:
        loops, c = r["inner_loops"], r["constexprs"]
        # the loops the flags compile, as indices of THRESHOLD_BUDGET (TOP_P in every case)
        # (no Z read where top-p's band gives Z and τ_m: CAND 2)
        z_given = (c["ZSUM"] and not c["MIN_P"]) or c["CAND"] == 2
        want = ([0] if c["TOP_K"] else []) + ([] if z_given else [1])
        want += [2, 3, 4, 5]
        if c["WINDOW"]:
            assert r["dtype"] == "bf16" and len(loops) == len(want) + 1, loops
            window = loops.pop(1 if c["TOP_K"] else 0)  # after the k-th's tie group
            keys = window["elems_per_thread"] * 2 / 4  # an int32 count a key, bf16 elements
            assert window["instructions"] / keys <= WINDOW_BUDGET, window
        assert len(loops) == len(want), (r["dtype"], c, loops)
        for lp, i in zip(loops, want):
            assert lp["bar"] == 0 and lp["shfl"] == 0, (r["dtype"], lp)
            assert lp["per_elem"] <= THRESHOLD_BUDGET[i], (r["dtype"], lp, THRESHOLD_BUDGET[i])


def test_the_threshold_scan_reads_16_bytes_a_load_and_histograms_in_shared_memory(compiled):
    """The split scan (pass 0 and top-k's digits: 2 reads of a bf16 row, the second counting
    top-p's window of keys too, 3 of an fp32 one with its 11-bit digits; 3 and 5 with the
    7-bit digits of Triton before 3.9; top-p alone on bf16: pass 0, then the window
    with Z's sums below it): one column loop of 128-bit loads, its histograms by shared-memory
    atomics (ATOMS, no shuffle), within its instruction budget per element."""
    found = _launches(compiled, "threshold_scan_kernel")
    passes = {(case, dt): [r for r in found if (r["case"], r["dtype"]) == (case, dt)]
              for case in ("kl, top-k+top-p+min-p", "kl, top-p") for dt in ("bf16", "fp32")}
    digit = _kernels().RADIX_DIGIT  # (by the Triton version: 7 bits before 3.9)
    assert len(passes["kl, top-k+top-p+min-p", "bf16"]) == len(digits(torch.bfloat16, digit))
    assert len(passes["kl, top-k+top-p+min-p", "fp32"]) == len(digits(torch.float32, digit))
    assert [r["constexprs"]["ZSUM"] for r in passes["kl, top-p", "bf16"]] == [False, True]
    for r in found:
        (lp,) = r["inner_loops"]
        first = (r["constexprs"]["PASS"] == 0, r["constexprs"]["WINDOW"])
        assert r["loop"]["ldg"] == r["loop"]["ldg128"] > 0, (r["dtype"], r["loop"])
        counts = r["constexprs"]["HIST"] or r["constexprs"]["WINDOW"]
        assert r["loop"]["shfl"] == 0, (r["dtype"], r["loop"])
        assert (r["loop"]["atoms"] > 0) == counts, (r["dtype"], r["loop"])
        assert lp["per_elem"] <= SCAN_BUDGET[first], (r["dtype"], first, lp)


# fp32 top-p's candidate list (threshold_cand_kernel), instructions per element of its column
# loop by MODE: the band's count (a 4096-bin histogram, the float32 Z), its second count, the
# band's read (float64 masses, the list's atomic adds), top-k's set listed: Triton 3.9 plus a
# little room; 3.6 lowers the histograms per warp, with 512 bins there (118-128 instructions an
# element; benchmarks/README.md)
CAND_BUDGET = {1: 33.0, 4: 45.0, 2: 84.0, 3: 31.0}
if _kernels().BAND_BINS < 4096:
    CAND_BUDGET = {1: 125.0, 4: 135.0, 2: 84.0, 3: 31.0}


def test_the_candidate_list_reads_16_bytes_a_load_within_budget(compiled):
    """fp32 top-p (the band: counted, counted again, read; after top-k: top-k's set read, bf16's
    too under Triton before 3.9): one column loop of 128-bit loads a launch, within its
    instruction budget per element; the list's program (threshold_list_kernel) reads no
    column: its one loop, the bisection's step, loads nothing and stays under 100
    instructions."""
    found = _launches(compiled, "threshold_cand_kernel")
    modes = {(r["case"], r["constexprs"]["MODE"]) for r in found}
    assert modes == {("kl, top-p", 1), ("kl, top-p", 4), ("kl, top-p", 2),
                     ("kl, top-k+top-p+min-p", 3)}, modes
    for r in found:
        (lp,) = r["inner_loops"]
        assert r["loop"]["ldg"] == r["loop"]["ldg128"] > 0, (r["constexprs"], r["loop"])
        assert lp["per_elem"] <= CAND_BUDGET[r["constexprs"]["MODE"]], (r["constexprs"], lp)
    for r in _launches(compiled, "threshold_list_kernel"):
        assert r["inner_loops"] == [] and len(r["loop_sizes"]) == 1, r["loop_sizes"]
        assert r["loop_sizes"][0] < 100, r["loop_sizes"]


# Instructions per element pair in the divergences' loops, (forward, backward): what the kernels
# reach (Triton 3.6 and 3.9) plus a little room. Their terms take transcendentals: a mixture's
# log-ratio one exponential, one logarithm and one division an entry (the JSD and the skew
# forward KL two of them), so these kernels are bound by their arithmetic, not by memory.
DIVERGENCE_BUDGET = {("jsd", "bf16"): (170.0, 95.0), ("jsd", "fp32"): (166.0, 93.0),
                     ("skew forward kl", "bf16"): (165.0, 104.0), ("tvd", "bf16"): (30.0, 35.0)}


def test_the_divergence_kernels_instructions_per_element_pair(compiled):
    """The second walk's forward and backward loops (one program per row) within their
    budgets, for each kind recorded."""
    kernels = ("divergence_kernel", "divergence_grad_kernel")
    found = {(r["case"], r["dtype"], r["kernel"]): r for r in compiled if r["kernel"] in kernels}
    for (case, dtype), budgets in DIVERGENCE_BUDGET.items():
        for kernel, budget in zip(kernels, budgets):
            r = found[(case, dtype, kernel)]
            assert r["loop"]["per_pair"] <= budget, (case, dtype, kernel, r["loop"])
