#include "comm_hooks/compression/int8_codec.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace ddp_ext::compression {
namespace {

int64_t chunk_count(int64_t numel, int64_t chunk) {
  return (numel + chunk - 1) / chunk;
}

// A chunk's scale: its largest magnitude / 127, or 1 where that is no normal
// float (zero, or values so small that 1 / scale would overflow to inf and
// the codes to NaN); with scale 1 such values encode as 0 and are kept whole
// as what the codes miss. Error feedback re-encodes what a chunk missed at
// every step, so a chunk whose inputs stay zero (rows of an embedding no
// batch uses) shrinks its remainder about 254-fold per step into this range.
constexpr float kSmallestScale = std::numeric_limits<float>::min();

// The payload's two parts, as views of its bytes.
struct PayloadParts {
  at::Tensor scales; // float32, one per chunk
  at::Tensor codes;  // int8, one per element
};

PayloadParts split_payload(const at::Tensor& payload, int64_t numel, int64_t chunk) {
  const int64_t chunks = chunk_count(numel, chunk);
  TORCH_CHECK(payload.scalar_type() == at::kByte && payload.dim() == 1 &&
                  payload.numel() == int8_payload_bytes(numel, chunk),
              "an int8 payload of ", numel, " elements in chunks of ", chunk,
              " is a 1-D uint8 tensor of ", int8_payload_bytes(numel, chunk),
              " bytes, got ", payload.scalar_type(), " of shape ", payload.sizes());
  return {payload.narrow(0, 0, chunks * 4).view(at::kFloat),
          payload.narrow(0, chunks * 4, numel).view(at::kChar)};
}

// The same encoding from tensor operations, for tensors not on the CPU.
void encode_with_tensor_ops(at::Tensor& values, PayloadParts& parts, int64_t chunk) {
  const int64_t numel = values.numel();
  const int64_t chunks = chunk_count(numel, chunk);
  at::Tensor padded = at::constant_pad_nd(values, {0, chunks * chunk - numel}, 0)
                          .view({chunks, chunk});
  at::Tensor scales = padded.abs().amax(1).div_(127);
  scales.masked_fill_(scales < kSmallestScale, 1);
  at::Tensor codes = padded.div(scales.unsqueeze(1)).round_().clamp_(-127, 127);
  padded.sub_(codes * scales.unsqueeze(1));
  values.copy_(padded.view({-1}).narrow(0, 0, numel));
  parts.scales.copy_(scales);
  parts.codes.copy_(codes.view({-1}).narrow(0, 0, numel));
}

// The CPU kernels, written so that the compiler vectorises them without
// fast-math (explicit lanes for the maximum; rounding by adding and
// subtracting 1.5 * 2^23, exact for |x| <= 2^22), at -O3 here only.
#pragma GCC push_options
#pragma GCC optimize("O3")

constexpr int kLanes = 16;
constexpr int64_t kChunksPerTask = 64;
constexpr float kRounder = 12582912.0f; // 1.5 * 2^23

float largest_magnitude(const float* v, int64_t n) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float a = std::fabs(v[i + j]);
      lanes[j] = a > lanes[j] ? a : lanes[j];
    }
  }
  float largest = 0;
  for (; i < n; ++i) {
    largest = std::max(largest, std::fabs(v[i]));
  }
  for (float lane : lanes) {
    largest = std::max(largest, lane);
  }
  return largest;
}

// Codes of v / scale, rounded to nearest (ties to even); v keeps the rest.
// scale is the chunk's largest magnitude / 127, so |v / scale| stays below
// 127.5 (rounding of the inverse included) and no code needs clamping.
void encode_chunk(float* __restrict v, int8_t* __restrict codes, int64_t n, float scale) {
  const float inverse = 1.0f / scale;
  for (int64_t i = 0; i < n; ++i) {
    const float q = (v[i] * inverse + kRounder) - kRounder;
    codes[i] = static_cast<int8_t>(static_cast<int32_t>(q));
    v[i] -= q * scale;
  }
}

// out = decoded (first payload) or out += decoded.
void decode_chunk(const int8_t* __restrict codes, float* __restrict out, int64_t n, float scale, bool first) {
  if (first) {
    for (int64_t i = 0; i < n; ++i) {
      out[i] = static_cast<float>(codes[i]) * scale;
    }
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    out[i] += static_cast<float>(codes[i]) * scale;
  }
}

#pragma GCC pop_options

} // namespace

int64_t int8_payload_bytes(int64_t numel, int64_t chunk) {
  TORCH_CHECK(chunk > 0, "int8 chunk size must be positive, got ", chunk);
  return chunk_count(numel, chunk) * 4 + numel;
}

void encode_int8(at::Tensor& values, at::Tensor& payload, int64_t chunk) {
  TORCH_CHECK(values.scalar_type() == at::kFloat && values.dim() == 1 &&
                  values.is_contiguous(),
              "encode_int8 takes a contiguous 1-D float32 tensor, got ",
              values.scalar_type(), " of shape ", values.sizes());
  const int64_t numel = values.numel();
  PayloadParts parts = split_payload(payload, numel, chunk);
  if (!values.device().is_cpu()) {
    encode_with_tensor_ops(values, parts, chunk);
    return;
  }
  float* v = values.data_ptr<float>();
  float* scales = parts.scales.data_ptr<float>();
  int8_t* codes = parts.codes.data_ptr<int8_t>();
  const int64_t chunks = chunk_count(numel, chunk);
  at::parallel_for(0, chunks, kChunksPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const int64_t start = k * chunk;
      const int64_t n = std::min(numel - start, chunk);
      const float largest = largest_magnitude(v + start, n);
      const float scale = largest / 127.0f;
      scales[k] = scale >= kSmallestScale ? scale : 1.0f;
      encode_chunk(v + start, codes + start, n, scales[k]);
    }
  });
}

void decode_sum_int8(const std::vector<at::Tensor>& payloads, at::Tensor& out,
                     int64_t chunk) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 1 && out.is_contiguous(),
              "decode_sum_int8 writes a contiguous 1-D float32 tensor, got ",
              out.scalar_type(), " of shape ", out.sizes());
  const int64_t numel = out.numel();
  if (payloads.empty() || !out.device().is_cpu()) {
    out.zero_();
  }
  for (size_t p = 0; p < payloads.size(); ++p) {
    PayloadParts parts = split_payload(payloads[p], numel, chunk);
    if (!out.device().is_cpu()) {
      const int64_t chunks = chunk_count(numel, chunk);
      at::Tensor decoded = at::constant_pad_nd(parts.codes.to(at::kFloat),
                                               {0, chunks * chunk - numel}, 0)
                               .view({chunks, chunk})
                               .mul_(parts.scales.unsqueeze(1));
      out.add_(decoded.view({-1}).narrow(0, 0, numel));
      continue;
    }
    float* o = out.data_ptr<float>();
    const float* scales = parts.scales.data_ptr<float>();
    const int8_t* codes = parts.codes.data_ptr<int8_t>();
    const int64_t chunks = chunk_count(numel, chunk);
    at::parallel_for(0, chunks, kChunksPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t k = begin; k < end; ++k) {
        const int64_t start = k * chunk;
        decode_chunk(codes + start, o + start, std::min(numel - start, chunk), scales[k],
                     /*first=*/p == 0);
      }
    });
  }
}

} // namespace ddp_ext::compression
