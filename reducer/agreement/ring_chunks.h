#pragma once

#include <cstdint>
#include <optional>

namespace ddp_ext::reducer {

// Note [Gloo's ring chunks]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// How Gloo's ring allreduce (the algorithm torch's ProcessGroupGloo runs for
// dense CPU tensors) orders the additions of an element, as read from
// gloo/allreduce.cc; the step check at three ranks or more depends on it
// (Note [The step check on bucket 0], point 3).
//
// A buffer of n elements of e bytes is cut into S segments of s elements:
// S is the number of 1 MiB segments the buffer needs, at least twice the
// world size W, rounded up to a multiple of W; s = ceil(n / S). Rank r owns
// the r-th run of S / W consecutive segments, its chunk: chunk c covers
// elements [c * k, (c + 1) * k) with k = (S / W) * s (the last chunks may be
// short or empty). Every segment of chunk c is reduced along the same path:
// rank c - 1 sends its values to rank c - 2, which adds its own and sends
// the sum on, and so on round the ring down to rank c, which adds the last;
// the sums then only travel (copies). So the order of the additions of an
// element depends on the index of its chunk and on nothing else: not on its
// offset in the chunk, nor on the buffer's length. An element placed in
// a longer buffer at an offset in the same chunk index is summed bitwise as
// before.
//
// ChunkedCarrier lays bucket 0 and the step check's tail out that way: the
// bucket's chunk c (as Gloo cuts bucket 0 alone, torch's DDP's allreduce)
// goes at the start of the carrier's chunk c, and the tail fills the room
// after each chunk's elements. The carrier's length is W times a chunk
// length k' that Gloo's cut of the carrier gives back exactly.
//
// At two ranks the order never matters (a + b is b + a): the carrier is bucket
// 0 and then the tail, as one chunk.

// Elements per chunk of Gloo's ring allreduce of `elements` elements of
// `element_size` bytes over `world_size` ranks.
int64_t gloo_ring_chunk(int64_t elements, int64_t element_size, int world_size);

struct ChunkedCarrier {
  int64_t elements = 0; // bucket 0's
  int64_t tail = 0; // the tail's
  int64_t chunks = 1; // bucket 0's chunks, in order
  int64_t chunk = 0; // elements of bucket 0 per chunk
  int64_t padded = 0; // the carrier's chunk: chunk, then room for the tail

  // The layout for `world_size` ranks, or nothing where no carrier length
  // keeps every chunk (not seen; the caller then runs the check alone).
  static std::optional<ChunkedCarrier> plan(
      int64_t elements, int64_t tail, int64_t element_size, int world_size);

  int64_t numel() const {
    return chunks * padded;
  }
  int64_t room() const {
    return padded - chunk; // tail elements after each chunk
  }
  // Bucket 0's elements in chunk c: [c * chunk, c * chunk + bucket_length(c)),
  // at c * padded in the carrier.
  int64_t bucket_length(int64_t c) const;
  // The tail's elements after chunk c: [c * room(), c * room() + tail_length(c)),
  // at c * padded + chunk in the carrier.
  int64_t tail_length(int64_t c) const;
};

} // namespace ddp_ext::reducer
