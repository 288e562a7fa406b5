// The local sum of a Gloo reduce-scatter in the ring's order
// (reducer/transport/ring_order_sum.h). See Note [Ring-ordered sum].
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cstdint>

#include "reducer/agreement/ring_chunks.h"
#include "reducer/transport/ring_order_sum.h"

namespace ddp_ext::reducer {
namespace {

TEST(RingOrderRank, StartsBeforeTheChunkAndGoesDownRoundTheRing) {
  // Chunk 0 at 4 ranks: 3, 2, 1, 0; chunk 2: 1, 0, 3, 2.
  EXPECT_EQ(ring_order_rank(0, 0, 4), 3);
  EXPECT_EQ(ring_order_rank(0, 3, 4), 0);
  EXPECT_EQ(ring_order_rank(2, 0, 4), 1);
  EXPECT_EQ(ring_order_rank(2, 1, 4), 0);
  EXPECT_EQ(ring_order_rank(2, 2, 4), 3);
  EXPECT_EQ(ring_order_rank(2, 3, 4), 2);
}

// Every element's sum, written out one addition at a time in float.
void expect_ring_order(int64_t length, int world_size) {
  const int64_t size = (length + world_size - 1) / world_size;
  const int64_t chunk = gloo_ring_chunk(length, 4, world_size);
  for (int rank = 0; rank < world_size; ++rank) {
    const int64_t lo = std::min<int64_t>(rank * size, length);
    const int64_t mine = std::min<int64_t>(size, length - lo);
    // Large values that cancel and a small one: the order shows in the result.
    at::Tensor received = at::empty({world_size * mine}, at::kFloat);
    float* in = received.data_ptr<float>();
    for (int64_t i = 0; i < world_size * mine; ++i) {
      const int64_t j = i / (mine > 0 ? mine : 1);
      in[i] = j == 0 ? 1.0f : (j % 2 ? 1e8f : -1e8f) + static_cast<float>(i % 7);
    }
    at::Tensor shard = at::full({size}, 42.0f);
    ring_order_sum(received, length, rank, world_size, shard);
    const float* out = shard.data_ptr<float>();
    for (int64_t i = 0; i < size; ++i) {
      if (i >= mine) {
        EXPECT_EQ(out[i], 0.0f) << "past the bucket's end";
        continue;
      }
      const int64_t c = (lo + i) / chunk;
      float sum = in[ring_order_rank(c, 0, world_size) * mine + i];
      for (int step = 1; step < world_size; ++step) {
        sum += in[ring_order_rank(c, step, world_size) * mine + i];
      }
      EXPECT_EQ(out[i], sum) << length << " elements, rank " << rank << ", element " << i;
    }
  }
}

TEST(RingOrderSum, SumsEachElementInItsChunksOrder) {
  for (int world_size : {2, 3, 4, 5}) {
    for (int64_t length : {int64_t{1}, int64_t{2}, int64_t{7}, int64_t{1000}, int64_t{2762},
                           int64_t{(1 << 18) + 3}}) {
      expect_ring_order(length, world_size);
    }
  }
}

} // namespace
} // namespace ddp_ext::reducer
