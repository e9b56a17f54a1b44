// The arguments of the token_stats ops (native_token_stats, _backward and _state), checked as
// klpenalty._validation checks the public ones (StatsArgs), and each row's pointers, token and
// support (RowAccess).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "contract.h"
#include "rows.h"
#include "walk.h"

namespace klpenalty_native {
namespace {  // each source its own copies (internal linkage), inlined freely

// A (...) bool mask as a flat contiguous tensor, checked against the leading dims.
inline at::Tensor flat_mask(const std::optional<at::Tensor>& mask, c10::IntArrayRef leading) {
  if (!mask.has_value()) return at::Tensor();
  const at::Tensor& m = *mask;
  TORCH_CHECK_TYPE(m.scalar_type() == at::kBool,
                   "mask must be a bool tensor (True = position counts), got ", describe(m));
  TORCH_CHECK_VALUE(m.sizes() == leading, "mask must have shape ", py_tuple(leading.vec()),
                    " (the leading dims of the logits), got ", describe(m));
  return m.contiguous();
}

inline at::Tensor flat_tokens(const at::Tensor& tokens, c10::IntArrayRef leading) {
  TORCH_CHECK_TYPE(!tokens.is_floating_point() && !tokens.is_complex() &&
                       tokens.scalar_type() != at::kBool,
                   "tokens must be an integer tensor, got ", describe(tokens));
  TORCH_CHECK_VALUE(tokens.sizes() == leading, "tokens must have shape ", py_tuple(leading.vec()),
                    " (the leading dims of the logits), got ", describe(tokens));
  return tokens.to(at::kLong).contiguous();
}

// The compute dtype of logits x (and y): float64 if either is, else float32.
inline at::ScalarType compute_type(const at::Tensor& x, const at::Tensor* y = nullptr) {
  const bool d = x.scalar_type() == at::kDouble || (y && y->scalar_type() == at::kDouble);
  return d ? at::kDouble : at::kFloat;
}

// x and y with a unit last stride, both copied to the compute dtype ct where their dtypes
// differ (a rare case); whether they were.
inline bool unit_stride_pair(const at::Tensor& x_in, const at::Tensor& y_in, at::ScalarType ct,
                             at::Tensor& x, at::Tensor& y) {
  x = unit_last_stride(x_in);
  y = unit_last_stride(y_in);
  if (x.scalar_type() == y.scalar_type()) return false;
  x = x.to(ct);
  y = y.to(ct);
  return true;
}

// The support's op arguments checked against logits x_in (..., V): keep (..., V) bool with a
// unit last stride, tau (...) float32/float64 contiguous (undefined where not given).
inline void support_tensors(const std::optional<at::Tensor>& keep_arg,
                            const std::optional<at::Tensor>& tau_arg, const at::Tensor& x_in,
                            const std::vector<int64_t>& leading, at::Tensor& keep,
                            at::Tensor& tau) {
  if (keep_arg.has_value()) {
    const at::Tensor& k = *keep_arg;
    TORCH_CHECK_TYPE(k.scalar_type() == at::kBool,
                     "keep must be a bool tensor (True = kept), got ", describe(k));
    TORCH_CHECK_VALUE(k.sizes() == x_in.sizes(), "keep must have the shape of the logits ",
                      py_tuple(x_in.sizes().vec()), ", got ", describe(k));
    keep = unit_last_stride(k);
  }
  if (tau_arg.has_value()) {
    const at::Tensor& t = *tau_arg;
    TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble,
                     "tau must be a float32 or float64 tensor, got ", describe(t));
    TORCH_CHECK_VALUE(t.sizes() == c10::IntArrayRef(leading), "tau must have shape ",
                      py_tuple(leading), " (the leading dims of the logits), got ", describe(t));
    tau = t.contiguous();
  }
}

// Each row's Support (walk.h) from the checked keep / tau (either undefined).
struct SupportRows {
  Rows rk;
  const bool* kp;
  const float* tau_f;
  const double* tau_d;

  SupportRows(const at::Tensor& keep, const at::Tensor& tau, const at::Tensor& x)
      : rk(keep.defined() ? keep : x),
        kp(keep.defined() ? keep.const_data_ptr<bool>() : nullptr),
        tau_f(tau.defined() && tau.scalar_type() == at::kFloat ? tau.const_data_ptr<float>()
                                                               : nullptr),
        tau_d(tau.defined() && tau.scalar_type() == at::kDouble ? tau.const_data_ptr<double>()
                                                                : nullptr) {}

  Support at(int64_t r) const {
    Support s;
    if (kp) s.keep = kp + rk.offset(r);
    if (tau_f) {
      s.has_tau = true;
      s.tau_f = tau_f[r];
    } else if (tau_d) {
      s.has_tau = true;
      s.tau_double = true;
      s.tau_d = tau_d[r];
    }
    return s;
  }
};

// The checked arguments of both ops: logits with a unit last stride (both in the compute dtype
// when their dtypes differ, a rare case), flat contiguous per-position tensors, and the support.
struct StatsArgs {
  at::Tensor x_in, y_in, tokens_in;  // the caller's, for messages
  at::Tensor x, y, tok, mask, keep, tau;
  std::vector<int64_t> leading;
  int64_t V = 0, N = 0, want = 0;
  at::ScalarType ct = at::kFloat;  // compute dtype
  bool mixed = false;
  bool need_x_state = false, need_y_state = false;  // which logits the forward walks

  StatsArgs(const at::Tensor& x_arg, const std::optional<at::Tensor>& y_arg,
            const std::optional<at::Tensor>& tokens_arg, const std::optional<at::Tensor>& mask_arg,
            const std::optional<at::Tensor>& keep_arg, const std::optional<at::Tensor>& tau_arg,
            double T, int64_t want_arg)
      : x_in(x_arg), want(want_arg) {
    const bool has_y = y_arg.has_value();
    check_logits_arg(has_y ? "policy_logits" : "logits", x_in);
    if (has_y) {
      y_in = *y_arg;
      check_logits_arg("ref_logits", y_in);
      TORCH_CHECK_VALUE(x_in.sizes() == y_in.sizes(),
                        "policy_logits and ref_logits must have the same shape (..., V): "
                        "policy_logits ", describe(x_in), ", ref_logits ", describe(y_in));
    }
    check_temperature(T);
    TORCH_CHECK_VALUE(want > 0 && want < 16,
                      "want must be a nonzero sum of WANT_KL=1, WANT_LOGP=2, WANT_REF_LOGP=4 and "
                      "WANT_ENTROPY=8, got ", want);
    TORCH_CHECK_VALUE(has_y || !(want & (kWantKL | kWantRefLogp)),
                      "want asks for the KL or the reference log-probs (", want,
                      ") but ref_logits is None");
    TORCH_CHECK_VALUE(tokens_arg.has_value() || !(want & (kWantLogp | kWantRefLogp)),
                      "want asks for token log-probs (", want, ") but tokens is None");
    ct = compute_type(x_in, has_y ? &y_in : nullptr);
    if (has_y) {
      mixed = unit_stride_pair(x_in, y_in, ct, x, y);
    } else {
      x = unit_last_stride(x_in);
    }
    leading = leading_of(x);
    V = x.size(-1);
    N = x.numel() / V;
    mask = flat_mask(mask_arg, leading);
    if (tokens_arg.has_value()) {
      tokens_in = *tokens_arg;
      tok = flat_tokens(tokens_in, leading);
    }
    support_tensors(keep_arg, tau_arg, x_in, leading, keep, tau);
    need_x_state = want & (kWantKL | kWantLogp | kWantEntropy);
    need_y_state = want & (kWantKL | kWantRefLogp);
  }

  bool truncated() const { return keep.defined() || tau.defined(); }
};

// Per-row pointers and flags shared by the forward and backward loops.
struct RowAccess {
  const StatsArgs& a;
  Rows rx, ry;
  SupportRows sr;
  const bool* mp;
  const int64_t* tp;

  explicit RowAccess(const StatsArgs& args)
      : a(args),
        rx(args.x),
        ry(args.y.defined() ? args.y : args.x),
        sr(args.keep, args.tau, args.x),
        mp(args.mask.defined() ? args.mask.const_data_ptr<bool>() : nullptr),
        tp(args.tok.defined() ? args.tok.const_data_ptr<int64_t>() : nullptr) {}

  bool masked(int64_t r) const { return mp && !mp[r]; }
  // the row's token, or -1 where there is none or it is ignored
  int64_t token(int64_t r, int64_t ignore_index) const {
    return (tp && tp[r] != ignore_index) ? tp[r] : -1;
  }
  Support support(int64_t r) const { return sr.at(r); }
};

// Tokens of counted rows that are read must lie in the row (also with check=False).
inline void check_tokens_inside_rows(const StatsArgs& a, const RowAccess& ra,
                                     int64_t ignore_index) {
  if (!ra.tp || !(a.want & (kWantLogp | kWantRefLogp))) return;
  for (int64_t r = 0; r < a.N; ++r) {
    const int64_t t = ra.tp[r];
    TORCH_CHECK_INDEX(ra.masked(r) || t == ignore_index || (t >= 0 && t < a.V), "token ", t,
                      " at flat position ", r, " is out of range for a vocabulary of ", a.V);
  }
}

}  // namespace
}  // namespace klpenalty_native
