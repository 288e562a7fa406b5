#include "comm_hooks/compression/accumulate.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>

namespace ddp_ext::compression {
namespace {

// Vectorised without fast-math: the squares are summed in explicit lanes,
// and each block's lanes in double. -O3 for this function only.
#pragma GCC push_options
#pragma GCC optimize("O3")

constexpr int kSumLanes = 16;
constexpr int64_t kSumBlock = 4096;

double accumulate_block(float* __restrict owed, const float* __restrict grad, int64_t n,
                        float scale) {
  float lanes[kSumLanes] = {};
  int64_t i = 0;
  for (; i + kSumLanes <= n; i += kSumLanes) {
    for (int j = 0; j < kSumLanes; ++j) {
      const float g = grad[i + j];
      owed[i + j] += scale * g;
      lanes[j] += g * g;
    }
  }
  double sum = 0;
  for (; i < n; ++i) {
    owed[i] += scale * grad[i];
    sum += static_cast<double>(grad[i]) * grad[i];
  }
  for (float lane : lanes) {
    sum += lane;
  }
  return sum;
}

#pragma GCC pop_options

} // namespace

double squared_norm(const at::Tensor& values) {
  if (values.scalar_type() == at::kFloat) {
    return at::dot(values, values).item<double>();
  }
  const double norm =
      at::linalg_vector_norm(values, 2, {}, false, at::kDouble).item<double>();
  return norm * norm;
}

double accumulate_scaled(at::Tensor& owed, const at::Tensor& grad, double scale) {
  TORCH_CHECK(owed.numel() == grad.numel(), "accumulate_scaled: ", owed.numel(),
              " elements owed for a gradient of ", grad.numel());
  const bool fast = owed.device().is_cpu() && grad.device().is_cpu() &&
      owed.scalar_type() == at::kFloat && grad.scalar_type() == at::kFloat &&
      owed.is_contiguous() && grad.is_contiguous();
  if (!fast) {
    const double sum = squared_norm(grad);
    owed.add_(grad, scale);
    return sum;
  }
  float* o = owed.data_ptr<float>();
  const float* g = grad.const_data_ptr<float>();
  const int64_t numel = grad.numel();
  double sum = 0;
  for (int64_t start = 0; start < numel; start += kSumBlock) {
    sum += accumulate_block(o + start, g + start, std::min(kSumBlock, numel - start),
                            static_cast<float>(scale));
  }
  return sum;
}

} // namespace ddp_ext::compression
