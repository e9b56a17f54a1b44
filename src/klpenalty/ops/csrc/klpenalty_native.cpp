// klpenalty native CPU kernel: the engine of klpenalty/ops/engine.py in one fused pass per row.
//
// Ops (torch.ops.klpenalty.*), with the signatures and outputs of the streaming backend:
//   native_full_kl(x, y, mask?, temperature, check, tile_rows, tile_cols) -> (kl (...), stats (..., 6))
//   native_full_kl_backward(grad, x, y, stats, mask?, temperature, need_x, need_y, tile_rows,
//                           tile_cols) -> (grad_x (..., V) or empty, grad_y (..., V) or empty)
//   native_token_logprobs(x, tokens, temperature, ignore_index, check, tile_rows, tile_cols)
//                           -> (logp (...), stats (..., 3))
//   native_token_logprobs_backward(grad, x, tokens, stats, temperature, ignore_index,
//                                  tile_rows, tile_cols) -> grad_x (..., V)
//   native_entropy(x, mask?, temperature, check, tile_rows, tile_cols) -> (H (...), stats (..., 3))
//   native_entropy_backward(grad, x, stats, mask?, temperature, tile_rows, tile_cols)
//                           -> grad_x (..., V)
// tile_rows/tile_cols are accepted for a common signature and ignored: a row is walked in
// L1-sized chunks (kChunk elements).
//
// Per row, in one read of the row from memory: each chunk is read twice (its maxima, then from L1
// the exps and sums), the row state (maxima in logit units, s_x, s_y, a; engine.py) is kept in
// double and rescaled when a chunk raises a maximum. float32/bfloat16/float16 inputs are read
// directly and computed in float32 vectors (at::vec::Vectorized<float>) with a polynomial exp2;
// float64 inputs, and rows holding NaN or +inf, take a scalar double path with the engine's rules.
// One parallel region per call, its threads taking blocks of rows from a shared counter.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace klpenalty_native {
namespace {

using VF = at::vec::Vectorized<float>;
using VI = at::vec::Vectorized<int32_t>;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kLog2e = 1.4426950408889634;
constexpr int64_t kBlock = 2 * VF::size();  // elements per inner step: two float vectors
constexpr int64_t kChunk = 2048;            // elements of one row kept in L1 between the passes
constexpr int64_t kGrainElements = 1 << 16; // work per parallel task, in elements

// ------------------------------------------------------------------------------ fast exp2
// 2^t = 2^n · 2^f, n = round(t), f in [-1/2, 1/2]; 2^f by a degree-6 polynomial fitted for
// relative error (9.6e-8 in float32 Horner, about one ulp). t is clamped to [-127, 127]; n = -127
// builds the bit pattern 0, so the result is exactly 0 below about -126.5 (also for t = -inf),
// where the exact value is below 1e-38. NaN stays NaN.
inline VF exp2_fast(const VF& t) {
  VF tc = at::vec::clamp(t, VF(-127.0f), VF(127.0f));
  VF n = tc.round();
  VF f = tc - n;
  VF p(1.5345812e-4f);
  p = at::vec::fmadd(p, f, VF(1.3399931e-3f));
  p = at::vec::fmadd(p, f, VF(9.6184891e-3f));
  p = at::vec::fmadd(p, f, VF(5.5503286e-2f));
  p = at::vec::fmadd(p, f, VF(2.4022646e-1f));
  p = at::vec::fmadd(p, f, VF(6.9314718e-1f));
  p = at::vec::fmadd(p, f, VF(1.0f));
  VI bits = (at::vec::convert_to_int_of_same_size(n) + VI(127)) << VI(23);
  return p * at::vec::cast<float>(bits);
}

// ------------------------------------------------------------------------------ loads/stores
// Two float vectors (kBlock elements) from float, bfloat16 or float16 memory, and back.
inline void load2(const float* p, VF& a, VF& b) {
  a = VF::loadu(p);
  b = VF::loadu(p + VF::size());
}
template <typename T>
inline void load2(const T* p, VF& a, VF& b) {
  at::vec::load_to_float<T>(p, a, b);
}
inline void store2(float* p, const VF& a, const VF& b) {
  a.store(p);
  b.store(p + VF::size());
}
template <typename T>
inline void store2(T* p, const VF& a, const VF& b) {
  at::vec::convert_from_float<T>(a, b).store(p);
}

// Ask for the lines of the next chunk while this one is computed from L1, so that memory and
// arithmetic overlap (prefetches never fault, also past the end of a row).
template <typename T>
inline void prefetch_block(const T* p) {
  constexpr int64_t kBytes = kBlock * static_cast<int64_t>(sizeof(T));
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < kBytes; b += 64) __builtin_prefetch(c + b);
}

// f(c0, n) for the L1-sized chunks [c0, c0 + n) of a row of V elements, in order; false as soon
// as f returns false (a chunk holding NaN or +inf).
template <typename F>
inline bool for_each_chunk(int64_t V, F&& f) {
  for (int64_t c0 = 0; c0 < V; c0 += kChunk) {
    if (!f(c0, std::min(kChunk, V - c0))) return false;
  }
  return true;
}

// The next kBlock elements of a row of x and of y, minus their shifts, as two float vectors each;
// the same elements of the next chunk are requested meanwhile.
template <typename T>
inline void load_shifted(const T* x, const T* y, const VF& shx, const VF& shy, VF& dx0, VF& dx1,
                         VF& dy0, VF& dy1) {
  prefetch_block(x + kChunk);
  prefetch_block(y + kChunk);
  VF x0, x1, y0, y1;
  load2(x, x0, x1);
  load2(y, y0, y1);
  dx0 = x0 - shx;
  dx1 = x1 - shx;
  dy0 = y0 - shy;
  dy1 = y1 - shy;
}

inline double finite_or_zero(double v) { return std::isfinite(v) ? v : 0.0; }

// max that propagates NaN (like torch.amax)
inline double max_nan(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return kNaN;
  return a > b ? a : b;
}

// (delta, alpha) rescaling a state with max m to the max big: delta = (m - big)/T, 0 if equal.
inline std::pair<double, double> scales(double m, double big, double T) {
  double delta = (m == big) ? 0.0 : (m - big) / T;
  return {delta, std::exp(delta)};
}

// A sum of float vectors kept in double lanes. The kernels add float partial sums of kFlush
// blocks: a float lane summing a whole chunk (64 terms) lost ~1e-6 nats of a KL of 7.
using VD = at::vec::Vectorized<double>;
static_assert(VF::size() == 2 * VD::size(), "a float vector widens to two double vectors");
constexpr int64_t kFlush = 4;  // blocks per float partial sum

struct WideSum {
  VD lo = VD(0.0), hi = VD(0.0);
  void add(const VF& v) {
#if defined(CPU_CAPABILITY_AVX512)
    const __m512 f = v;
    lo = lo + VD(_mm512_cvtps_pd(_mm512_castps512_ps256(f)));
    hi = hi + VD(_mm512_cvtps_pd(_mm512_extractf32x8_ps(f, 1)));
#elif defined(CPU_CAPABILITY_AVX2)
    const __m256 f = v;
    lo = lo + VD(_mm256_cvtps_pd(_mm256_castps256_ps128(f)));
    hi = hi + VD(_mm256_cvtps_pd(_mm256_extractf128_ps(f, 1)));
#else
    float f[VF::size()];
    double d[VF::size()];
    v.store(f);
    for (int k = 0; k < VF::size(); ++k) d[k] = f[k];
    lo = lo + VD::loadu(d);
    hi = hi + VD::loadu(d + VD::size());
#endif
  }
  double value() const {
    double d[VD::size()];
    (lo + hi).store(d);
    double s = 0.0;
    for (int k = 0; k < VD::size(); ++k) s += d[k];
    return s;
  }
};

// e·d, a term of Σ e^u·f(u); kCareful: 0 where e = 0 (0·log 0 = 0, also for d = ±inf or NaN).
template <bool kCareful>
inline VF moment_term(const VF& e, const VF& d) {
  if constexpr (kCareful) {
    return VF::blendv(e * d, VF(0.0f), e == VF(0.0f));
  } else {
    return e * d;
  }
}

template <typename T>
inline double chunk_max(const T* p, int64_t n) {
  VF m0(-std::numeric_limits<float>::infinity()), m1 = m0;
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    VF a, b;
    load2(p + i, a, b);
    m0 = at::vec::maximum(m0, a);
    m1 = at::vec::maximum(m1, b);
  }
  float buf[VF::size()];
  at::vec::maximum(m0, m1).store(buf);
  double m = -kInf;
  for (int k = 0; k < VF::size(); ++k) m = max_nan(m, buf[k]);
  for (; i < n; ++i) m = max_nan(m, static_cast<double>(static_cast<float>(p[i])));
  return m;
}

// ------------------------------------------------------------------------------ row addressing
// Element offset of row r of a tensor whose last dimension has stride 1 (any leading strides).
struct Rows {
  std::vector<int64_t> sizes, strides;
  Rows(const at::Tensor& t) {
    for (int64_t d = 0; d + 1 < t.dim(); ++d) {
      if (t.size(d) == 1) continue;
      sizes.push_back(t.size(d));
      strides.push_back(t.stride(d));
    }
  }
  int64_t offset(int64_t r) const {
    int64_t off = 0;
    for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0 && r; --d) {
      off += (r % sizes[d]) * strides[d];
      r /= sizes[d];
    }
    return off;
  }
};

// The tensor itself if its last dimension is contiguous, else a contiguous copy.
at::Tensor unit_last_stride(const at::Tensor& t) {
  if (t.dim() == 0 || t.size(-1) <= 1 || t.stride(-1) == 1) return t;
  return t.contiguous();
}

// ------------------------------------------------------------------------------ messages
// Python spellings, so that errors read exactly like klpenalty._validation's.
std::string py_tuple(const std::vector<int64_t>& v) {
  std::ostringstream s;
  s << "(";
  for (size_t i = 0; i < v.size(); ++i) s << (i ? ", " : "") << v[i];
  if (v.size() == 1) s << ",";
  s << ")";
  return s.str();
}

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kLong: return "torch.int64";
    case at::kInt: return "torch.int32";
    case at::kShort: return "torch.int16";
    case at::kChar: return "torch.int8";
    case at::kByte: return "torch.uint8";
    case at::kUInt16: return "torch.uint16";
    case at::kUInt32: return "torch.uint32";
    case at::kUInt64: return "torch.uint64";
    default: return std::string("torch.") + c10::toString(t);
  }
}

std::string describe(const at::Tensor& t) {
  return "shape=" + py_tuple(t.sizes().vec()) + ", dtype=" + dtype_name(t.scalar_type());
}

std::vector<int64_t> unravel(int64_t flat, c10::IntArrayRef shape) {
  std::vector<int64_t> idx(shape.size());
  for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
    idx[d] = shape[d] ? flat % shape[d] : 0;
    flat = shape[d] ? flat / shape[d] : 0;
  }
  return idx;
}

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

template <typename O>
std::vector<int64_t> nan_rows(const O* result, int64_t n) {
  std::vector<int64_t> rows;
  for (int64_t r = 0; r < n; ++r)
    if (std::isnan(static_cast<double>(result[r]))) rows.push_back(r);
  return rows;
}

// klpenalty._validation.raise_if_nan: result (...) float or double; named inputs (..., V).
void raise_if_nan(const at::Tensor& result, c10::IntArrayRef leading,
                  const std::vector<std::pair<std::string, at::Tensor>>& named) {
  const std::vector<int64_t> rows =
      result.scalar_type() == at::kDouble
          ? nan_rows(result.const_data_ptr<double>(), result.numel())
          : nan_rows(result.const_data_ptr<float>(), result.numel());
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

// ------------------------------------------------------------------------------ KL rows
struct KLRow {
  double m_x = -kInf, s_x = 0.0, m_y = -kInf, s_y = 0.0, a = 0.0;  // a = Σ e^u (u − w)
  bool careful = false;  // the row needed the 0·log 0 arithmetic
  bool bad = false;      // a maximum is NaN or +inf (vector path only): redo it in double
};

// engine._rescale_moment: α·(a + shift·s), a sum Σ e^u·f(u) after u ← u + δ (the KL's a with
// shift δ_x − δ_y, the entropy's b with δ_x); 0 where the slice has no mass.
inline double rescale_moment(double s, double a, double shift, double alpha) {
  const double shift_term = s > 0 ? shift * s : 0.0;
  return alpha > 0 ? alpha * (a + shift_term) : 0.0;
}

// The engine's merge of a chunk state into the row state (kl_rescale + add), in double.
inline void merge_kl(KLRow& row, double m_x, double m_y, double T, double cs_x, double cs_y,
                     double ca) {
  // rescale the row to the new maxima; the chunk was computed against them already
  auto [dx, alpha] = scales(row.m_x, m_x, T);
  auto [dy, beta] = scales(row.m_y, m_y, T);
  row.a = rescale_moment(row.s_x, row.a, dx - dy, alpha);
  row.s_x *= alpha;
  row.s_y *= beta;
  row.m_x = m_x;
  row.m_y = m_y;
  row.s_x += cs_x;
  row.s_y += cs_y;
  row.a += ca;
}

// One row, scalar double: the engine's arithmetic over the whole row as one tile (float64
// inputs, and rows with NaN or +inf).
template <typename T>
KLRow kl_row_scalar(const T* px, const T* py, int64_t V, double T_) {
  KLRow row;
  for (int64_t j = 0; j < V; ++j) {
    row.m_x = max_nan(row.m_x, static_cast<double>(px[j]));
    row.m_y = max_nan(row.m_y, static_cast<double>(py[j]));
  }
  const double shx = finite_or_zero(row.m_x), shy = finite_or_zero(row.m_y);
  double a = 0.0;
  for (int64_t j = 0; j < V; ++j) {
    double dx = static_cast<double>(px[j]) - shx, dy = static_cast<double>(py[j]) - shy;
    double eu = std::exp(dx / T_), ew = std::exp(dy / T_);
    row.s_x += eu;
    row.s_y += ew;
    if (eu == 0.0) {  // 0·log 0 = 0, also where y = −inf
      if (!std::isfinite(dx - dy)) row.careful = true;
    } else {
      a += eu * (dx - dy);
    }
  }
  row.a = a / T_;
  return row;
}

// One row, float32 vectors, chunk by chunk. kCareful: the 0·log 0 arithmetic (e^u = 0 terms
// are dropped; without it such a term gives NaN and the caller redoes the row carefully).
template <bool kCareful, typename T>
KLRow kl_row_vec(const T* px, const T* py, int64_t V, double T_) {
  KLRow row;
  const float c = static_cast<float>(kLog2e / T_);
  const VF vc(c), zero(0.0f);
  row.bad = !for_each_chunk(V, [&](int64_t c0, int64_t n) {
    const T* x = px + c0;
    const T* y = py + c0;
    const double cm_x = chunk_max(x, n), cm_y = chunk_max(y, n);
    if (std::isnan(cm_x) || std::isnan(cm_y) || cm_x == kInf || cm_y == kInf) return false;
    const double m_x = std::max(row.m_x, cm_x), m_y = std::max(row.m_y, cm_y);
    const float shx = static_cast<float>(finite_or_zero(m_x));
    const float shy = static_cast<float>(finite_or_zero(m_y));
    const VF vsx(shx), vsy(shy);
    WideSum ws_x, ws_y, wa;
    int64_t i = 0;
    while (i + kBlock <= n) {
      VF sx0 = zero, sx1 = zero, sy0 = zero, sy1 = zero, a0 = zero, a1 = zero;
      for (int64_t b = 0; b < kFlush && i + kBlock <= n; ++b, i += kBlock) {
        VF dx0, dx1, dy0, dy1;
        load_shifted(x + i, y + i, vsx, vsy, dx0, dx1, dy0, dy1);
        VF eu0 = exp2_fast(dx0 * vc), eu1 = exp2_fast(dx1 * vc);
        VF ew0 = exp2_fast(dy0 * vc), ew1 = exp2_fast(dy1 * vc);
        sx0 = sx0 + eu0;
        sx1 = sx1 + eu1;
        sy0 = sy0 + ew0;
        sy1 = sy1 + ew1;
        a0 = a0 + moment_term<kCareful>(eu0, dx0 - dy0);
        a1 = a1 + moment_term<kCareful>(eu1, dx1 - dy1);
      }
      ws_x.add(sx0 + sx1);
      ws_y.add(sy0 + sy1);
      wa.add(a0 + a1);
    }
    double cs_x = ws_x.value(), cs_y = ws_y.value(), ca = wa.value();
    for (; i < n; ++i) {
      float dx = static_cast<float>(x[i]) - shx, dy = static_cast<float>(y[i]) - shy;
      float eu = std::exp2(dx * c), ew = std::exp2(dy * c);
      cs_x += eu;
      cs_y += ew;
      if (!kCareful || eu != 0.0f) ca += static_cast<double>(eu * (dx - dy));
    }
    merge_kl(row, m_x, m_y, T_, cs_x, cs_y, ca / T_);
    return true;
  });
  row.careful = kCareful;
  return row;
}

template <typename T>
KLRow kl_row(const T* px, const T* py, int64_t V, double T_) {
  if constexpr (std::is_same_v<T, double>) {
    return kl_row_scalar(px, py, V, T_);
  } else {
    KLRow row = kl_row_vec<false>(px, py, V, T_);
    if (row.bad) return kl_row_scalar(px, py, V, T_);
    if (!std::isfinite(row.a)) row = kl_row_vec<true>(px, py, V, T_);
    return row;
  }
}

// engine.kl_finalize for one row: writes KL and the 6 stats.
template <typename O>
void finalize_kl(const KLRow& row, O* kl, O* st) {
  const double mean_d = row.a / row.s_x;
  const double lsx = std::log(row.s_x), lsy = std::log(row.s_y);
  double v = mean_d - lsx + lsy;
  v = v < 0.0 ? 0.0 : v;  // NaN stays NaN
  const bool valid = row.s_x > 0 && std::isfinite(row.s_x) && row.s_y > 0 && std::isfinite(row.s_y);
  *kl = static_cast<O>(valid ? v : kNaN);
  st[0] = static_cast<O>(finite_or_zero(row.m_x));
  st[1] = static_cast<O>(finite_or_zero(lsx));
  st[2] = static_cast<O>(finite_or_zero(row.m_y));
  st[3] = static_cast<O>(finite_or_zero(lsy));
  st[4] = static_cast<O>(mean_d);
  st[5] = static_cast<O>((!valid || !std::isfinite(mean_d) || row.careful) ? 1.0 : 0.0);
}

int64_t grain_rows(int64_t V) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(V, 1)); }

// f(r0, r1) over blocks of rows, in one parallel region whose threads take the next block from
// a shared counter: on a busy machine a descheduled thread delays only the block it holds,
// where a static split would make every other thread wait for its whole share.
template <typename F>
void parallel_rows(int64_t N, int64_t V, const F& f) {
  const int64_t block = grain_rows(V);
  const int64_t blocks = (N + block - 1) / block;
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), blocks);
  if (workers <= 1) {
    if (N > 0) f(0, N);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t b = next.fetch_add(1); b < blocks; b = next.fetch_add(1)) {
      f(b * block, std::min(N, (b + 1) * block));
    }
  });
}

// ------------------------------------------------------------------------------ arg checks
void check_logits_arg(const char* name, const at::Tensor& t) {
  TORCH_CHECK_TYPE(t.is_floating_point(), name, " must be a floating-point tensor (..., V), got ",
                   describe(t));
  TORCH_CHECK_VALUE(t.dim() >= 1 && t.size(-1) >= 1, name,
                    " must have shape (..., V) with V >= 1, got ", describe(t));
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor for the native backend, got ",
                    t.device());
}

void check_temperature(double T) {
  TORCH_CHECK_VALUE(std::isfinite(T) && T > 0, "temperature must be finite and > 0, got ", T);
}

at::ScalarType compute_dtype(const at::Tensor& a, const at::Tensor& b) {
  return (a.scalar_type() == at::kDouble || b.scalar_type() == at::kDouble) ? at::kDouble
                                                                             : at::kFloat;
}

std::vector<int64_t> leading_of(const at::Tensor& t) {
  auto s = t.sizes().vec();
  s.pop_back();
  return s;
}

// A (...) bool mask as a flat contiguous tensor, checked against the leading dims.
at::Tensor flat_mask(const std::optional<at::Tensor>& mask, c10::IntArrayRef leading) {
  if (!mask.has_value()) return at::Tensor();
  const at::Tensor& m = *mask;
  TORCH_CHECK_TYPE(m.scalar_type() == at::kBool,
                   "mask must be a bool tensor (True = position counts), got ", describe(m));
  TORCH_CHECK_VALUE(m.sizes() == leading, "mask must have shape ", py_tuple(leading.vec()),
                    " (the leading dims of the logits), got ", describe(m));
  return m.contiguous();
}

// A backward op's upstream gradient (...) and stats (..., cols), checked, in contiguous double.
std::pair<at::Tensor, at::Tensor> backward_inputs(const at::Tensor& grad, const at::Tensor& stats,
                                                  const std::vector<int64_t>& leading,
                                                  int64_t cols, int64_t N) {
  TORCH_CHECK_VALUE(grad.sizes() == c10::IntArrayRef(leading), "grad must have shape ",
                    py_tuple(leading), ", got ", describe(grad));
  at::Tensor st = stats.to(at::kDouble).contiguous();
  TORCH_CHECK_VALUE(st.numel() == cols * N, "stats must have shape (..., ", cols, "), got ",
                    describe(stats));
  return {grad.to(at::kDouble).contiguous(), st};
}

// The forward outputs: result (...) and stats (..., cols) in dtype.
std::pair<at::Tensor, at::Tensor> forward_outputs(std::vector<int64_t> leading, int64_t cols,
                                                  const at::TensorOptions& options) {
  at::Tensor result = at::empty(leading, options);
  leading.push_back(cols);
  return {result, at::empty(leading, options)};
}

// run(result_ptr, stats_ptr) with the pointers typed as the outputs' dtype (float or double).
template <typename F>
void with_output_ptrs(at::Tensor& result, at::Tensor& stats, F&& run) {
  if (result.scalar_type() == at::kDouble) {
    run(result.mutable_data_ptr<double>(), stats.mutable_data_ptr<double>());
  } else {
    run(result.mutable_data_ptr<float>(), stats.mutable_data_ptr<float>());
  }
}

// f(r, result + r, stats + cols·r) for every row r, in parallel, with the pointers typed as the
// outputs' dtype. Rows where skip(r) (masked rows, ignored tokens) are not computed: result 0
// and stats 0 whatever the row holds; no gradient will be asked of them.
template <typename Skip, typename F>
void forward_rows(at::Tensor& result, at::Tensor& stats, int64_t cols, int64_t N, int64_t V,
                  const Skip& skip, const F& f) {
  with_output_ptrs(result, stats, [&](auto* res, auto* stp) {
    using O = std::remove_pointer_t<decltype(res)>;
    parallel_rows(N, V, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        if (skip(r)) {
          res[r] = O(0);
          std::fill(stp + cols * r, stp + cols * (r + 1), O(0));
        } else {
          f(r, res + r, stp + cols * r);
        }
      }
    });
  });
}

// ------------------------------------------------------------------------------ full KL ops
std::tuple<at::Tensor, at::Tensor> full_kl(const at::Tensor& x_in, const at::Tensor& y_in,
                                           const std::optional<at::Tensor>& mask, double T,
                                           bool check, int64_t /*tile_rows*/,
                                           int64_t /*tile_cols*/) {
  check_logits_arg("policy_logits", x_in);
  check_logits_arg("ref_logits", y_in);
  TORCH_CHECK_VALUE(x_in.sizes() == y_in.sizes(),
                    "policy_logits and ref_logits must have the same shape (..., V): policy_logits ",
                    describe(x_in), ", ref_logits ", describe(y_in));
  check_temperature(T);
  const at::ScalarType out_t = compute_dtype(x_in, y_in);
  // mixed input dtypes: computed on copies in the compute dtype (a rare case)
  at::Tensor x = unit_last_stride(x_in), y = unit_last_stride(y_in);
  if (x.scalar_type() != y.scalar_type()) {
    x = x.to(out_t);
    y = y.to(out_t);
  }
  const auto leading = leading_of(x);
  const int64_t V = x.size(-1), N = x.numel() / V;
  at::Tensor m = flat_mask(mask, leading);
  auto [kl, stats] = forward_outputs(leading, 6, x.options().dtype(out_t));
  const bool* mp = m.defined() ? m.const_data_ptr<bool>() : nullptr;
  const Rows rx(x), ry(y);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "native_full_kl", [&] {
    using T_in = scalar_t;
    const T_in* px = x.const_data_ptr<T_in>();
    const T_in* py = y.const_data_ptr<T_in>();
    const auto masked = [&](int64_t r) { return mp && !mp[r]; };
    forward_rows(kl, stats, 6, N, V, masked, [&](int64_t r, auto* res, auto* st) {
      finalize_kl(kl_row(px + rx.offset(r), py + ry.offset(r), V, T), res, st);
    });
  });
  if (check) raise_if_nan(kl, leading, {{"policy_logits", x_in}, {"ref_logits", y_in}});
  return {kl, stats};
}

// Gradient of one row, scalar double with the careful rules (float64, or any flagged row of
// a float64 computation).
template <typename T>
void kl_grad_row_scalar(const T* px, const T* py, const double* st, double g, double T_, T* gx,
                        T* gy, int64_t V) {
  const double shx = st[0], lsx = st[1], shy = st[2], lsy = st[3], md = st[4];
  for (int64_t j = 0; j < V; ++j) {
    const double dx = static_cast<double>(px[j]) - shx, dy = static_cast<double>(py[j]) - shy;
    const double p = std::exp(dx / T_ - lsx);
    if (gx) {
      double v = p * ((dx - dy) - md * T_) * (g / (T_ * T_));
      gx[j] = static_cast<T>(p == 0.0 ? 0.0 : v);
    }
    if (gy) {
      double q = std::exp(dy / T_ - lsy) - p;
      gy[j] = static_cast<T>(std::isnan(q) ? 0.0 : q * (g / T_));
    }
  }
}

// Gradient of one row, float32 vectors: gx = π·((u − w) − E_π[u − w])·g/T, gy = (ρ − π)·g/T.
template <bool kCareful, typename T>
void kl_grad_row_vec(const T* px, const T* py, const double* st, double g, double T_, T* gx,
                     T* gy, int64_t V) {
  const float shx = static_cast<float>(st[0]), shy = static_cast<float>(st[2]);
  const float c = static_cast<float>(kLog2e / T_);
  const float bx = static_cast<float>(-st[1] * kLog2e), by = static_cast<float>(-st[3] * kLog2e);
  const float tmd = static_cast<float>(st[4] * T_);
  const float sgx = static_cast<float>(g / (T_ * T_)), sgy = static_cast<float>(g / T_);
  const VF vsx(shx), vsy(shy), vc(c), vbx(bx), vby(by), vtmd(tmd), vsgx(sgx), vsgy(sgy), zero(0.0f);
  int64_t i = 0;
  for (; i + kBlock <= V; i += kBlock) {
    VF dx0, dx1, dy0, dy1;
    load_shifted(px + i, py + i, vsx, vsy, dx0, dx1, dy0, dy1);
    VF p0 = exp2_fast(at::vec::fmadd(dx0, vc, vbx)), p1 = exp2_fast(at::vec::fmadd(dx1, vc, vbx));
    if (gx) {
      VF v0 = p0 * ((dx0 - dy0) - vtmd) * vsgx, v1 = p1 * ((dx1 - dy1) - vtmd) * vsgx;
      if constexpr (kCareful) {
        v0 = VF::blendv(v0, zero, p0 == zero);
        v1 = VF::blendv(v1, zero, p1 == zero);
      }
      store2(gx + i, v0, v1);
    }
    if (gy) {
      VF q0 = exp2_fast(at::vec::fmadd(dy0, vc, vby)) - p0;
      VF q1 = exp2_fast(at::vec::fmadd(dy1, vc, vby)) - p1;
      VF v0 = q0 * vsgy, v1 = q1 * vsgy;
      if constexpr (kCareful) {
        v0 = VF::blendv(v0, zero, q0 != q0);
        v1 = VF::blendv(v1, zero, q1 != q1);
      }
      store2(gy + i, v0, v1);
    }
  }
  for (; i < V; ++i) {
    float dx = static_cast<float>(px[i]) - shx, dy = static_cast<float>(py[i]) - shy;
    float p = std::exp2(dx * c + bx);
    if (gx) {
      float v = p * ((dx - dy) - tmd) * sgx;
      gx[i] = static_cast<T>((kCareful && p == 0.0f) ? 0.0f : v);
    }
    if (gy) {
      float q = std::exp2(dy * c + by) - p;
      gy[i] = static_cast<T>((kCareful && std::isnan(q)) ? 0.0f : q * sgy);
    }
  }
}

std::tuple<at::Tensor, at::Tensor> full_kl_backward(
    const at::Tensor& grad, const at::Tensor& x_in, const at::Tensor& y_in, const at::Tensor& stats,
    const std::optional<at::Tensor>& mask, double T, bool need_x, bool need_y,
    int64_t /*tile_rows*/, int64_t /*tile_cols*/) {
  check_logits_arg("policy_logits", x_in);
  check_logits_arg("ref_logits", y_in);
  check_temperature(T);
  const at::ScalarType ct = compute_dtype(x_in, y_in);
  at::Tensor x = unit_last_stride(x_in), y = unit_last_stride(y_in);
  const bool mixed = x.scalar_type() != y.scalar_type();
  if (mixed) {
    x = x.to(ct);
    y = y.to(ct);
  }
  const auto leading = leading_of(x);
  const int64_t V = x.size(-1), N = x.numel() / V;
  at::Tensor m = flat_mask(mask, leading);
  const auto [g, st] = backward_inputs(grad, stats, leading, 6, N);
  at::Tensor gx = need_x ? at::empty(x.sizes(), x.options()) : at::empty({0}, x_in.options());
  at::Tensor gy = need_y ? at::empty(y.sizes(), y.options()) : at::empty({0}, y_in.options());
  const bool* mp = m.defined() ? m.const_data_ptr<bool>() : nullptr;
  const double* gp = g.const_data_ptr<double>();
  const double* sp = st.const_data_ptr<double>();
  const Rows rx(x), ry(y);
  if (need_x || need_y) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "native_full_kl_bwd", [&] {
      using T_in = scalar_t;
      const T_in* px = x.const_data_ptr<T_in>();
      const T_in* py = y.const_data_ptr<T_in>();
      T_in* gxp = need_x ? gx.mutable_data_ptr<T_in>() : nullptr;
      T_in* gyp = need_y ? gy.mutable_data_ptr<T_in>() : nullptr;
      parallel_rows(N, V, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          T_in* gxr = gxp ? gxp + r * V : nullptr;
          T_in* gyr = gyp ? gyp + r * V : nullptr;
          const double gr = (mp && !mp[r]) ? 0.0 : gp[r];
          if (gr == 0.0) {  // masked (garbage allowed) or no upstream gradient: exactly 0
            if (gxr) std::fill(gxr, gxr + V, T_in(0));
            if (gyr) std::fill(gyr, gyr + V, T_in(0));
            continue;
          }
          const T_in* xr = px + rx.offset(r);
          const T_in* yr = py + ry.offset(r);
          const double* s = sp + 6 * r;
          if constexpr (std::is_same_v<T_in, double>) {
            kl_grad_row_scalar(xr, yr, s, gr, T, gxr, gyr, V);
          } else if (s[5] != 0.0) {
            kl_grad_row_vec<true>(xr, yr, s, gr, T, gxr, gyr, V);
          } else {
            kl_grad_row_vec<false>(xr, yr, s, gr, T, gxr, gyr, V);
          }
        }
      });
    });
  }
  if (mixed) {
    if (need_x) gx = gx.to(x_in.scalar_type());
    if (need_y) gy = gy.to(y_in.scalar_type());
  }
  return {gx, gy};
}

// ------------------------------------------------------------------------------ LSE rows
// The log-sum-exp state of a row and, for the entropy (kMoment), b = Σ e^u·u (0·log 0 = 0).
struct LSERow {
  double m = -kInf, s = 0.0, b = 0.0;
  bool bad = false;  // a maximum is NaN or +inf (vector path only): redo it in double
};

template <bool kMoment, typename T>
LSERow lse_row_scalar(const T* px, int64_t V, double T_) {
  LSERow row;
  for (int64_t j = 0; j < V; ++j) row.m = max_nan(row.m, static_cast<double>(px[j]));
  const double sh = finite_or_zero(row.m);
  double b = 0.0;
  for (int64_t j = 0; j < V; ++j) {
    const double d = static_cast<double>(px[j]) - sh, e = std::exp(d / T_);
    row.s += e;
    if (kMoment && e != 0.0) b += e * d;  // 0·log 0 = 0
  }
  row.b = b / T_;
  return row;
}

// One row, float32 vectors, chunk by chunk. kCareful (with kMoment): e^u = 0 terms of b are
// dropped; without it a −inf logit gives NaN and the caller redoes the row carefully.
template <bool kMoment, bool kCareful, typename T>
LSERow lse_row_vec(const T* px, int64_t V, double T_) {
  LSERow row;
  const float c = static_cast<float>(kLog2e / T_);
  const VF vc(c), zero(0.0f);
  row.bad = !for_each_chunk(V, [&](int64_t c0, int64_t n) {
    const T* x = px + c0;
    const double cm = chunk_max(x, n);
    if (std::isnan(cm) || cm == kInf) return false;
    const double m = std::max(row.m, cm);
    const float sh = static_cast<float>(finite_or_zero(m));
    const VF vsh(sh);
    WideSum ws, wb;
    int64_t i = 0;
    while (i + kBlock <= n) {
      VF s0 = zero, s1 = zero, b0 = zero, b1 = zero;
      for (int64_t k = 0; k < kFlush && i + kBlock <= n; ++k, i += kBlock) {
        prefetch_block(x + kChunk + i);
        VF x0, x1;
        load2(x + i, x0, x1);
        const VF d0 = x0 - vsh, d1 = x1 - vsh;
        const VF e0 = exp2_fast(d0 * vc), e1 = exp2_fast(d1 * vc);
        s0 = s0 + e0;
        s1 = s1 + e1;
        if constexpr (kMoment) {
          b0 = b0 + moment_term<kCareful>(e0, d0);
          b1 = b1 + moment_term<kCareful>(e1, d1);
        }
      }
      ws.add(s0 + s1);
      if constexpr (kMoment) wb.add(b0 + b1);
    }
    double cs = ws.value(), cb = kMoment ? wb.value() : 0.0;
    for (; i < n; ++i) {
      const float d = static_cast<float>(x[i]) - sh, e = std::exp2(d * c);
      cs += e;
      if (kMoment && (!kCareful || e != 0.0f)) cb += static_cast<double>(e * d);
    }
    const auto [delta, alpha] = scales(row.m, m, T_);
    if constexpr (kMoment) row.b = rescale_moment(row.s, row.b, delta, alpha) + cb / T_;
    row.s = row.s * alpha + cs;
    row.m = m;
    return true;
  });
  return row;
}

// NaN or +inf: the engine's rules in double; float64: the scalar double path.
template <bool kMoment, typename T>
LSERow lse_row(const T* px, int64_t V, double T_) {
  if constexpr (std::is_same_v<T, double>) {
    return lse_row_scalar<kMoment>(px, V, T_);
  } else {
    LSERow row = lse_row_vec<kMoment, false>(px, V, T_);
    if (row.bad) return lse_row_scalar<kMoment>(px, V, T_);
    if (kMoment && !std::isfinite(row.b)) row = lse_row_vec<kMoment, true>(px, V, T_);
    return row;
  }
}

// ------------------------------------------------------------------------------ token ops
at::Tensor flat_tokens(const at::Tensor& tokens, c10::IntArrayRef leading) {
  TORCH_CHECK_TYPE(!tokens.is_floating_point() && !tokens.is_complex() &&
                       tokens.scalar_type() != at::kBool,
                   "tokens must be an integer tensor, got ", describe(tokens));
  TORCH_CHECK_VALUE(tokens.sizes() == leading, "tokens must have shape ", py_tuple(leading.vec()),
                    " (the leading dims of the logits), got ", describe(tokens));
  return tokens.to(at::kLong).contiguous();
}

// The checked arguments of a single-logits op: the logits with a unit last stride, their
// leading dims, V and N.
struct LogitsArgs {
  at::Tensor x;
  std::vector<int64_t> leading;
  int64_t V, N;
  LogitsArgs(const at::Tensor& x_in, double T) {
    check_logits_arg("logits", x_in);
    check_temperature(T);
    x = unit_last_stride(x_in);
    leading = leading_of(x);
    V = x.size(-1);
    N = x.numel() / V;
  }
};

// ... and the tokens as a flat contiguous int64 tensor.
struct TokenArgs : LogitsArgs {
  at::Tensor tok;
  TokenArgs(const at::Tensor& x_in, const at::Tensor& tokens, double T) : LogitsArgs(x_in, T) {
    tok = flat_tokens(tokens, leading);
  }
};

std::tuple<at::Tensor, at::Tensor> token_logprobs(const at::Tensor& x_in, const at::Tensor& tokens,
                                                  double T, int64_t ignore_index, bool check,
                                                  int64_t /*tile_rows*/, int64_t /*tile_cols*/) {
  const TokenArgs args(x_in, tokens, T);
  const at::Tensor& x = args.x;
  const auto& leading = args.leading;
  const int64_t V = args.V, N = args.N;
  const int64_t* tp = args.tok.const_data_ptr<int64_t>();
  if (check) check_token_range(tokens, tp, N, V, ignore_index);
  for (int64_t r = 0; r < N; ++r) {  // never read outside a row, even with check=False
    TORCH_CHECK_INDEX(tp[r] == ignore_index || (tp[r] >= 0 && tp[r] < V), "token ", tp[r],
                      " at flat position ", r, " is out of range for a vocabulary of ", V);
  }
  const at::ScalarType out_t = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  auto [out, stats] = forward_outputs(leading, 3, x.options().dtype(out_t));
  const Rows rx(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "native_token_logprobs", [&] {
    using T_in = scalar_t;
    const T_in* px = x.const_data_ptr<T_in>();
    const auto ignored = [&](int64_t r) { return tp[r] == ignore_index; };
    forward_rows(out, stats, 3, N, V, ignored, [&](int64_t r, auto* res, auto* st) {
      using O = std::remove_pointer_t<decltype(res)>;
      const T_in* xr = px + rx.offset(r);
      const LSERow row = lse_row<false>(xr, V, T);
      const double shift = finite_or_zero(row.m), log_s = std::log(row.s);
      // (x_t − m)/T − log s: exact for nearby logits at any offset; no distribution: NaN
      double v = (static_cast<double>(xr[tp[r]]) - shift) / T - log_s;
      if (row.s == 0.0) v = kNaN;
      *res = static_cast<O>(v);
      st[0] = static_cast<O>(shift);
      st[1] = static_cast<O>(finite_or_zero(log_s));
      st[2] = static_cast<O>(v);
    });
  });
  if (check) raise_if_nan(out, leading, {{"logits", x_in}});
  return {out, stats};
}

// −π·g/T over a row (the caller adds the token term); kMoment: the entropy's
// −π·(u − E_π[u])·g/T, 0 where π = 0 (0·log 0, −inf logits).
template <bool kMoment, typename T>
void lse_grad_row(const T* px, double shift, double log_s, double mean_u, double g, double T_,
                  T* gx, int64_t V) {
  // with d = x − shift = T·u: kMoment gives π·(d − T·E_π[u])·(−g/T²), else π·(−g/T)
  const double tm = kMoment ? mean_u * T_ : 0.0, sg = kMoment ? -g / (T_ * T_) : -g / T_;
  if constexpr (std::is_same_v<T, double>) {
    for (int64_t j = 0; j < V; ++j) {
      const double d = px[j] - shift, p = std::exp(d / T_ - log_s);
      gx[j] = kMoment ? (p == 0.0 ? 0.0 : p * (d - tm) * sg) : p * sg;
    }
  } else {
    const float sh = static_cast<float>(shift), c = static_cast<float>(kLog2e / T_);
    const float b = static_cast<float>(-log_s * kLog2e), ftm = static_cast<float>(tm);
    const float fsg = static_cast<float>(sg);
    const VF vsh(sh), vc(c), vb(b), vtm(ftm), vsg(fsg), zero(0.0f);
    auto term = [&](const VF& x) {
      const VF d = x - vsh, p = exp2_fast(at::vec::fmadd(d, vc, vb));
      if constexpr (kMoment) return VF::blendv(p * (d - vtm) * vsg, zero, p == zero);
      else return p * vsg;
    };
    int64_t i = 0;
    for (; i + kBlock <= V; i += kBlock) {
      prefetch_block(px + kChunk + i);
      VF x0, x1;
      load2(px + i, x0, x1);
      store2(gx + i, term(x0), term(x1));
    }
    for (; i < V; ++i) {
      const float d = static_cast<float>(px[i]) - sh, p = std::exp2(d * c + b);
      gx[i] = static_cast<T>(kMoment ? (p == 0.0f ? 0.0f : p * (d - ftm) * fsg) : p * fsg);
    }
  }
}

// The gradient (..., V) of a single-logits op from its upstream gradient and stats (..., cols):
// row(x_r, out_r, stats_r, g_r, r) for every row whose weighted gradient g_r = weight(r, grad_r)
// is nonzero; the other rows (masked or ignored, garbage allowed) are exactly 0.
template <typename W, typename F>
at::Tensor backward_rows(const LogitsArgs& args, const at::Tensor& grad, const at::Tensor& stats,
                         int64_t cols, const W& weight, const F& row) {
  const at::Tensor& x = args.x;
  const int64_t V = args.V, N = args.N;
  const auto [g, st] = backward_inputs(grad, stats, args.leading, cols, N);
  at::Tensor gx = at::empty(x.sizes(), x.options());
  const double* gp = g.const_data_ptr<double>();
  const double* sp = st.const_data_ptr<double>();
  const Rows rx(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "native_backward_rows", [&] {
    using T_in = scalar_t;
    const T_in* px = x.const_data_ptr<T_in>();
    T_in* gxp = gx.mutable_data_ptr<T_in>();
    parallel_rows(N, V, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        T_in* out = gxp + r * V;
        const double gr = weight(r, gp[r]);
        if (gr == 0.0) {
          std::fill(out, out + V, T_in(0));
          continue;
        }
        row(px + rx.offset(r), out, sp + cols * r, gr, r);
      }
    });
  });
  return gx;
}

at::Tensor token_logprobs_backward(const at::Tensor& grad, const at::Tensor& x_in,
                                   const at::Tensor& tokens, const at::Tensor& stats, double T,
                                   int64_t ignore_index, int64_t /*tile_rows*/,
                                   int64_t /*tile_cols*/) {
  const TokenArgs args(x_in, tokens, T);
  const int64_t V = args.V;
  const int64_t* tp = args.tok.const_data_ptr<int64_t>();
  return backward_rows(
      args, grad, stats, 3, [&](int64_t r, double g) { return tp[r] == ignore_index ? 0.0 : g; },
      [&](const auto* xr, auto* out, const double* s, double gr, int64_t r) {
        using O = std::remove_pointer_t<decltype(out)>;
        TORCH_CHECK_INDEX(tp[r] >= 0 && tp[r] < V, "token ", tp[r], " at flat position ", r,
                          " is out of range for a vocabulary of ", V);
        lse_grad_row<false>(xr, s[0], s[1], 0.0, gr, T, out, V);
        // at the token: (1 − π_t)·g/T = −expm1(log π_t)·g/T, exact for π_t near 1
        out[tp[r]] = static_cast<O>(-std::expm1(s[2]) * gr / T);
      });
}

// ------------------------------------------------------------------------------ entropy ops
// engine.entropy_finalize for one row: writes H and the 3 stats (shift, log s, E_π[u]).
template <typename O>
void finalize_entropy(const LSERow& row, O* h, O* st) {
  const double mean_u = row.b / row.s, log_s = std::log(row.s);
  double v = log_s - mean_u;
  v = v < 0.0 ? 0.0 : v;  // NaN stays NaN
  const bool valid = row.s > 0 && std::isfinite(row.s);
  *h = static_cast<O>(valid ? v : kNaN);
  st[0] = static_cast<O>(finite_or_zero(row.m));
  st[1] = static_cast<O>(finite_or_zero(log_s));
  st[2] = static_cast<O>(mean_u);
}

std::tuple<at::Tensor, at::Tensor> entropy(const at::Tensor& x_in,
                                           const std::optional<at::Tensor>& mask, double T,
                                           bool check, int64_t /*tile_rows*/,
                                           int64_t /*tile_cols*/) {
  const LogitsArgs args(x_in, T);
  const at::Tensor& x = args.x;
  const auto& leading = args.leading;
  const int64_t V = args.V, N = args.N;
  at::Tensor m = flat_mask(mask, leading);
  const at::ScalarType out_t = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  auto [h, stats] = forward_outputs(leading, 3, x.options().dtype(out_t));
  const bool* mp = m.defined() ? m.const_data_ptr<bool>() : nullptr;
  const Rows rx(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "native_entropy", [&] {
    using T_in = scalar_t;
    const T_in* px = x.const_data_ptr<T_in>();
    const auto masked = [&](int64_t r) { return mp && !mp[r]; };
    forward_rows(h, stats, 3, N, V, masked, [&](int64_t r, auto* res, auto* st) {
      finalize_entropy(lse_row<true>(px + rx.offset(r), V, T), res, st);
    });
  });
  if (check) raise_if_nan(h, leading, {{"logits", x_in}});
  return {h, stats};
}

at::Tensor entropy_backward(const at::Tensor& grad, const at::Tensor& x_in,
                            const at::Tensor& stats, const std::optional<at::Tensor>& mask,
                            double T, int64_t /*tile_rows*/, int64_t /*tile_cols*/) {
  const LogitsArgs args(x_in, T);
  const at::Tensor m = flat_mask(mask, args.leading);
  const bool* mp = m.defined() ? m.const_data_ptr<bool>() : nullptr;
  return backward_rows(
      args, grad, stats, 3, [&](int64_t r, double g) { return (mp && !mp[r]) ? 0.0 : g; },
      [&](const auto* xr, auto* out, const double* s, double gr, int64_t) {
        lse_grad_row<true>(xr, s[0], s[1], s[2], gr, T, out, args.V);
      });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(klpenalty, m) {
  m.def(
      "native_full_kl(Tensor x, Tensor y, Tensor? mask, float temperature, bool check, "
      "int tile_rows, int tile_cols) -> (Tensor, Tensor)");
  m.def(
      "native_full_kl_backward(Tensor grad, Tensor x, Tensor y, Tensor stats, Tensor? mask, "
      "float temperature, bool need_x, bool need_y, int tile_rows, int tile_cols) -> "
      "(Tensor, Tensor)");
  m.def(
      "native_token_logprobs(Tensor x, Tensor tokens, float temperature, int ignore_index, "
      "bool check, int tile_rows, int tile_cols) -> (Tensor, Tensor)");
  m.def(
      "native_token_logprobs_backward(Tensor grad, Tensor x, Tensor tokens, Tensor stats, "
      "float temperature, int ignore_index, int tile_rows, int tile_cols) -> Tensor");
  m.def(
      "native_entropy(Tensor x, Tensor? mask, float temperature, bool check, int tile_rows, "
      "int tile_cols) -> (Tensor, Tensor)");
  m.def(
      "native_entropy_backward(Tensor grad, Tensor x, Tensor stats, Tensor? mask, "
      "float temperature, int tile_rows, int tile_cols) -> Tensor");
}

TORCH_LIBRARY_IMPL(klpenalty, CPU, m) {
  m.impl("native_full_kl", &full_kl);
  m.impl("native_full_kl_backward", &full_kl_backward);
  m.impl("native_token_logprobs", &token_logprobs);
  m.impl("native_token_logprobs_backward", &token_logprobs_backward);
  m.impl("native_entropy", &entropy);
  m.impl("native_entropy_backward", &entropy_backward);
}

}  // namespace klpenalty_native
