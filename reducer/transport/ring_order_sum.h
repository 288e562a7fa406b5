#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace ddp_ext::reducer {

// Note [Ring-ordered sum]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Over Gloo a sharded bucket (Note [Sharded buckets]) is reduce-scattered
// with a reduce-scatter's bytes ((N - 1) / N of the bucket). At two ranks
// that is an all-to-all followed by a local sum: every rank sends range j
// of its bucket to rank j, and each rank sums the copies of its own range
// it received (ring_order_sum below). At three ranks or more a ring of
// sends adds as it goes (Note [A ring of sends for the reduce-scatter] in
// reducer/transport/ring_reduce_scatter.h), in the same order.
// Float addition is commutative but not associative, so the result depends
// on the order of the N - 1 additions of each element only. That sum takes
// the order Gloo's ring allreduce of the whole bucket would have taken at
// that element's offset: the element lies in the ring's chunk c (Note
// [Gloo's ring chunks] in reducer/agreement/ring_chunks.h, cut from the
// bucket's length, element size and world size), and is summed from rank
// c - 1 down round the ring to rank c, ((x[c-1] + x[c-2]) + ...) + x[c].
// The shard therefore holds, bit for bit, what torch's DDP's allreduce
// leaves in that range, at any world size, with half the allreduce's bytes.

// Writes into `shard` (S elements, this rank's range [rank * S, rank * S + S)
// of a bucket of `length` elements) the sum of the `world_size` copies of
// that range in `received` (world_size runs of the range's elements that
// lie within the bucket, min(S, length - rank * S) each, rank 0's first),
// in the order of Gloo's ring; the elements past the bucket's end are zero.
void ring_order_sum(
    const at::Tensor& received, int64_t length, int rank, int world_size, const at::Tensor& shard);

// The rank whose copy comes `step`-th (0: the first) in the sum of an element
// in chunk `chunk` of Gloo's ring at `world_size` ranks.
inline int ring_order_rank(int64_t chunk, int step, int world_size) {
  const int64_t rank = (chunk - 1 - step) % world_size;
  return static_cast<int>(rank < 0 ? rank + world_size : rank);
}

} // namespace ddp_ext::reducer
