#include "comm_hooks/compression/int8_exchange.h"

#include <c10/util/Exception.h>

#include <algorithm>

#include "comm_hooks/compression/int8_codec.h"

namespace ddp_ext::compression {
namespace {

int64_t round_up_4(int64_t bytes) {
  return (bytes + 3) / 4 * 4;
}

} // namespace

const char* int8_exchange_name(Int8Exchange exchange) {
  switch (exchange) {
    case Int8Exchange::kAllgather:
      return "allgather";
    case Int8Exchange::kReduceScatter:
      return "reduce_scatter";
  }
  return "?";
}

Int8Exchange int8_exchange_for(int64_t world_size) {
  return world_size <= 3 ? Int8Exchange::kAllgather : Int8Exchange::kReduceScatter;
}

Int8Segments int8_segments(int64_t numel, int64_t chunk, int64_t world_size) {
  TORCH_CHECK(numel >= 0 && chunk > 0 && world_size > 0, "int8_segments: numel ", numel,
              ", chunk ", chunk, ", world size ", world_size);
  const int64_t chunks = (numel + chunk - 1) / chunk;
  Int8Segments s;
  for (int64_t r = 0; r < world_size; ++r) {
    // Chunks [r * chunks / W, (r + 1) * chunks / W): sizes differ by at most one.
    const int64_t first = std::min(numel, r * chunks / world_size * chunk);
    const int64_t end = std::min(numel, (r + 1) * chunks / world_size * chunk);
    s.begin.push_back(first);
    s.numel.push_back(end - first);
    s.bytes.push_back(int8_payload_bytes(end - first, chunk));
    s.offset.push_back(s.total_bytes);
    s.total_bytes += round_up_4(s.bytes.back());
    s.largest_slot = std::max(s.largest_slot, round_up_4(s.bytes.back()));
  }
  return s;
}

} // namespace ddp_ext::compression
