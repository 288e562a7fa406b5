#pragma once

#include <cstdint>
#include <vector>

namespace ddp_ext::compression {

// Note [Eight bits at any world size]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// 8-bit codes with per-chunk scales cannot be summed on the wire (each
// rank's scales differ), so the hook exchanges them in one of two ways:
//
//   kAllgather      every rank gathers every rank's payload and sums them in
//                   rank order. One round. Each rank sends and receives
//                   (W - 1) payloads of the whole bucket (ring allgather):
//                   the bytes per rank grow with the world size W.
//   kReduceScatter  two rounds whose bytes per rank do not grow with W:
//                   1. the bucket is cut into W segments on chunk boundaries
//                      (int8_segments); each rank encodes each segment and
//                      sends segment s to rank s (one all-to-all), which
//                      decodes the W payloads of its segment and sums them
//                      in float32, in rank order;
//                   2. the owner encodes that sum again (new scales) and the
//                      owners' payloads are allgathered; every rank decodes
//                      them, so all ranks get the same bits.
//                   Each rank sends (W - 1)/W of a payload in each round:
//                   2 (W - 1)/W payloads in all, under 2 whatever W.
//
// Error feedback covers both roundings: the first leaves each rank's
// residual as before; what the owner's re-encoding misses (in the units
// sent: the average) is added to the owner's own residual at its segment,
// so the next iteration sends it, and the invariant of Note [Adaptive
// precision] holds with the second rounding included: the applied sum
// over iterations equals the exact one minus the sum of the ranks'
// residuals.
//
// Ordering: step 2 can start only once step 1 has arrived, so it is issued
// from a completion callback. Collectives issued from callbacks and from
// the hook's thread on one group would interleave differently on
// different ranks, so step 2 runs on a companion group of the same ranks
// that carries nothing else, and is issued there in the order the hook
// was called (OrderedLaunches), which is the same on every rank.
//
// The rule (int8_exchange_for): kAllgather up to 3 ranks, kReduceScatter
// from 4. Bytes each rank sends for a bucket of N elements (payload ~N):
//
//   float32 allreduce (ring)   2 (W - 1)/W * 4N
//   float16 allreduce (ring)   2 (W - 1)/W * 2N
//   8 bits, kAllgather         (W - 1) * N
//   8 bits, kReduceScatter     2 (W - 1)/W * N
//
// At 2 ranks both 8-bit exchanges send N, and the allgather does it in one
// round with one rounding, so it cannot lose. At 3 the reduce-scatter
// sends 4/3 N against 2N, but pays a second dependent round (a latency,
// plus decode-sum-encode on the owner between the rounds, on the critical
// path of the last bucket) and a second rounding; a third of N is small
// beside that on the links where 8 bits pay at all, so the measured
// allgather path stays. From 4 ranks the allgather sends 3N or more, no
// fewer than float16's allreduce, and only the reduce-scatter keeps 8 bits
// at a quarter of float32's bytes. The option `int8_exchange` overrides
// the rule.

enum class Int8Exchange : int8_t { kAllgather = 0, kReduceScatter = 1 };

const char* int8_exchange_name(Int8Exchange exchange);

// The rule above.
Int8Exchange int8_exchange_for(int64_t world_size);

// Where each rank's segment of a bucket lies, and where its payload lies in
// a buffer of payloads. Segments are whole chunks (the last may be short),
// as even as chunks allow; a rank may own nothing (fewer chunks than ranks).
struct Int8Segments {
  std::vector<int64_t> begin;  // first element of segment s
  std::vector<int64_t> numel;  // elements of segment s
  std::vector<int64_t> bytes;  // payload bytes of segment s
  std::vector<int64_t> offset; // byte offset of segment s's payload in the
                               // buffer of all payloads (4-byte aligned)
  int64_t total_bytes = 0;     // of that buffer
  int64_t largest_slot = 0;    // largest payload, rounded up to 4 bytes
};

Int8Segments int8_segments(int64_t numel, int64_t chunk, int64_t world_size);

} // namespace ddp_ext::compression
