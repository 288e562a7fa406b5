#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace ddp_ext::reducer {

// Note [A ring of sends for the reduce-scatter]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Over Gloo at three ranks or more, a sharded bucket (Note [Sharded
// buckets] in reducer/transport/reduce_scatter.h) is reduce-scattered as
// the first half of Gloo's own ring allreduce, run with point-to-point
// sends, so each rank sends only to its neighbour: across hosts the ring
// crosses each link once, where an all-to-all of the ranges crosses it
// with every rank.
//
// The ring. Chunk c is Gloo's cut of the bucket (Note [Gloo's ring chunks]
// in reducer/agreement/ring_chunks.h). In N - 1 rounds, round t, rank r
// sends its partial sum of chunk r + 1 + t to rank r - 1 and receives from
// rank r + 1 the partial sum of chunk r + 2 + t, which it adds into the
// same chunk of its own bucket (indices modulo N). Round 0 sends a rank's
// own values, so the sum of chunk c starts at rank c - 1 and travels down
// the ring to rank c, which adds the last: ((x[c-1] + x[c-2]) + ...) + x[c],
// the order of Note [Ring-ordered sum] (each rank adds its own values to
// the partial it received; a + b is b + a bit for bit, so only that order
// of association matters). Rank c thus holds chunk c summed as torch's DDP's
// allreduce leaves it.
//
// The fix-up. Rank r's shard is [r * S, r * S + S) with S = ceil(L / N);
// Gloo's chunk is k >= S elements (usually equal, or a little longer), so
// the elements of a shard that lie in another rank's chunk are sent from
// that rank to the shard's owner after the ring: a few elements per rank
// (r * (k - S) at most), and none where k = S.
//
// Bytes: the ring sends every chunk but a rank's own, (N - 1) / N of the
// bucket on average, plus the fix-up: a reduce-scatter's.
// Memory: the sums accumulate in the bucket itself (it is released after
// its reduce-scatter) and each receive lands in one chunk-sized buffer per
// running ring, so the rings in flight cost kLanes / N of a bucket more,
// instead of the all-to-all's one bucket per bucket.
//
// Who drives the rounds. Each round waits for the previous one, so they run
// on threads the transport owns (RingReduceScatter): kLanes of them, fed
// from one queue in launch order (the same order on every rank), each
// running one bucket's rounds at a time through the Gloo backend's send and
// recv, which run on the calling thread (Gloo's unbound buffers; their
// slots are apart from the collectives'). So kLanes buckets' rings run at
// once: one's sends fill the link while another waits for a round's
// receive and adds it. Tags: kTagBase + the bucket's index times N + the
// round (the fix-up is round N - 1), the same on every rank, so rings
// running at once never take each other's messages, whichever lane runs
// which bucket on which rank; a bucket's next ring starts only after this one finished (a
// backward waits for every bucket), and messages between two ranks under
// one tag arrive in order. The threads run no Python and no user code and
// take none of the reducer's locks: only the queue's mutex and each ring's
// own.
//
// The Work. launch() gets a RingWork, completed by its lane when the
// shard holds its sums (or with the exception that stopped the ring), with
// a future for the timeline; finish() waits for it through the StallWatch
// as for any Work. A peer that dies closes its connection and fails the
// pending send or recv (Gloo raises), a peer that never comes fails it at
// the process group's timeout: the ring completes with that error, which
// finish() raises; the lane goes on with the next ring.
//
// Abandoned and destroyed. Dropping a RingWork that has not completed (the
// reducer abandons an iteration, or the reducer or the transport goes)
// cancels its ring: its pending send and recv are aborted and, under the
// ring's mutex, nothing more is added into its bucket or written into its
// shard, so the next backward may fill the bucket at once. Destroying the
// transport cancels every ring queued or running, and joins the lanes.
//
// A ring cut short. A ring that failed or was cancelled may leave sends of
// its peers unreceived, under tags the next backward's ring of the same
// bucket uses again: a later receive could take a stale partial sum. So
// once a ring ends unfinished, every later launch of the transport raises
// (the wrapper must be built again), rather than sum what it cannot trust.

// Where one rank's chunk and one rank's shard meet: [begin, begin + length)
// of the bucket, sent from `from` (whose chunk it lies in) to `to` (whose
// shard it lies in).
struct RingPiece {
  int from = 0;
  int to = 0;
  int64_t begin = 0;
  int64_t length = 0;
};

// The ring's arithmetic for a bucket of `length` elements of `element_size`
// bytes over `world_size` >= 3 ranks.
struct RingPlan {
  int64_t length = 0;
  int64_t chunk = 0; // Gloo's chunk, k
  int64_t shard = 0; // S
  int world_size = 0;

  static RingPlan of(int64_t length, int64_t element_size, int world_size);

  int64_t chunk_begin(int64_t c) const;
  int64_t chunk_length(int64_t c) const; // within the bucket (maybe 0)
  // The chunk rank `rank` sends in round `round` (it receives chunk + 1).
  int sent_chunk(int rank, int round) const {
    return static_cast<int>((rank + 1 + round) % world_size);
  }
  // Every piece of the fix-up, rank by rank.
  std::vector<RingPiece> fixups() const;
  // Elements rank `rank` sends in all: ring and fix-up.
  int64_t sent_elements(int rank) const;
};

class RingReduceScatter {
 public:
  static constexpr int kTagBase = 1 << 30;
  static constexpr int kLanes = 2; // rings running at once: See the Note

  RingReduceScatter() = default;
  ~RingReduceScatter(); // cancels what is queued, joins the threads
  RingReduceScatter(const RingReduceScatter&) = delete;
  RingReduceScatter& operator=(const RingReduceScatter&) = delete;

  // Queues the reduce-scatter of bucket `index`, whose values are in `flat`,
  // into `shard` over `gloo`; `flat` must stay allocated until the Work
  // completes or is dropped.
  c10::intrusive_ptr<c10d::Work> launch(
      const c10::intrusive_ptr<c10d::Backend>& gloo, at::Tensor flat, at::Tensor shard,
      size_t index);

  struct Ring; // one bucket's ring, shared by its Work and the lane that runs it

 private:
  void run(int lane);

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::shared_ptr<Ring>> queue_;
  std::vector<std::shared_ptr<Ring>> running_ = std::vector<std::shared_ptr<Ring>>(kLanes); // by lane
  // Set once a ring ended unfinished: See the Note, "A ring cut short".
  std::shared_ptr<std::atomic<bool>> cut_short_ = std::make_shared<std::atomic<bool>>(false);
  bool stopping_ = false;
  std::vector<std::thread> threads_; // kLanes, started by the first launch
};

} // namespace ddp_ext::reducer
