// What every op of the extension shares around its rows: the addressing of row r of a (..., V)
// tensor at any leading strides (Rows), the loop over blocks of rows in one parallel region
// (parallel_rows, grain_rows), the argument checks of the logits and the temperature, and the
// Python spellings of shapes and dtypes, so that errors read exactly like
// klpenalty._validation's.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

namespace klpenalty_native {
namespace {  // each source its own copies (internal linkage), inlined freely

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
inline at::Tensor unit_last_stride(const at::Tensor& t) {
  if (t.dim() == 0 || t.size(-1) <= 1 || t.stride(-1) == 1) return t;
  return t.contiguous();
}

// ------------------------------------------------------------------------------ rows in parallel
constexpr int64_t kGrainElements = 1 << 16;  // work per parallel task, in elements

// Rows per block of parallel_rows where the rows are many (kBlocksPerThread blocks a thread
// still): a walk requests the next row of its block into L2 (its logits for the sampler's
// passes, its kept ids), so the first row of a block starts from memory (at V = 32000 and
// 2 rows a block, every other row did).
constexpr int64_t kBlockRows = 8;
constexpr int64_t kBlocksPerThread = 8;

// Rows per parallel task for rows of V elements.
inline int64_t grain_rows(int64_t V) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(V, 1));
}

// f(r0, r1) over blocks of rows (grain_rows(V), up to kBlockRows where each thread still gets
// kBlocksPerThread blocks), in one parallel region whose threads take the next block from
// a shared counter: on a busy machine a descheduled thread delays only the block it holds,
// where a static split would make every other thread wait for its whole share.
template <typename F>
inline void parallel_rows(int64_t N, int64_t V, const F& f) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t block =
      std::max(grain_rows(V), std::min<int64_t>(kBlockRows, N / (kBlocksPerThread * threads)));
  const int64_t blocks = (N + block - 1) / block;
  const int64_t workers = std::min<int64_t>(threads, blocks);
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

// ------------------------------------------------------------------------------ messages
// Python spellings, so that errors read exactly like klpenalty._validation's.
inline std::string py_tuple(const std::vector<int64_t>& v) {
  std::ostringstream s;
  s << "(";
  for (size_t i = 0; i < v.size(); ++i) s << (i ? ", " : "") << v[i];
  if (v.size() == 1) s << ",";
  s << ")";
  return s.str();
}

inline std::string dtype_name(at::ScalarType t) {
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

inline std::string describe(const at::Tensor& t) {
  return "shape=" + py_tuple(t.sizes().vec()) + ", dtype=" + dtype_name(t.scalar_type());
}

inline std::vector<int64_t> unravel(int64_t flat, c10::IntArrayRef shape) {
  std::vector<int64_t> idx(shape.size());
  for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
    idx[d] = shape[d] ? flat % shape[d] : 0;
    flat = shape[d] ? flat / shape[d] : 0;
  }
  return idx;
}

// ------------------------------------------------------------------------------ argument checks
inline void check_logits_arg(const char* name, const at::Tensor& t) {
  TORCH_CHECK_TYPE(t.is_floating_point(), name, " must be a floating-point tensor (..., V), got ",
                   describe(t));
  TORCH_CHECK_VALUE(t.dim() >= 1 && t.size(-1) >= 1, name,
                    " must have shape (..., V) with V >= 1, got ", describe(t));
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor for the native backend, got ",
                    t.device());
}

inline void check_temperature(double T) {
  TORCH_CHECK_VALUE(std::isfinite(T) && T > 0, "temperature must be finite and > 0, got ", T);
}

inline std::vector<int64_t> leading_of(const at::Tensor& t) {
  auto s = t.sizes().vec();
  s.pop_back();
  return s;
}

}  // namespace
}  // namespace klpenalty_native
