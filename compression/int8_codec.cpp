#include "compression/int8_codec.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

namespace ddp_ext::compression {
namespace {

int64_t chunk_count(int64_t numel, int64_t chunk) {
  return (numel + chunk - 1) / chunk;
}

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
  scales.masked_fill_(scales == 0, 1);
  at::Tensor codes = padded.div(scales.unsqueeze(1)).round_().clamp_(-127, 127);
  padded.sub_(codes * scales.unsqueeze(1));
  values.copy_(padded.view({-1}).narrow(0, 0, numel));
  parts.scales.copy_(scales);
  parts.codes.copy_(codes.view({-1}).narrow(0, 0, numel));
}

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
  for (int64_t start = 0, k = 0; start < numel; start += chunk, ++k) {
    const int64_t end = std::min(numel, start + chunk);
    float largest = 0;
    for (int64_t i = start; i < end; ++i) {
      largest = std::max(largest, std::abs(v[i]));
    }
    const float scale = largest > 0 ? largest / 127.0f : 1.0f;
    const float inverse = 1.0f / scale;
    scales[k] = scale;
    for (int64_t i = start; i < end; ++i) {
      const float code = std::clamp(std::nearbyint(v[i] * inverse), -127.0f, 127.0f);
      codes[i] = static_cast<int8_t>(code);
      v[i] -= code * scale;
    }
  }
}

void decode_sum_int8(const std::vector<at::Tensor>& payloads, at::Tensor& out,
                     int64_t chunk) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 1 && out.is_contiguous(),
              "decode_sum_int8 writes a contiguous 1-D float32 tensor, got ",
              out.scalar_type(), " of shape ", out.sizes());
  const int64_t numel = out.numel();
  out.zero_();
  for (const at::Tensor& payload : payloads) {
    PayloadParts parts = split_payload(payload, numel, chunk);
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
    for (int64_t start = 0, k = 0; start < numel; start += chunk, ++k) {
      const int64_t end = std::min(numel, start + chunk);
      const float scale = scales[k];
      for (int64_t i = start; i < end; ++i) {
        o[i] += static_cast<float>(codes[i]) * scale;
      }
    }
  }
}

} // namespace ddp_ext::compression
