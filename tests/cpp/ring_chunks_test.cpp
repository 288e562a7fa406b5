// Gloo's ring chunks and the carrier of bucket 0 and the step check's tail
// (reducer/agreement/ring_chunks.h). See Note [Gloo's ring chunks].
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "reducer/agreement/ring_chunks.h"

namespace ddp_ext::reducer {
namespace {

constexpr int64_t kMiB = 1024 * 1024;

// The chunk index of each of `n` elements as Gloo's ring cuts a buffer of n.
int64_t chunk_of(int64_t element, int64_t n, int64_t element_size, int world_size) {
  return element / gloo_ring_chunk(n, element_size, world_size);
}

TEST(GlooRingChunk, SmallBuffersAreCutIntoTwoSegmentsPerRank) {
  // 2762 floats at 4 ranks: 8 segments of 346, two per chunk.
  EXPECT_EQ(gloo_ring_chunk(2762, 4, 4), 2 * 346);
  EXPECT_EQ(gloo_ring_chunk(1, 4, 3), 2);
  EXPECT_EQ(gloo_ring_chunk(6, 8, 3), 2);
}

TEST(GlooRingChunk, LargeBuffersAreCutIntoSegmentsOfAtMostOneMiB) {
  // 10 MiB of float32 at 3 ranks: 10 segments, rounded up to 12.
  const int64_t n = 10 * kMiB / 4;
  EXPECT_EQ(gloo_ring_chunk(n, 4, 3), 4 * ((n + 11) / 12));
}

// Every element of bucket 0 lands in the carrier's chunk of the same index,
// and the tail fits after the chunks' elements without overlapping them.
void expect_chunks_kept(int64_t n, int64_t tail, int64_t element_size, int world_size) {
  const auto carrier = ChunkedCarrier::plan(n, tail, element_size, world_size);
  ASSERT_TRUE(carrier.has_value()) << n << " elements at " << world_size << " ranks";
  EXPECT_EQ(gloo_ring_chunk(carrier->numel(), element_size, world_size), carrier->padded);
  int64_t placed = 0;
  int64_t tail_placed = 0;
  for (int64_t c = 0; c < carrier->chunks; ++c) {
    const int64_t length = carrier->bucket_length(c);
    if (length > 0) {
      EXPECT_EQ(chunk_of(c * carrier->chunk, n, element_size, world_size), c);
      EXPECT_EQ(chunk_of(c * carrier->chunk + length - 1, n, element_size, world_size), c);
      EXPECT_EQ(chunk_of(c * carrier->padded + length - 1, carrier->numel(), element_size, world_size), c);
    }
    EXPECT_LE(length, carrier->chunk);
    EXPECT_LE(carrier->tail_length(c), carrier->room());
    placed += length;
    tail_placed += carrier->tail_length(c);
  }
  EXPECT_EQ(placed, n);
  EXPECT_EQ(tail_placed, tail);
}

TEST(ChunkedCarrier, KeepsEveryElementInItsChunk) {
  for (int world_size : {3, 4, 5, 8, 16}) {
    const int64_t tail = 3 * (6 * world_size + 1);
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{2762}, int64_t{4099}, int64_t{100003},
                      3 * kMiB + 5, 10 * kMiB / 4 + 1}) {
      expect_chunks_kept(n, tail, 4, world_size);
      expect_chunks_kept(n, tail, 8, world_size);
    }
  }
}

TEST(ChunkedCarrier, AtTwoRanksIsBucketZeroThenTheTail) {
  const auto carrier = ChunkedCarrier::plan(100, 39, 4, 2);
  ASSERT_TRUE(carrier.has_value());
  EXPECT_EQ(carrier->chunks, 1);
  EXPECT_EQ(carrier->numel(), 139);
  EXPECT_EQ(carrier->bucket_length(0), 100);
  EXPECT_EQ(carrier->tail_length(0), 39);
}

} // namespace
} // namespace ddp_ext::reducer
