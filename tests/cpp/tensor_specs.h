#pragma once

// Shorthands for the bucket-assignment tests: TensorSpecs by their bytes.
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <vector>

#include "reducer/layout/bucket_assignment.h"

namespace ddp_ext::reducer::testing {

inline TensorSpec spec(
    int64_t nbytes,
    c10::ScalarType dtype = c10::ScalarType::Float,
    c10::Device device = c10::Device(c10::DeviceType::CPU)) {
  return TensorSpec{nbytes, dtype, device, /*sparse=*/false, /*unit=*/-1};
}

// Float32 tensors on the CPU of these sizes, in registration order.
inline std::vector<TensorSpec> floats(const std::vector<int64_t>& nbytes) {
  std::vector<TensorSpec> specs;
  for (int64_t n : nbytes) {
    specs.push_back(spec(n));
  }
  return specs;
}

} // namespace ddp_ext::reducer::testing
