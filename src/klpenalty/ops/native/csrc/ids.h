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
// which every other logit but NaN passes, is decided by a second look at the row). The ids are
// marked in a per-thread bitmap of V bits (a duplicated id is marked once: a set {a, a} is
// never taken for {a, b}), then one vectorised pass over the row, in memory order, takes the
// minimum of the marked logits and the maximum of the others, the bitmap's words giving the
// lanes' masks (AVX512: the mask registers themselves), and clears the bitmap. The logits are
// read once and in order whatever the order of the ids (engines list them in order of
// probability; reading x at the ids first was 4x slower for shuffled ids than for sorted ones),
// and the ids once; while the ids are marked, the row's cache lines are requested, so that the
// pass finds (most of) the row in L2 and leaves it there for a walk that follows.
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

// The integer lanes of the size of C, and their bits 1, 2, 4, ...: lane k of a mask is set
// iff bit k of a W-bit word is.
template <typename C>
using LaneInt = std::conditional_t<std::is_same_v<C, double>, int64_t, int32_t>;

template <typename C>
at::vec::Vectorized<LaneInt<C>> lane_bits() {
  using VI = at::vec::Vectorized<LaneInt<C>>;
  static_assert(VI::size() == at::vec::Vectorized<C>::size() && 64 % VI::size() == 0);
  LaneInt<C> b[VI::size()];
  for (int k = 0; k < VI::size(); ++k) b[k] = LaneInt<C>(1) << k;
  return VI::loadu(b);
}

// All-ones lanes where ``word``'s bits (the low W) are set.
template <typename C>
inline at::vec::Vectorized<C> lane_mask(uint64_t word,
                                        const at::vec::Vectorized<LaneInt<C>>& bits) {
  using VI = at::vec::Vectorized<LaneInt<C>>;
  const VI w(static_cast<LaneInt<C>>(word));
  return at::vec::cast<C>((w & bits) == bits);
}

// The first 64·words elements of a row against their bits in the bitmap: (lo, hi) = the
// smallest marked logit (NaN if one is NaN, +inf if none is marked) and the largest unmarked
// logit that is not NaN (-inf if none). Clears the bitmap's words as it goes. Several
// accumulators of each, so that the minima and maxima are not one chain.
template <typename T>
std::pair<Compute<T>, Compute<T>> scan_words(const T* row, int64_t words, uint64_t* bitmap) {
  using C = Compute<T>;
  constexpr C kInf = std::numeric_limits<C>::infinity();
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<C, float>) {
    // the word's bits are the lanes' masks: a masked min of the marked lanes, a masked max of
    // the others (_mm512_m*_ps(x, acc) returns acc where x is NaN: NaN is skipped by both, and
    // a marked NaN is tracked apart)
    __m512 lo[4], hi[4];
    for (int a = 0; a < 4; ++a) {
      lo[a] = _mm512_set1_ps(kInf);
      hi[a] = _mm512_set1_ps(-kInf);
    }
    __mmask16 nan = 0;
    for (int64_t w = 0; w < words; ++w) {
      const uint64_t word = std::exchange(bitmap[w], 0);
      const T* p = row + 64 * w;
      for (int q = 0; q < 4; ++q) {
        const __m512 x = load1(p + 16 * q);
        const __mmask16 k = static_cast<__mmask16>(word >> (16 * q));
        lo[q] = _mm512_mask_min_ps(lo[q], k, x, lo[q]);
        hi[q] = _mm512_mask_max_ps(hi[q], static_cast<__mmask16>(~k), x, hi[q]);
        nan |= _mm512_mask_cmp_ps_mask(k, x, x, _CMP_UNORD_Q);
      }
    }
    const float lo_s = _mm512_reduce_min_ps(
        _mm512_min_ps(_mm512_min_ps(lo[0], lo[1]), _mm512_min_ps(lo[2], lo[3])));
    const float hi_s = _mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_max_ps(hi[0], hi[1]), _mm512_max_ps(hi[2], hi[3])));
    return {nan ? std::numeric_limits<float>::quiet_NaN() : lo_s, hi_s};
  }
#endif
  using Vec = at::vec::Vectorized<C>;
  constexpr int W = Vec::size();
  constexpr int kAcc = 64 / W < 4 ? 64 / W : 4;
  const auto bits = lane_bits<C>();
  const Vec pos_inf(kInf), neg_inf(-kInf);
  const uint64_t low = W == 64 ? ~uint64_t{0} : (uint64_t{1} << W) - 1;
  Vec lo[kAcc], hi[kAcc];
  for (int a = 0; a < kAcc; ++a) {
    lo[a] = pos_inf;
    hi[a] = neg_inf;
  }
  for (int64_t w = 0; w < words; ++w) {
    const uint64_t word = std::exchange(bitmap[w], 0);
    const T* p = row + 64 * w;
    for (int q = 0; q < 64 / W; ++q) {
      const Vec x = load1(p + q * W);
      const Vec marked = lane_mask<C>((word >> (q * W)) & low, bits);
      const int a = q % kAcc;
      lo[a] = at::vec::minimum(lo[a], Vec::blendv(pos_inf, x, marked));  // NaN propagates
      hi[a] = at::vec::maximum(hi[a], Vec::blendv(x, neg_inf, marked | x.isnan()));
    }
  }
  C lanes_lo[W], lanes_hi[W];
  C lo_s = kInf, hi_s = -kInf;
  for (int a = 0; a < kAcc; ++a) {
    lo[a].store(lanes_lo);
    hi[a].store(lanes_hi);
    for (int k = 0; k < W; ++k) {
      lo_s = min_nan(lo_s, lanes_lo[k]);
      hi_s = lanes_hi[k] > hi_s ? lanes_hi[k] : hi_s;
    }
  }
  return {lo_s, hi_s};
}

// scan_words over a whole row (V elements), its last partial word elementwise.
template <typename T>
std::pair<Compute<T>, Compute<T>> scan_row(const T* row, int64_t V, uint64_t* bitmap) {
  using C = Compute<T>;
  const int64_t words = V / 64;
  auto [lo, hi] = scan_words(row, words, bitmap);
  if (words * 64 < V) {
    const uint64_t word = std::exchange(bitmap[words], 0);
    for (int64_t j = words * 64; j < V; ++j) {
      const C x = static_cast<C>(row[j]);
      if ((word >> (j - words * 64)) & 1) {
        lo = min_nan(lo, x);
      } else if (x > hi) {
        hi = x;
      }
    }
  }
  return {lo, hi};
}


// Marks ids[lo, hi) in the bitmap; false (the bitmap cleared) on an id outside [0, V).
// Meanwhile the row's cache lines are requested (one every 4 ids), so that memory works while
// the ids are marked and the scan finds (most of) the row in L2: 15-20% faster at 7.5k ids
// per row. The bits of one word are gathered in a register while consecutive ids fall in it
// (ids in increasing order: one store per word, not a chain of read-modify-writes of the same
// word through memory).
template <typename T, typename I>
bool mark_ids(const I* ids, int64_t lo, int64_t hi, const T* row, int64_t V,
              uint64_t* bitmap) {
  const char* pf = reinterpret_cast<const char*>(row);
  const char* const pf_end = pf + V * static_cast<int64_t>(sizeof(T));
  int64_t word = 0;
  uint64_t bits = 0;
  for (int64_t k = lo; k < hi; ++k) {
    const int64_t id = static_cast<int64_t>(ids[k]);
    if (id < 0 || id >= V) {
      std::fill(bitmap, bitmap + (V + 63) / 64, uint64_t{0});
      return false;
    }
    if ((id >> 6) != word) {
      bitmap[static_cast<size_t>(word)] |= bits;
      word = id >> 6;
      bits = 0;
    }
    bits |= uint64_t{1} << (id & 63);
    if ((k & 3) == 0 && pf < pf_end) {
      __builtin_prefetch(pf, 0, 2);
      pf += 64;
    }
  }
  bitmap[static_cast<size_t>(word)] |= bits;  // V >= 1: word 0 exists
  return true;
}

// The rule for one row: ids[lo, hi) against its V logits (see the top of this file).
template <typename T, typename I>
bool ids_row(const T* row, int64_t V, const I* ids, int64_t lo, int64_t hi, uint64_t* bitmap,
             Compute<T>& tau, bool& exact) {
  using C = Compute<T>;
  if (!mark_ids(ids, lo, hi, row, V, bitmap)) {
    tau = std::numeric_limits<C>::quiet_NaN();
    exact = false;
    return false;
  }
  const auto [smallest, largest_out] = scan_row(row, V, bitmap);
  tau = smallest;
  if (std::isnan(smallest)) {
    exact = false;  // nothing passes x >= NaN, while the set holds the NaN's id
  } else if (smallest > -std::numeric_limits<C>::infinity()) {
    exact = !(largest_out >= smallest);
  } else {
    // tau = -inf: every logit but NaN passes; exact iff every such logit is marked
    // (largest_out = -inf cannot tell "none" from "an unmarked -inf": mark again and look)
    mark_ids(ids, lo, hi, row, V, bitmap);
    bool all_marked = true;
    for (int64_t j = 0; j < V && all_marked; ++j) {
      all_marked = ((bitmap[j >> 6] >> (j & 63)) & 1) || std::isnan(static_cast<C>(row[j]));
    }
    std::fill(bitmap, bitmap + (V + 63) / 64, uint64_t{0});
    exact = all_marked;
  }
  return true;
}

// The kept sets' (ids, offsets) checked against N rows: int32/int64 each, 1-D, N + 1 offsets
// from 0 to len(ids), non-decreasing (the bounds of every read of ids). Row r's ids are read
// through id(k), whichever their dtype.
struct IdSets {
  at::Tensor ids, offsets;  // contiguous
  const void* pi = nullptr;
  const void* po = nullptr;
  bool ids32 = false, offsets32 = false;
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

  bool defined() const { return pi != nullptr; }
  int64_t offset(int64_t r) const {
    return offsets32 ? static_cast<const int32_t*>(po)[r] : static_cast<const int64_t*>(po)[r];
  }

  // Row r's rule against its V logits (bitmap: (V + 63) / 64 words, all 0, left all 0): tau
  // and exact; false (tau NaN, not exact) where an id lies outside [0, V).
  template <typename T>
  bool row(int64_t r, const T* x, int64_t V, uint64_t* bitmap, Compute<T>& tau,
           bool& exact) const {
    return ids32 ? ids_row(x, V, static_cast<const int32_t*>(pi), offset(r), offset(r + 1),
                           bitmap, tau, exact)
                 : ids_row(x, V, static_cast<const int64_t*>(pi), offset(r), offset(r + 1),
                           bitmap, tau, exact);
  }
};

// A zeroed bitmap of `words` 64-bit words for this thread (the rule leaves it zeroed).
inline uint64_t* ids_bitmap(int64_t words) {
  thread_local std::vector<uint64_t> bitmap;
  if (static_cast<int64_t>(bitmap.size()) < words) bitmap.assign(static_cast<size_t>(words), 0);
  return bitmap.data();
}

}  // namespace
}  // namespace klpenalty_native
