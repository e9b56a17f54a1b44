// An inference engine's kept sets, ids[offsets[r]:offsets[r + 1]] for row r, against the rows'
// logits: the per-row rule of klpenalty.sampling.threshold_of_ids, shared by the op that
// answers it alone (support.cpp, native_support_from_ids) and the forward that applies it in
// its pass over each row (token_stats.cpp, native_token_stats given ids and offsets).
//
// Per row: tau, the smallest logit at the ids in the compute dtype (float32; float64 for
// float64 logits): +inf for an empty set, NaN when one of them is NaN; and whether the set is
// {v : x_v >= tau}. Every kept id passes that test (tau is their minimum), so the two sets are
// equal iff no id outside the set passes it: iff the largest logit outside the set is < tau
// (NaN logits outside pass nothing and are skipped; a NaN tau is never exact; a tau of -inf,
// which every other logit but NaN passes, is decided by a look at the marks).
//
// The ids are marked in a per-thread byte map of V bools (mark_ids: one independent store per
// id, so a duplicated id is marked once and a set {a, a} is never taken for {a, b}; a bitmap's
// read-modify-writes of one word made a chain through memory, 3x slower at 7.6k ids a row).
// The marks are then the row's keep mask: one vectorised pass over the row in memory order
// (scan_row) takes the minimum of the marked logits and the maximum of the others, or the
// forward's walk takes them as it goes (walk.h, SupLanes with KeptBounds). The logits are read
// in order whatever the order of the ids (engines list them in order of probability; reading x
// at the ids first was 4x slower for shuffled ids than for sorted ones), and the ids once;
// while the ids are marked, the row's cache lines are requested, so that the pass that follows
// finds (most of) the row in L2.
//
// ids and offsets: int32 or int64 each (IdSets reads either; other dtypes are a TypeError
// naming the argument). The offsets are checked before any read they guard (from 0 to K,
// non-decreasing), an id outside [0, V) is reported by the row (never a read out of bounds).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "rows.h"
#include "simd.h"

namespace klpenalty_native {
namespace {  // each source its own copies (internal linkage), inlined freely

// The first n elements of a row against their marks: (lo, hi) = the smallest marked logit
// (NaN if one is NaN, +inf if none is marked) and the largest unmarked logit that is not NaN
// (-inf if none). Several accumulators of each, so that the minima and maxima are not one
// chain; float64 rows elementwise.
template <typename T>
std::pair<Compute<T>, Compute<T>> scan_row(const T* row, int64_t V, const bool* marks) {
  using C = Compute<T>;
  constexpr C kInfC = std::numeric_limits<C>::infinity();
  C lo_s = kInfC, hi_s = -kInfC;
  int64_t j = 0;
  if constexpr (std::is_same_v<C, float>) {
    constexpr int kAcc = 4;
    const VF pos_inf(kInfC), neg_inf(-kInfC);
    VF lo[kAcc], hi[kAcc];
    LaneMask nan = lanes_empty();
    for (int a = 0; a < kAcc; ++a) lo[a] = pos_inf, hi[a] = neg_inf;
    for (; j + kAcc * VF::size() <= V; j += kAcc * VF::size()) {
      for (int a = 0; a < kAcc; ++a) {
        const int64_t i = j + a * VF::size();
        const VF x = load1(row + i);
        const LaneMask k = keep_lanes(marks + i);
        // clamp_max / clamp_min skip a NaN in x; a marked NaN is tracked apart
        lo[a] = at::vec::clamp_max(lo[a], select(k, x, pos_inf));
        hi[a] = at::vec::clamp_min(hi[a], select(k, neg_inf, x));
        nan = lanes_or(nan, lanes_and(k, lanes_nan(x)));
      }
    }
    float lanes_lo[VF::size()], lanes_hi[VF::size()];
    for (int a = 0; a < kAcc; ++a) {
      lo[a].store(lanes_lo);
      hi[a].store(lanes_hi);
      for (int k = 0; k < VF::size(); ++k) {
        lo_s = lanes_lo[k] < lo_s ? lanes_lo[k] : lo_s;
        hi_s = lanes_hi[k] > hi_s ? lanes_hi[k] : hi_s;
      }
    }
    if (!lanes_none(nan)) lo_s = std::numeric_limits<float>::quiet_NaN();
  }
  for (; j < V; ++j) {
    const C x = static_cast<C>(row[j]);
    if (marks[j]) {
      lo_s = min_nan(lo_s, x);
    } else if (x > hi_s) {
      hi_s = x;
    }
  }
  return {lo_s, hi_s};
}

// Marks ids[lo, hi) in the byte map of V bools (all false); false, and nothing marked, where
// an id lies outside [0, V). The ids' range is checked first, in one vectorised pass (their
// largest as unsigned), so that marking is a load and a store per id.
template <typename I>
bool mark_ids(const I* ids, int64_t lo, int64_t hi, int64_t V, bool* marks) {
  using U = std::make_unsigned_t<I>;
  U largest = 0;
  for (int64_t k = lo; k < hi; ++k) largest = std::max(largest, static_cast<U>(ids[k]));
  if (hi > lo && largest >= static_cast<U>(V)) return false;
#pragma GCC unroll 8
  for (int64_t k = lo; k < hi; ++k) marks[ids[k]] = true;
  return true;
}

// The rule for one row whose ids are marked (mark_ids): tau and exact from one scan of its V
// logits (see the top of this file). The marks are left as they are.
template <typename T>
void decide_marked(const T* row, int64_t V, const bool* marks, Compute<T>& tau, bool& exact) {
  using C = Compute<T>;
  const auto [smallest, largest_out] = scan_row(row, V, marks);
  tau = smallest;
  if (std::isnan(smallest)) {
    exact = false;  // nothing passes x >= NaN, while the set holds the NaN's id
  } else if (smallest > -std::numeric_limits<C>::infinity()) {
    exact = !(largest_out >= smallest);
  } else {
    // tau = -inf: every logit but NaN passes; exact iff every such logit is marked
    // (largest_out = -inf cannot tell "none" from "an unmarked -inf")
    bool all_marked = true;
    for (int64_t j = 0; j < V && all_marked; ++j) {
      all_marked = marks[j] || std::isnan(static_cast<C>(row[j]));
    }
    exact = all_marked;
  }
}

// The kept sets' (ids, offsets) checked against N rows: int32/int64 each, 1-D, N + 1 offsets
// from 0 to len(ids), non-decreasing (the bounds of every read of ids). Row r's ids are read
// through id(k), whichever their dtype.
struct IdSets {
  at::Tensor ids, offsets;  // contiguous
  const void* pi = nullptr;
  const void* po = nullptr;
  bool ids32 = false, offsets32 = false;
  bool given = false;  // (not pi: an empty ids tensor, every set empty, has no data)
  int64_t K = 0;

  IdSets() = default;
  IdSets(const at::Tensor& ids_in, const at::Tensor& offsets_in, int64_t N) {
    for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"ids", &ids_in},
                                  {"offsets", &offsets_in}}) {
      TORCH_CHECK_TYPE(t->scalar_type() == at::kLong || t->scalar_type() == at::kInt,
                       "support ", name, " must be int32 or int64, got ", describe(*t));
      TORCH_CHECK_VALUE(t->dim() == 1, "support ", name, " must be 1-D, got ", describe(*t));
    }
    K = ids_in.size(0);
    given = true;
    TORCH_CHECK_VALUE(offsets_in.size(0) == N + 1, "support offsets must have N + 1 = ", N + 1,
                      " entries (N = ", N, " positions), got ", describe(offsets_in));
    ids = ids_in.contiguous();
    offsets = offsets_in.contiguous();
    ids32 = ids.scalar_type() == at::kInt;
    offsets32 = offsets.scalar_type() == at::kInt;
    pi = ids.const_data_ptr();
    po = offsets.const_data_ptr();
    // the messages of klpenalty.ops.contract.check_compact_values
    TORCH_CHECK_VALUE(offset(0) == 0 && offset(N) == K,
                      "support offsets must start at 0 and end at len(ids) = ", K, ", got ",
                      offset(0), " and ", offset(N), " (", describe(offsets_in), ")");
    for (int64_t r = 0; r < N; ++r) {
      TORCH_CHECK_VALUE(offset(r) <= offset(r + 1), "support offsets must be non-decreasing (",
                        describe(offsets_in), ")");
    }
  }

  // Whether row r's ids lie in [0, V) (a row whose rule is not evaluated: masked, say).
  bool in_range(int64_t r, int64_t V) const {
    bool ok = true;
    for (int64_t k = offset(r), e = offset(r + 1); k < e; ++k) {
      const int64_t id = ids32 ? static_cast<const int32_t*>(pi)[k]
                               : static_cast<const int64_t*>(pi)[k];
      ok &= id >= 0 && id < V;
    }
    return ok;
  }

  // The error of an id outside [0, V) (klpenalty.ops.contract.check_compact_values's message).
  void fail_range(int64_t V) const {
    TORCH_CHECK_VALUE(false, "support ids must lie in [0, ", V, ") (", describe(ids), ")");
  }

  bool defined() const { return given; }
  int64_t offset(int64_t r) const {
    return offsets32 ? static_cast<const int32_t*>(po)[r] : static_cast<const int64_t*>(po)[r];
  }

  // Marks row r's ids in the byte map of V bools (all false); false (nothing marked) where an
  // id lies outside [0, V).
  bool mark(int64_t r, int64_t V, bool* marks) const {
    return ids32 ? mark_ids(static_cast<const int32_t*>(pi), offset(r), offset(r + 1), V, marks)
                 : mark_ids(static_cast<const int64_t*>(pi), offset(r), offset(r + 1), V, marks);
  }

  // Where row r's ids start (a walk requests them, and those after them, ahead of their use).
  const char* row_ids(int64_t r) const {
    return static_cast<const char*>(pi) + offset(r) * (ids32 ? 4 : 8);
  }

  // Row r's rule against its V logits (marks: V bools, all false, left all false): tau and
  // exact; false (tau NaN, not exact) where an id lies outside [0, V).
  template <typename T>
  bool row(int64_t r, const T* x, int64_t V, bool* marks, Compute<T>& tau, bool& exact) const {
    if (!mark(r, V, marks)) {
      tau = std::numeric_limits<Compute<T>>::quiet_NaN();
      exact = false;
      return false;
    }
    decide_marked(x, V, marks, tau, exact);
    std::fill(marks, marks + V, false);
    return true;
  }
};

// A byte map of V bools, all false, for this thread (the rule leaves it all false).
inline bool* ids_marks(int64_t V) {
  thread_local std::vector<uint8_t> marks;
  if (static_cast<int64_t>(marks.size()) < V) marks.assign(static_cast<size_t>(V), 0);
  return reinterpret_cast<bool*>(marks.data());
}

}  // namespace
}  // namespace klpenalty_native
