#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace ddp_ext::compression {

// 8-bit codes with one float32 scale per chunk (see Note [Adaptive
// precision]). A payload is one uint8 tensor: the chunks' scales as float32
// first (so they stay aligned), then one int8 code per element. A code c in
// chunk k stands for c * scale[k]; scale[k] is the chunk's largest magnitude
// divided by 127, so no code saturates.

// Bytes of the payload of `numel` elements in chunks of `chunk`.
int64_t int8_payload_bytes(int64_t numel, int64_t chunk);

// Encodes `values` (1-D float32, contiguous) into `payload` (uint8, of
// int8_payload_bytes) and leaves in `values` what the codes miss: the
// value minus its decoded code, at most half a scale step per element.
void encode_int8(at::Tensor& values, at::Tensor& payload, int64_t chunk);

// Decodes each payload of `payloads` (in order) and writes their sum into
// `out` (1-D float32 of the payloads' element count).
void decode_sum_int8(const std::vector<at::Tensor>& payloads, at::Tensor& out,
                     int64_t chunk);

} // namespace ddp_ext::compression
