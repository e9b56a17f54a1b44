// The backward op of the contract in klpenalty/ops/contract.py (schema defined there):
//   native_token_stats_backward(grad (..., 4), x, y?, tokens?, owned?, stats, mask?, keep?, tau?,
//                               temperature, ignore_index, want, need_x, need_y, tile_rows,
//                               tile_cols) -> (grad_x (..., V) or empty, grad_y (..., V) or empty)
// `owned` (bool, optional): where false the row's token is not in these columns: its own entry
// is not added (the dense terms of the log-prob columns are). One walk per row writes ∂/∂x and
// ∂/∂y for all wanted outputs from the forward's stats (float32 vectors; float64 inputs in
// scalar double), then the token's own entries in double.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "args.h"
#include "contract.h"
#include "rows.h"
#include "simd.h"
#include "walk.h"

namespace klpenalty_native {
namespace {

// The per-row coefficients of the gradient, with d_x = x − shift_x = T·u, d_y = y − shift_y:
//   ∂/∂x_v = p·((d_x − d_y)·ckl + d_x·ch + c0) (+ the token's term), p = π̃_v,
//   ∂/∂y_v = (q − p)·cy1 + q·cy2 (+ the token's term), q = ρ_v.
struct GradRow {
  double g_kl = 0, g_lp = 0, g_rl = 0, g_h = 0;  // upstream, 0 where not wanted or ignored
  double shx = 0, lsx = 0, shy = 0, lsy = 0, md = 0, mu = 0, lpt = 0, lqt = 0;
  bool careful = false;

  bool zero() const { return g_kl == 0 && g_lp == 0 && g_rl == 0 && g_h == 0; }
};

// g·v, 0 where g = 0 (a column without upstream gradient adds nothing, even if v = ±inf)
inline double times(double g, double v) { return g == 0.0 ? 0.0 : g * v; }

struct GradCoef {
  VF vsx, vsy, vc, vbx, vby, vckl, vch, vc0, vcy1, vcy2;
  float shx, shy, c, bx, by, ckl, ch, c0, cy1, cy2;
  GradCoef(const GradRow& g, double T) {
    shx = static_cast<float>(g.shx);
    shy = static_cast<float>(g.shy);
    c = static_cast<float>(kLog2e / T);
    bx = static_cast<float>(-g.lsx * kLog2e);
    by = static_cast<float>(-g.lsy * kLog2e);
    ckl = static_cast<float>(g.g_kl / (T * T));
    ch = static_cast<float>(-g.g_h / (T * T));
    c0 = static_cast<float>((times(g.g_h, g.mu) - times(g.g_kl, g.md) - g.g_lp) / T);
    cy1 = static_cast<float>(g.g_kl / T);
    cy2 = static_cast<float>(-g.g_rl / T);
    vsx = VF(shx), vsy = VF(shy), vc = VF(c), vbx = VF(bx), vby = VF(by);
    vckl = VF(ckl), vch = VF(ch), vc0 = VF(c0), vcy1 = VF(cy1), vcy2 = VF(cy2);
  }
};

// Elements [0, n) of the gradient rows, float32 vectors. kDy: y is read (the KL, or ∂/∂y);
// kKL, kH: the KL's and the entropy's d-dependent terms of ∂/∂x (each only where its upstream
// gradient is nonzero: a KL of +inf gives no NaN to the other columns' gradients); kCareful:
// 0 where p = 0 (−inf logits, off the support) and where ∂/∂y is NaN.
// Sup: the support's lane masks (p = 0 off it; the logits read in memory order).
template <bool kDy, bool kKL, bool kH, bool kCareful, typename TX, typename TY, typename TO,
          typename Sup = NoLanes>
void grad_segment(const TX* px, const TY* py, int64_t n, const GradCoef& k, TO* gx, TO* gy,
                  const Sup& sup = Sup()) {
  const VF zero(0.0f);
  auto gx_of = [&](const VF& p, const VF& dx, const VF& dy) {
    VF inner = k.vc0;
    if constexpr (kH) inner = at::vec::fmadd(dx, k.vch, inner);
    if constexpr (kKL) inner = at::vec::fmadd(dx - dy, k.vckl, inner);
    VF v = p * inner;
    if constexpr (kCareful) v = VF::blendv(v, zero, p == zero);
    return v;
  };
  auto gy_of = [&](const VF& p, const VF& dy) {
    const VF q = exp2_fast(at::vec::fmadd(dy, k.vc, k.vby));
    VF v = at::vec::fmadd(q - p, k.vcy1, q * k.vcy2);
    if constexpr (kCareful) v = VF::blendv(v, zero, v != v);
    return v;
  };
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    VF dx0, dx1, dy0, dy1;
    if constexpr (kDy) {
      load_shifted(px + i, py + i, k.vsx, k.vsy, dx0, dx1, dy0, dy1);
    } else {
      prefetch_block(px + kChunk + i);
      VF x0, x1;
      load2(px + i, x0, x1);
      dx0 = x0 - k.vsx;
      dx1 = x1 - k.vsx;
    }
    VF p0 = exp2_fast(at::vec::fmadd(dx0, k.vc, k.vbx));
    VF p1 = exp2_fast(at::vec::fmadd(dx1, k.vc, k.vbx));
    if constexpr (Sup::kOn) {  // the logits again (from L1) for the comparison with tau
      VF xa, xb;
      load2(px + i, xa, xb);
      p0 = select(sup.at(xa, i), p0, zero);
      p1 = select(sup.at(xb, i + VF::size()), p1, zero);
    }
    if (gx) store2(gx + i, gx_of(p0, dx0, dy0), gx_of(p1, dx1, dy1));
    if constexpr (kDy) {
      if (gy) store2(gy + i, gy_of(p0, dy0), gy_of(p1, dy1));
    }
  }
  for (; i < n; ++i) {
    const float dx = static_cast<float>(px[i]) - k.shx;
    const float dy = kDy ? static_cast<float>(py[i]) - k.shy : 0.0f;
    const float p = sup.kept(static_cast<float>(px[i]), i) ? std::exp2(dx * k.c + k.bx) : 0.0f;
    if (gx) {
      float inner = k.c0;
      if (kH) inner += dx * k.ch;
      if (kKL) inner += (dx - dy) * k.ckl;
      const float v = p * inner;
      gx[i] = static_cast<TO>((kCareful && p == 0.0f) ? 0.0f : v);
    }
    if (kDy && gy) {
      const float q = std::exp2(dy * k.c + k.by);
      const float v = (q - p) * k.cy1 + q * k.cy2;
      gy[i] = static_cast<TO>((kCareful && std::isnan(v)) ? 0.0f : v);
    }
  }
}

// A whole gradient row in float32 vectors: chunk by chunk through the support buffer when
// truncated (the careful arithmetic), else in one sweep.
template <bool kDy, bool kKL, bool kH, typename T>
void grad_row_vec(const T* xr, const T* yr, const Support& sup, const GradRow& g, double T_,
                  T* gx, T* gy, int64_t V) {
  const GradCoef k(g, T_);
  if (sup.any()) {  // p = 0 off the support by the lane masks; careful: −inf logits kept
    with_lanes(sup, [&](const auto& lanes) {
      grad_segment<kDy, kKL, kH, true>(xr, yr, V, k, gx, gy, lanes);
      return 0;
    });
  } else if (g.careful) {
    grad_segment<kDy, kKL, kH, true>(xr, yr, V, k, gx, gy);
  } else {
    grad_segment<kDy, kKL, kH, false>(xr, yr, V, k, gx, gy);
  }
}

// A whole gradient row, scalar double with the careful rules (float64 inputs).
template <typename T>
void grad_row_scalar(const T* xr, const T* yr, const Support& sup, const GradRow& g, double T_,
                     T* gx, T* gy, int64_t V) {
  const bool dy_needed = g.g_kl != 0.0 || gy != nullptr;
  for (int64_t j = 0; j < V; ++j) {
    const double xv = sup.any() ? sup.value(xr, j) : static_cast<double>(xr[j]);
    const double dx = xv - g.shx;
    const double dy = dy_needed ? static_cast<double>(yr[j]) - g.shy : 0.0;
    const double p = std::exp(dx / T_ - g.lsx);
    if (gx) {
      double inner = -g.g_lp;
      if (g.g_kl != 0.0) inner += g.g_kl * ((dx - dy) / T_ - g.md);
      if (g.g_h != 0.0) inner -= g.g_h * (dx / T_ - g.mu);
      gx[j] = static_cast<T>(p == 0.0 ? 0.0 : p * inner / T_);
    }
    if (gy) {
      const double q = std::exp(dy / T_ - g.lsy);
      const double v = (g.g_kl * (q - p) - g.g_rl * q) / T_;
      gy[j] = static_cast<T>(std::isnan(v) ? 0.0 : v);
    }
  }
}

// The token's entries, in double: the one-hot terms with (1 − π̃_t) = −expm1(log π̃_t) (and
// likewise for ρ), exact for a token of probability near 1.
template <typename T>
void grad_token(const T* xr, const T* yr, const Support& sup, const GradRow& g, double T_,
                int64_t t, T* gx, T* gy) {
  if (gx && g.g_lp != 0.0) {
    const double xt = sup.any() ? sup.value(xr, t) : static_cast<double>(xr[t]);
    const double dx = xt - g.shx, p = std::exp(g.lpt);
    double inner = 0.0;
    if (g.g_kl != 0.0) inner += g.g_kl * ((dx - (static_cast<double>(yr[t]) - g.shy)) / T_ - g.md);
    if (g.g_h != 0.0) inner -= g.g_h * (dx / T_ - g.mu);
    // a token off the support (or at a −inf logit; check=False): 0, as every entry there
    const double own = xt == -kInf ? 0.0 : -std::expm1(g.lpt) * g.g_lp / T_;
    gx[t] = static_cast<T>((p == 0.0 ? 0.0 : p * inner / T_) + own);
  }
  if (gy && g.g_rl != 0.0) {
    const double q = std::exp(g.lqt);
    double v = -std::expm1(g.lqt) * g.g_rl;
    if (g.g_kl != 0.0) {
      const double xt = sup.any() ? sup.value(xr, t) : static_cast<double>(xr[t]);
      const double d = g.g_kl * (q - std::exp((xt - g.shx) / T_ - g.lsx));
      v += std::isnan(d) ? 0.0 : d;
    }
    gy[t] = static_cast<T>(v / T_);
  }
}

std::tuple<at::Tensor, at::Tensor> token_stats_backward(
    const at::Tensor& grad, const at::Tensor& x_arg, const std::optional<at::Tensor>& y_arg,
    const std::optional<at::Tensor>& tokens, const std::optional<at::Tensor>& owned,
    const at::Tensor& stats, const std::optional<at::Tensor>& mask,
    const std::optional<at::Tensor>& keep, const std::optional<at::Tensor>& tau, double T,
    int64_t ignore_index, int64_t want, bool need_x, bool need_y_arg, int64_t /*tile_rows*/,
    int64_t /*tile_cols*/) {
  const StatsArgs a(x_arg, y_arg, tokens, mask, keep, tau, T, want);
  const RowAccess ra(a);
  const at::Tensor own = flat_mask(owned, a.leading);  // where false: no token entry here
  const bool* op = own.defined() ? own.const_data_ptr<bool>() : nullptr;
  const bool need_y = need_y_arg && a.y.defined();
  const int64_t V = a.V, N = a.N;
  std::vector<int64_t> gshape = a.leading, sshape = a.leading;
  gshape.push_back(kOutCols);
  sshape.push_back(kStatsCols);
  TORCH_CHECK_VALUE(grad.sizes() == c10::IntArrayRef(gshape), "grad must have shape ",
                    py_tuple(gshape), ", got ", describe(grad));
  TORCH_CHECK_VALUE(stats.sizes() == c10::IntArrayRef(sshape), "stats must have shape ",
                    py_tuple(sshape), ", got ", describe(stats));
  check_tokens_inside_rows(a, ra, ignore_index);
  const at::Tensor g = grad.to(at::kDouble).contiguous();
  const at::Tensor st = stats.to(at::kDouble).contiguous();
  at::Tensor gx = need_x ? at::empty(a.x.sizes(), a.x.options()) : at::empty({0}, x_arg.options());
  at::Tensor gy = need_y ? at::empty(a.y.sizes(), a.y.options())
                         : at::empty({0}, x_arg.options());
  const double* gp = g.const_data_ptr<double>();
  const double* sp = st.const_data_ptr<double>();
  if (need_x || need_y) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.x.scalar_type(), "native_token_stats_bwd", [&] {
      using T_in = scalar_t;
      const T_in* px = a.x.const_data_ptr<T_in>();
      const T_in* py = a.y.defined() ? a.y.const_data_ptr<T_in>() : nullptr;
      T_in* gxp = need_x ? gx.mutable_data_ptr<T_in>() : nullptr;
      T_in* gyp = need_y ? gy.mutable_data_ptr<T_in>() : nullptr;
      parallel_rows(N, V, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          T_in* gxr = gxp ? gxp + r * V : nullptr;
          T_in* gyr = gyp ? gyp + r * V : nullptr;
          const double* gr = gp + kOutCols * r;
          const double* s = sp + kStatsCols * r;
          const int64_t t = ra.token(r, ignore_index);
          GradRow row;
          if (!ra.masked(r)) {
            row.g_kl = (want & kWantKL) ? gr[kOutKL] : 0.0;
            row.g_lp = (want & kWantLogp) && t >= 0 ? gr[kOutLogp] : 0.0;
            row.g_rl = (want & kWantRefLogp) && t >= 0 ? gr[kOutRefLogp] : 0.0;
            row.g_h = (want & kWantEntropy) ? gr[kOutEntropy] : 0.0;
          }
          if (row.zero()) {  // masked (garbage allowed), ignored or no upstream gradient: 0
            if (gxr) std::fill(gxr, gxr + V, T_in(0));
            if (gyr) std::fill(gyr, gyr + V, T_in(0));
            continue;
          }
          row.shx = s[kStShiftX], row.lsx = s[kStLogSX];
          row.shy = s[kStShiftY], row.lsy = s[kStLogSY];
          row.md = s[kStMeanD], row.mu = s[kStMeanU];
          row.lpt = s[kStLogp], row.lqt = s[kStRefLogp];
          row.careful = s[kStCareful] != 0.0;
          const T_in* xr = px + ra.rx.offset(r);
          const T_in* yr = py ? py + ra.ry.offset(r) : nullptr;
          const Support sup = ra.support(r);
          if (!a.need_x_state) {  // the reference log-probs alone: ∂/∂y = (onehot − q)·g/T
            row.shx = 0.0, row.lsx = kInf;  // p = 0 everywhere
          }
          if constexpr (std::is_same_v<T_in, double>) {
            grad_row_scalar(xr, yr, sup, row, T, gxr, gyr, V);
          } else {
            const bool kl = row.g_kl != 0.0, h = row.g_h != 0.0;
            if (!a.need_x_state) {  // x unread: walk y as both (p = 0 by lsx = inf)
              grad_row_vec<true, false, false>(yr, yr, Support(), row, T, gxr, gyr, V);
            } else if (kl) {
              h ? grad_row_vec<true, true, true>(xr, yr, sup, row, T, gxr, gyr, V)
                : grad_row_vec<true, true, false>(xr, yr, sup, row, T, gxr, gyr, V);
            } else if (gyr) {
              h ? grad_row_vec<true, false, true>(xr, yr, sup, row, T, gxr, gyr, V)
                : grad_row_vec<true, false, false>(xr, yr, sup, row, T, gxr, gyr, V);
            } else {
              h ? grad_row_vec<false, false, true>(xr, yr, sup, row, T, gxr, gyr, V)
                : grad_row_vec<false, false, false>(xr, yr, sup, row, T, gxr, gyr, V);
            }
          }
          if (t >= 0 && (!op || op[r])) grad_token(xr, yr, sup, row, T, t, gxr, gyr);
        }
      });
    });
  }
  if (a.mixed) {
    if (need_x) gx = gx.to(x_arg.scalar_type());
    if (need_y) gy = gy.to(a.y_in.scalar_type());
  }
  return {gx, gy};
}

}  // namespace

TORCH_LIBRARY_IMPL(klpenalty, CPU, m) {
  m.impl("native_token_stats_backward", &token_stats_backward);
}

}  // namespace klpenalty_native
