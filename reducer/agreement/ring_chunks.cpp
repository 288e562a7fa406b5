// Gloo's ring chunks and the carrier of bucket 0 and the step check's tail.
// See Note [Gloo's ring chunks] in reducer/agreement/ring_chunks.h.
#include "reducer/agreement/ring_chunks.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace ddp_ext::reducer {

namespace {

// gloo::AllreduceOptions's kMaxSegmentSize.
constexpr int64_t kGlooMaxSegmentBytes = 1024 * 1024;
// How far plan() looks for a carrier chunk length that Gloo keeps.
constexpr int64_t kSearch = 4096;

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

} // namespace

int64_t gloo_ring_chunk(int64_t elements, int64_t element_size, int world_size) {
  TORCH_INTERNAL_ASSERT(elements > 0 && element_size > 0 && world_size > 1);
  const int64_t max_segment =
      element_size * std::max<int64_t>(1, kGlooMaxSegmentBytes / element_size);
  const int64_t by_size = ceil_div(elements * element_size, max_segment);
  const int64_t segments =
      ceil_div(std::max<int64_t>(by_size, 2 * world_size), world_size) * world_size;
  return (segments / world_size) * ceil_div(elements, segments);
}

std::optional<ChunkedCarrier> ChunkedCarrier::plan(
    int64_t elements, int64_t tail, int64_t element_size, int world_size) {
  TORCH_INTERNAL_ASSERT(elements > 0 && tail > 0 && world_size > 1);
  ChunkedCarrier carrier;
  carrier.elements = elements;
  carrier.tail = tail;
  if (world_size == 2) { // Any order: one chunk, then the tail.
    carrier.chunk = elements;
    carrier.padded = elements + tail;
    return carrier;
  }
  carrier.chunks = world_size;
  carrier.chunk = gloo_ring_chunk(elements, element_size, world_size);
  const int64_t least = carrier.chunk + ceil_div(tail, world_size);
  for (int64_t padded = least; padded < least + kSearch; ++padded) {
    if (gloo_ring_chunk(padded * world_size, element_size, world_size) == padded) {
      carrier.padded = padded;
      return carrier;
    }
  }
  return std::nullopt;
}

int64_t ChunkedCarrier::bucket_length(int64_t c) const {
  return std::clamp<int64_t>(elements - c * chunk, 0, chunk);
}

int64_t ChunkedCarrier::tail_length(int64_t c) const {
  return std::clamp<int64_t>(tail - c * room(), 0, room());
}

} // namespace ddp_ext::reducer
