// The forward and state ops of the contract in klpenalty/ops/contract.py (schemas defined there;
// these are their CPU implementations):
//   native_token_stats(x, y?, tokens?, mask?, keep?, tau?, temperature, ignore_index, want,
//                      check, tile_rows, tile_cols, top_k, top_p, min_p, ids?, offsets?)
//     -> (out (..., 4), stats (..., 10))
//     out: KL(π̃‖ρ), log π̃(token), log ρ(token), H(π̃), 0 where not in `want`; where the
//     sampler settings cut (1 <= top_k < V, top_p < 1, min_p > 0) each row's threshold τ_s is
//     computed from x first (row_threshold) and the support is keep ∧ x >= max(tau, τ_s);
//     stats[..., kStTau] is the threshold used (−inf: none), the backward's tau. Given an
//     engine's kept sets (ids, offsets), each counted row's τ_r (their smallest logit) and
//     whether the set is exactly {x >= τ_r} are found in the same visit of the row, just
//     before its walk (ids.h: the ids are marked while the row is requested from memory, one
//     pass over it, then the walk reads it from L2), and τ_r joins the support's threshold;
//     a row whose set is not {x >= τ_r} is not walked: its stats hold NaN in kStTau (its out
//     0), and the checks are not made (the caller passes such a set another way)
//   native_token_stats_state(x, y?, keep?, tau?, temperature, want, tile_rows, tile_cols)
//     -> (state (N, 6): m_x, s_x, m_y, s_y, a, b unfinalized; careful (N,) bool)
// π̃ is the policy restricted to its support: kept(v) = keep[v] and x_v >= tau (either optional).
// tile_rows/tile_cols are accepted for the common signature and ignored: a row is walked in
// L1-sized chunks (kChunk elements).
//
// Per row, in one read of the row from memory, the row walker (walk.h) computes whatever is
// wanted, and the row is finalized here (engine.kl_finalize / entropy_finalize / the log-prob
// finish). With the sampler, each row's τ_s is computed just before its walk (threshold.h) and
// the next row's logits are requested into L2 during the walk (its threshold passes then read
// L2, not memory); top-p's pass over the masses requests the row of y meanwhile, and the walk
// reads those masses as its e^u (walk.h). One parallel region per call, its threads taking
// blocks of rows from a shared counter (rows.h). With check, the token-range, NaN and token-in-support checks run here and
// raise the messages of klpenalty._validation.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "args.h"
#include "contract.h"
#include "ids.h"
#include "rows.h"
#include "simd.h"
#include "threshold.h"
#include "walk.h"

namespace klpenalty_native {
namespace {

// ------------------------------------------------------------------------------ checks
template <typename T>
bool rows_hold_nan(const at::Tensor& t, const std::vector<int64_t>& rows) {
  const T* p = t.const_data_ptr<T>();
  const int64_t V = t.size(-1);
  Rows ix(t);
  for (int64_t r : rows) {
    const T* row = p + ix.offset(r);
    for (int64_t j = 0; j < V; ++j)
      if (std::isnan(static_cast<double>(row[j]))) return true;
  }
  return false;
}

bool any_nan_in_rows(const at::Tensor& t, const std::vector<int64_t>& rows) {
  bool found = false;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, t.scalar_type(), "rows_hold_nan", [&] {
    found = rows_hold_nan<scalar_t>(t, rows);
  });
  return found;
}

// klpenalty._validation.check_token_range; tok (N,) int64 contiguous, tokens the caller's.
void check_token_range(const at::Tensor& tokens, const int64_t* tok, int64_t n, int64_t vocab,
                       int64_t ignore_index) {
  int64_t bad = 0, first = -1;
  for (int64_t r = 0; r < n; ++r) {
    if ((tok[r] < 0 || tok[r] >= vocab) && tok[r] != ignore_index) {
      if (first < 0) first = r;
      ++bad;
    }
  }
  TORCH_CHECK_VALUE(bad == 0, "tokens must lie in [0, ", vocab,
                    ") (the vocabulary size) or equal ignore_index=", ignore_index, "; ", bad,
                    " do not, the first ", (first < 0 ? 0 : tok[first]), " at index ",
                    py_tuple(unravel(first < 0 ? 0 : first, tokens.sizes())), " (",
                    describe(tokens), ")");
}

// Rows r with a NaN in one of the wanted columns of out (N, 4) (want: a mask of the columns).
template <typename O>
std::vector<int64_t> nan_rows(const O* out, int64_t n, int64_t want) {
  std::vector<int64_t> rows;
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t c = 0; c < kOutCols; ++c) {
      if ((want >> c & 1) && std::isnan(static_cast<double>(out[kOutCols * r + c]))) {
        rows.push_back(r);
        break;
      }
    }
  }
  return rows;
}

// klpenalty._validation.raise_if_nan on the wanted columns of out (..., 4) (float or double);
// named inputs (..., V).
void raise_if_nan(const at::Tensor& out, int64_t want, c10::IntArrayRef leading,
                  const std::vector<std::pair<std::string, at::Tensor>>& named) {
  const int64_t n = out.numel() / kOutCols;
  const std::vector<int64_t> rows = out.scalar_type() == at::kDouble
                                        ? nan_rows(out.const_data_ptr<double>(), n, want)
                                        : nan_rows(out.const_data_ptr<float>(), n, want);
  if (rows.empty()) return;
  const std::string first = py_tuple(unravel(rows[0], leading));
  for (const auto& [name, t] : named) {
    TORCH_CHECK_VALUE(!any_nan_in_rows(unit_last_stride(t), rows), name, " contains NaN (",
                      describe(t), ") in ", rows.size(), " counted position(s), the first at index ",
                      first);
  }
  TORCH_CHECK_VALUE(false, "the result is NaN in ", rows.size(),
                    " counted position(s), the first at index ", first,
                    ", although the inputs hold no NaN there: a row whose logits are all -inf (or "
                    "hold +inf) defines no distribution; mask such positions out");
}

// ------------------------------------------------------------------------------ forward
// engine.kl_finalize / entropy_finalize / the log-prob finish for one row: out (4) and stats (9);
// columns not wanted hold 0. tok: the row's token or -1.
template <typename O, typename T>
void finalize_row(const RowState& row, int64_t want, bool x_state, bool y_state, const T* xr,
                  const T* yr, const Support& sup, int64_t tok, double T_, O* out, O* st) {
  std::fill(out, out + kOutCols, O(0));
  std::fill(st, st + kStatsCols, O(0));
  st[kStTau] = static_cast<O>(sup.threshold());
  const double lsx = std::log(row.s_x), lsy = std::log(row.s_y);
  const double shx = finite_or_zero(row.m_x), shy = finite_or_zero(row.m_y);
  const bool valid_x = row.s_x > 0 && std::isfinite(row.s_x);
  const bool valid_y = row.s_y > 0 && std::isfinite(row.s_y);
  bool careful = row.careful;
  if (x_state) {
    st[kStShiftX] = static_cast<O>(shx);
    st[kStLogSX] = static_cast<O>(finite_or_zero(lsx));
    careful = careful || !valid_x;
  }
  if (y_state) {
    st[kStShiftY] = static_cast<O>(shy);
    st[kStLogSY] = static_cast<O>(finite_or_zero(lsy));
    careful = careful || !valid_y;
  }
  if (want & kWantKL) {
    const double mean_d = row.a / row.s_x;
    double v = mean_d - lsx + lsy;
    v = v < 0.0 ? 0.0 : v;  // NaN stays NaN
    out[kOutKL] = static_cast<O>(valid_x && valid_y ? v : kNaN);
    st[kStMeanD] = static_cast<O>(mean_d);
    careful = careful || !std::isfinite(mean_d);
  }
  if (want & kWantEntropy) {
    const double mean_u = row.b / row.s_x;
    double v = lsx - mean_u;
    v = v < 0.0 ? 0.0 : v;  // NaN stays NaN
    out[kOutEntropy] = static_cast<O>(valid_x ? v : kNaN);
    st[kStMeanU] = static_cast<O>(mean_u);
  }
  if (tok >= 0 && (want & kWantLogp)) {
    // (x_t − m)/T − log s: exact for nearby logits at any offset; −inf off the support;
    // no distribution: NaN
    const double xt = sup.any() ? sup.value(xr, tok) : static_cast<double>(xr[tok]);
    const double v = row.s_x == 0.0 ? kNaN : (xt - shx) / T_ - lsx;
    out[kOutLogp] = st[kStLogp] = static_cast<O>(v);
  }
  if (tok >= 0 && (want & kWantRefLogp)) {
    const double v = row.s_y == 0.0 ? kNaN : (static_cast<double>(yr[tok]) - shy) / T_ - lsy;
    out[kOutRefLogp] = st[kStRefLogp] = static_cast<O>(v);
  }
  st[kStCareful] = static_cast<O>(careful ? 1.0 : 0.0);
}

// With a support and WANT_LOGP: a counted, non-ignored token with log π̃(t) = −inf raises.
template <typename O>
void check_tokens_in_support(const StatsArgs& a, const RowAccess& ra, const O* out,
                             int64_t ignore_index) {
  int64_t bad = 0, first = -1;
  for (int64_t r = 0; r < a.N; ++r) {
    if (ra.masked(r) || ra.token(r, ignore_index) < 0) continue;
    if (out[kOutCols * r + kOutLogp] == -std::numeric_limits<O>::infinity()) {
      if (first < 0) first = r;
      ++bad;
    }
  }
  if (bad == 0) return;
  TORCH_CHECK_VALUE(false, "sampled token ", ra.tp[first], " at position ",
                    py_tuple(unravel(first, a.leading)),
                    " is outside the support (log-prob -inf under the truncated policy; ", bad,
                    " position(s) in all): the support must contain the token that was sampled; "
                    "build it with the sampler's own top_k/top_p/min_p and temperature, or pass "
                    "the sampler's kept set");
}

std::tuple<at::Tensor, at::Tensor> token_stats(
    const at::Tensor& x_arg, const std::optional<at::Tensor>& y_arg,
    const std::optional<at::Tensor>& tokens, const std::optional<at::Tensor>& mask,
    const std::optional<at::Tensor>& keep, const std::optional<at::Tensor>& tau, double T,
    int64_t ignore_index, int64_t want, bool check, int64_t /*tile_rows*/,
    int64_t /*tile_cols*/, int64_t top_k, double top_p, double min_p,
    const std::optional<at::Tensor>& ids, const std::optional<at::Tensor>& offsets) {
  const StatsArgs a(x_arg, y_arg, tokens, mask, keep, tau, T, want);
  TORCH_CHECK_VALUE(ids.has_value() == offsets.has_value(),
                    "support ids and offsets must be given together (or neither), got ",
                    ids.has_value() ? "ids alone" : "offsets alone");
  const IdSets sets = ids.has_value() ? IdSets(*ids, *offsets, a.N) : IdSets();
  std::atomic<bool> bad_id{false}, inexact{false};
  const RowAccess ra(a);
  check_sampler_args(top_k, top_p, min_p);
  const Sampler sampler(a.V, top_k, top_p, min_p, T);
  const bool cuts = sampler.cuts();
  if (check && a.tok.defined()) {
    check_token_range(a.tokens_in, ra.tp, a.N, a.V, ignore_index);
  }
  check_tokens_inside_rows(a, ra, ignore_index);
  std::vector<int64_t> out_shape = a.leading, stats_shape = a.leading;
  out_shape.push_back(kOutCols);
  stats_shape.push_back(kStatsCols);
  at::Tensor out = at::empty(out_shape, a.x.options().dtype(a.ct));
  at::Tensor stats = at::empty(stats_shape, a.x.options().dtype(a.ct));
  // Only y is needed (the reference log-probs alone): y is walked as "x" without a support.
  const bool y_only = !a.need_x_state;
  const bool kY = a.need_x_state && a.need_y_state, kB = want & kWantEntropy;
  // an ignored token leaves nothing to compute in a row that wants only token log-probs
  const bool tokens_only = !(want & (kWantKL | kWantEntropy));
  const int64_t V = a.V;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.x.scalar_type(), "native_token_stats", [&] {
    using T_in = scalar_t;
    const T_in* px = a.x.const_data_ptr<T_in>();
    const T_in* py = a.y.defined() ? a.y.const_data_ptr<T_in>() : nullptr;
    auto run = [&](auto* res, auto* stp) {
      using O = std::remove_pointer_t<decltype(res)>;
      parallel_rows(a.N, V, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          O* o = res + kOutCols * r;
          O* s = stp + kStatsCols * r;
          const int64_t t = ra.token(r, ignore_index);
          if (ra.masked(r) || (tokens_only && t < 0)) {  // not computed: 0 whatever it holds
            if (sets.defined() && !sets.in_range(r, V)) {  // every id is checked
              bad_id.store(true, std::memory_order_relaxed);
            }
            std::fill(o, o + kOutCols, O(0));
            std::fill(s, s + kStatsCols, O(0));
            continue;
          }
          const T_in* xr = px + ra.rx.offset(r);
          const T_in* yr = py ? py + ra.ry.offset(r) : nullptr;
          if (y_only) {
            if (sets.defined() && !sets.in_range(r, V)) {
              bad_id.store(true, std::memory_order_relaxed);
            }
            RowState row = walk(yr, yr, Support(), V, T, false, false);
            std::swap(row.m_x, row.m_y);
            std::swap(row.s_x, row.s_y);
            finalize_row(row, want, false, true, xr, yr, Support(), t, T, o, s);
          } else {
            Support sup = ra.support(r);
            RowState row;
            bool walked = false;  // by the kept set's walk, below
            if (sets.defined()) {  // the kept set's τ_r and exactness, and its walk
              Compute<T_in> tau_ids = std::numeric_limits<Compute<T_in>>::quiet_NaN();
              bool exact = false;
              bool* marks = ids_marks(V);
              if (!sets.mark(r, V, marks)) {
                bad_id.store(true, std::memory_order_relaxed);
              } else {
                if constexpr (!std::is_same_v<T_in, double>) {
                  // the walk over the marks finds the set's bounds as it goes, and where the
                  // set is {x >= its smallest logit} that walk is the row's
                  if (!sup.any() && !cuts) {
                    KeptBounds b;
                    // the next rows' ids are read into L2 during this walk
                    const void* side = r + 1 < r1 ? sets.row_ids(r + 1) : nullptr;
                    row = walk_keep_bounds(xr, yr, marks, V, T, kY, kB, b, side);
                    walked = !row.bad && b.lo > -std::numeric_limits<float>::infinity();
                    if (walked) tau_ids = b.lo, exact = !(b.hi >= b.lo);
                  }
                }
                // NaN, ±inf or a sum that is not finite: one scan of the row decides the set
                if (!walked) decide_marked(xr, V, marks, tau_ids, exact);
                std::fill(marks, marks + V, false);
              }
              if (!exact) {  // no threshold describes the set: not walked, kStTau NaN
                inexact.store(true, std::memory_order_relaxed);
                std::fill(o, o + kOutCols, O(0));
                std::fill(s, s + kStatsCols, O(0));
                s[kStTau] = std::numeric_limits<O>::quiet_NaN();
                continue;
              }
              sup = with_threshold(sup, tau_ids, a.ct == at::kDouble);
            }
            if (!walked) {
              if (cuts) {
                ThresholdScratch& w = scratch();
                // (y's row requested into L2 while top-p's pass computes the masses)
                sup = with_threshold(sup, row_threshold(xr, V, sampler, w, yr),
                                     a.ct == at::kDouble);
                // top-p's masses, stored by the threshold: the walk's e^u (walk.h)
                if (w.masses_of == static_cast<const void*>(xr)) {
                  sup.masses = w.es.data(), sup.masses_max = w.masses_max;
                }
              }
              // with the sampler, the next row's logits are read into L2 during this walk
              const void* side = cuts && r + 1 < r1 ? px + ra.rx.offset(r + 1) : nullptr;
              row = walk(xr, yr, sup, V, T, kY, kB, side);
            }
            finalize_row(row, want, true, a.need_y_state, xr, yr, sup, t, T, o, s);
          }
        }
      });
    };
    if (a.ct == at::kDouble) {
      run(out.mutable_data_ptr<double>(), stats.mutable_data_ptr<double>());
    } else {
      run(out.mutable_data_ptr<float>(), stats.mutable_data_ptr<float>());
    }
  });
  if (bad_id.load()) sets.fail_range(V);
  if (check && !inexact.load()) {
    if (a.y.defined()) {
      raise_if_nan(out, want, a.leading, {{"policy_logits", a.x_in}, {"ref_logits", a.y_in}});
    } else {
      raise_if_nan(out, want, a.leading, {{"logits", a.x_in}});
    }
    if ((a.truncated() || cuts || sets.defined()) && (want & kWantLogp)) {
      if (a.ct == at::kDouble) {
        check_tokens_in_support(a, ra, out.const_data_ptr<double>(), ignore_index);
      } else {
        check_tokens_in_support(a, ra, out.const_data_ptr<float>(), ignore_index);
      }
    }
  }
  return {out, stats};
}

// The unfinalized state of every row over these columns (the vocabulary-parallel merge):
// (N, 6) m_x, s_x, m_y, s_y, a, b in the compute dtype (0 in the fields not wanted), and the
// rows that needed the 0·log 0 arithmetic.
std::tuple<at::Tensor, at::Tensor> token_stats_state(
    const at::Tensor& x_arg, const std::optional<at::Tensor>& y_arg,
    const std::optional<at::Tensor>& keep, const std::optional<at::Tensor>& tau, double T,
    int64_t want, int64_t /*tile_rows*/, int64_t /*tile_cols*/) {
  const std::optional<at::Tensor> none;
  // the tokens are not read here: the state does not depend on them
  const StatsArgs a(x_arg, y_arg, none, none, keep, tau, T, want & (kWantKL | kWantEntropy)
                                                            ? want & (kWantKL | kWantEntropy)
                                                            : kWantEntropy);
  const RowAccess ra(a);
  const bool kY = a.y.defined() && (want & (kWantKL | kWantRefLogp));
  const bool kB = want & kWantEntropy;
  at::Tensor state = at::zeros({a.N, kStateCols}, a.x.options().dtype(a.ct));
  at::Tensor careful = at::zeros({a.N}, a.x.options().dtype(at::kBool));
  bool* cp = careful.mutable_data_ptr<bool>();
  const int64_t V = a.V;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.x.scalar_type(), "native_token_stats_state", [&] {
    using T_in = scalar_t;
    const T_in* px = a.x.const_data_ptr<T_in>();
    const T_in* py = a.y.defined() ? a.y.const_data_ptr<T_in>() : nullptr;
    auto run = [&](auto* stp) {
      using O = std::remove_pointer_t<decltype(stp)>;
      parallel_rows(a.N, V, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const T_in* xr = px + ra.rx.offset(r);
          const T_in* yr = py ? py + ra.ry.offset(r) : nullptr;
          const RowState row = walk(xr, kY ? yr : xr, ra.support(r), V, T, kY, kB);
          O* s = stp + kStateCols * r;
          s[kSxMX] = static_cast<O>(row.m_x), s[kSxSX] = static_cast<O>(row.s_x);
          if (kY) {
            s[kSxMY] = static_cast<O>(row.m_y), s[kSxSY] = static_cast<O>(row.s_y);
            if (want & kWantKL) s[kSxA] = static_cast<O>(row.a);
          }
          if (kB) s[kSxB] = static_cast<O>(row.b);
          cp[r] = row.careful;
        }
      });
    };
    if (a.ct == at::kDouble) {
      run(state.mutable_data_ptr<double>());
    } else {
      run(state.mutable_data_ptr<float>());
    }
  });
  return {state, careful};
}

}  // namespace

TORCH_LIBRARY_IMPL(klpenalty, CPU, m) {
  m.impl("native_token_stats", &token_stats);
  m.impl("native_token_stats_state", &token_stats_state);
}

}  // namespace klpenalty_native
