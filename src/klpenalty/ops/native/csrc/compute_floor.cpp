// The benchmark's op (not part of the contract; its schema is defined in
// klpenalty/ops/native/__init__.py):
//   native_compute_floor(x, y, pairs, chains) -> float
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <type_traits>

#include "rows.h"
#include "simd.h"
#include "walk.h"

namespace klpenalty_native {
namespace {

// The forward's arithmetic without its memory traffic: the one-pass walk's chunk sums of the KL
// (two exps, three sums and both maxima per element pair, U vectors per input in flight) over
// one L1-resident tile x, y (n elements each, a chunk), repeated until `pairs` element pairs are
// done, each walk's sums added in double as the walk merges a chunk. Returns their total, which
// keeps the work observable; `klpenalty bench` times it.
template <int U, typename T>
double floor_walks(const T* x, const T* y, int64_t n, int64_t walks, float c) {
  const float sh_x = static_cast<float>(chunk_max(x, n)), sh_y = static_cast<float>(chunk_max(y, n));
  double total = 0.0;
  for (int64_t w = 0; w < walks; ++w) {
    asm volatile("" ::: "memory");  // every walk reads the tile again
    const ChunkSums cs = chunk_sums<U, true, false, false, true, 0>(x, y, n, sh_x, sh_y, c);
    total += cs.s_x + cs.s_y + cs.a + cs.max_x + cs.max_y;
  }
  return total;
}

double compute_floor(const at::Tensor& x, const at::Tensor& y, int64_t pairs, int64_t chains) {
  const auto st = x.scalar_type();
  TORCH_CHECK_TYPE(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf,
                   "x must be a float32, bfloat16 or float16 tensor, got ", describe(x));
  TORCH_CHECK_TYPE(y.scalar_type() == st, "y must have the dtype of x (", dtype_name(st),
                   "), got ", describe(y));
  TORCH_CHECK_VALUE(x.dim() == 1 && x.numel() >= 1 && x.is_contiguous() && x.device().is_cpu(),
                    "x must be a contiguous 1-D CPU tensor with at least one element, got ",
                    describe(x));
  TORCH_CHECK_VALUE(y.sizes() == x.sizes() && y.is_contiguous() && y.device().is_cpu(),
                    "y must be a contiguous CPU tensor of the shape of x ", py_tuple(x.sizes().vec()),
                    ", got ", describe(y));
  TORCH_CHECK_VALUE(pairs >= 0, "pairs must be >= 0, got ", pairs);
  TORCH_CHECK_VALUE(chains == 1 || chains == 2 || chains == 4 || chains == 8,
                    "chains must be 1, 2, 4 or 8, got ", chains);
  const int64_t n = x.numel(), walks = (pairs + n - 1) / n;
  const float c = static_cast<float>(kLog2e);
  double total = 0.0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, st, "native_compute_floor", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      const scalar_t* px = x.const_data_ptr<scalar_t>();
      const scalar_t* py = y.const_data_ptr<scalar_t>();
      switch (chains) {
        case 1: total = floor_walks<1>(px, py, n, walks, c); break;
        case 2: total = floor_walks<2>(px, py, n, walks, c); break;
        case 4: total = floor_walks<4>(px, py, n, walks, c); break;
        default: total = floor_walks<8>(px, py, n, walks, c); break;
      }
    }
  });
  return total;
}

}  // namespace

TORCH_LIBRARY_IMPL(klpenalty, CPU, m) {
  m.impl("native_compute_floor", &compute_floor);
}

}  // namespace klpenalty_native
