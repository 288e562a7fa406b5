// The local sum of a Gloo reduce-scatter in the ring's order: Note [Ring-ordered sum].
#include "reducer/transport/ring_order_sum.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "reducer/agreement/ring_chunks.h"

namespace ddp_ext::reducer {

void ring_order_sum(
    const at::Tensor& received, int64_t length, int rank, int world_size, const at::Tensor& shard) {
  at::NoGradGuard no_grad;
  const int64_t size = shard.numel();
  const int64_t lo = std::min(rank * size, length);
  const int64_t mine = std::min(size, length - lo); // this range's elements within the bucket
  TORCH_INTERNAL_ASSERT(received.numel() == world_size * mine && received.dtype() == shard.dtype());
  if (mine > 0) {
    const int64_t chunk = gloo_ring_chunk(length, shard.element_size(), world_size);
    for (int64_t begin = 0; begin < mine;) {
      const int64_t c = (lo + begin) / chunk;
      const int64_t end = std::min(mine, (c + 1) * chunk - lo);
      at::Tensor out = shard.narrow(0, begin, end - begin);
      auto copy_of = [&](int step) {
        return received.narrow(0, ring_order_rank(c, step, world_size) * mine + begin, end - begin);
      };
      out.copy_(copy_of(0));
      for (int step = 1; step < world_size; ++step) {
        out.add_(copy_of(step));
      }
      begin = end;
    }
  }
  if (mine < size) {
    shard.narrow(0, mine, size - mine).zero_();
  }
}

} // namespace ddp_ext::reducer
