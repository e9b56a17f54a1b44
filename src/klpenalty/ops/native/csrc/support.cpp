// An inference engine's kept sets as the support of the token_stats op: the fast form of
// klpenalty.sampling.support_from_ids (whose torch code is the portable statement of the same
// rule). Not part of the contract; its schema is defined in klpenalty/ops/native/__init__.py:
//
//   native_support_from_ids(x (..., V), ids (K,), offsets (N + 1,), chunk_rows (unused))
//     -> (tau (N,), exact (N,) bool)
//
// Row r (of the N = prod(leading dims) rows, row-major) keeps ids[offsets[r]:offsets[r + 1]];
// the rule per row (tau_r, the smallest logit at those ids, and whether the set is
// {v : x_v >= tau_r}) and its one pass over the row are ids.h's, which the forward
// (native_token_stats given ids and offsets) applies in its own pass over each row. Rows in
// parallel (at::parallel_for).
//
// ids and offsets: int32 or int64 (the public callers convert other integer dtypes); the Python
// caller validates them (sampling._check_compact) and this kernel checks them again before any
// read they guard: an offset outside [0, K] or decreasing, or an id outside [0, V), is an
// error, never a read out of bounds. x: float32/bfloat16/float16/float64, rows at any strides
// (the last dimension contiguous, else a contiguous copy), as the token_stats kernel accepts.

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
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "ids.h"
#include "rows.h"
#include "simd.h"

namespace klpenalty_support {
namespace {

using klpenalty_native::Compute;
using klpenalty_native::grain_rows;
using klpenalty_native::ids_marks;
using klpenalty_native::IdSets;
using klpenalty_native::Rows;
using klpenalty_native::unit_last_stride;

template <typename T, typename C = Compute<T>>
void support_rows(const at::Tensor& x, const IdSets& sets, int64_t N, int64_t V, C* tau,
                  bool* exact, std::atomic<bool>& bad_id) {
  const T* base = x.const_data_ptr<T>();
  const Rows rows(x);
  at::parallel_for(0, N, grain_rows(V), [&](int64_t r0, int64_t r1) {
    bool* marks = ids_marks(V);
    for (int64_t r = r0; r < r1; ++r) {
      if (!sets.row(r, base + rows.offset(r), V, marks, tau[r], exact[r])) {
        bad_id.store(true, std::memory_order_relaxed);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> support_from_ids(const at::Tensor& x_in,
                                                    const at::Tensor& ids_in,
                                                    const at::Tensor& offsets_in,
                                                    int64_t /*chunk_rows: the torch form's*/) {
  TORCH_CHECK_TYPE(at::isFloatingType(x_in.scalar_type()),
                   "x must be a floating tensor, got ", x_in.scalar_type());
  TORCH_CHECK_VALUE(x_in.dim() >= 1, "x must have a vocabulary dimension, got a 0-d tensor");
  const int64_t V = x_in.size(-1);
  const int64_t N = V ? x_in.numel() / V : [&] {
    int64_t n = 1;
    for (int64_t d = 0; d + 1 < x_in.dim(); ++d) n *= x_in.size(d);
    return n;
  }();
  const IdSets sets(ids_in, offsets_in, N);  // checked before any read of ids
  const at::Tensor x = unit_last_stride(x_in);
  const at::ScalarType ct = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor tau = at::empty({N}, x.options().dtype(ct));
  at::Tensor exact = at::empty({N}, x.options().dtype(at::kBool));
  std::atomic<bool> bad_id{false};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(),
                                  "native_support_from_ids", [&] {
    support_rows<scalar_t>(x, sets, N, V, tau.mutable_data_ptr<Compute<scalar_t>>(),
                           exact.mutable_data_ptr<bool>(), bad_id);
  });
  if (bad_id.load()) sets.fail_range(V);
  return {tau, exact};
}

}  // namespace

TORCH_LIBRARY_IMPL(klpenalty, CPU, m) {
  m.impl("native_support_from_ids", &support_from_ids);  // schema in contract.py
}

}  // namespace klpenalty_support
