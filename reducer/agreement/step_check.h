#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "reducer/agreement/ring_chunks.h"
#include "reducer/agreement/step_slots.h"
#include "reducer/layout/bucket.h"
#include "reducer/observation/stall_watch.h"

namespace ddp_ext::reducer {

// Note [Ranks out of step]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Collectives pair up by their order on each rank, not by iteration. A rank
// that skips a synchronising forward or backward its peers ran (it caught an
// exception raised inside its forward and went on, or skipped a backward)
// pairs its gradient allreduces with another iteration's on the other ranks,
// and the replicas train on with gradients of different steps averaged.
//
// So each rank counts its training steps: the synchronising forwards it has
// begun with the module in training mode (an evaluation forward that only
// some ranks run is not a step). Every synchronising backward starts, as its
// first gradient arrives, with a step check: one small allreduce of an int64
// per rank, where each rank writes where it is into its own slot, zeros
// elsewhere (a rank that joined, in Join's shadow loop, writes nothing). It
// runs while autograd computes the rest of the backward and is awaited at its
// end, before the buckets; then every rank sees every rank's position. If
// the ranks with data disagree, each of them raises from backward with the
// same message, naming the positions, before any averaged gradient reaches
// .grad, and drops its bucket allreduces rather than wait for partners that
// may never come.
//
// A forward that broadcasts buffers issues a collective of its own, so a
// rank that dropped out of an iteration after that broadcast would pair its
// next broadcast with its peers' backward. Such forwards run a step check
// too, awaited just before the broadcast: its partner is then a peer's
// backward check, the same allreduce, and both see the mismatch. A slot says
// which kind of check wrote it: a backward check writes the training step; a
// forward check writes how many synchronising backwards the rank has begun,
// so a broadcast that only one rank runs (its first evaluation forward under
// torch.no_grad()) pairs with its peers' next broadcast as it does in torch's
// DDP, and raises nothing.
//
// A backward check also carries a rider: one more int64 slot that every rank
// adds a value to (0 for forward checks and ranks that joined), summed by the
// same allreduce at no extra cost. The reducer's vote on rebuilding buckets
// rides there (Note [Agreeing on the bucket layout] in
// reducer/layout/bucket_layout.h). And each rank writes, in a
// second slot of its own, the fingerprint of the layers it dropped (Note
// [Layer dropping]): ranks at the same step that dropped different layers
// raise as ranks out of step do.
//
// A third slot of each rank holds the fingerprint of its communication
// hooks (Note [Hooks registered after the first forward]).
//
// Every rank also writes, in kTimings slots of its own, its mean step
// timings over the last few steps when the reducer asks it to (zeros
// otherwise): the straggler figures of ddp_ext/_diagnosis/stragglers.py
// ride on the same allreduce (Note [Stragglers] in reducer/observation/step_timings.h).
//
// The cost: one latency-bound collective of ((3 + kTimings) * world_size + 1) * 8 bytes
// per iteration, overlapped with the backward, and with buffer broadcasting
// one more, awaited, before the broadcast. Over Gloo where no hook runs,
// none: the check rides on bucket 0's allreduce (Note [The step check on
// bucket 0]).

// Note [Hooks registered after the first forward]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// torch's DDP accepts register_comm_hook at any time (once), also after
// training began. The ranks' hooks are compared by name at the first
// forward (ddp_ext/_comm_hooks.py); one registered later is known only to
// the ranks that registered it, and the others would not know to take part
// in a comparison. So each rank writes the fingerprint of its hooks (1 for
// none, a hash of their names otherwise) into a slot of its own in every
// backward's step check, which every rank runs anyway, and ranks at the
// same step whose fingerprints differ raise the same message, naming which
// ranks have which hooks.
//
// The step in which the difference is found: a rank that registered a hook
// after the first forward launches no bucket in its next backward before
// the step check agrees (as with Note [Layer dropping]), so its hook's
// collectives never meet the other ranks' allreduces; those ranks' bucket
// allreduces are dropped without partner. Every rank raises from that
// backward, no gradient of that step is averaged, and the process group
// may hold the dropped allreduces: fix the code and restart.
// Note [The step check on bucket 0]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The step check of Note [Ranks out of step] is a collective of its own, and
// a latency-bound one: on a small model the backward is over before it
// completes, and bucket 0's allreduce queues behind it, so every iteration
// pays one more round trip than torch's DDP. Where every rank can tell, from
// what they all agree on, that no communication hook runs, the check rides
// on bucket 0's allreduce instead: the slots, as exact floating-point pieces
// (StepSlots, encode_pieces), go in a tail that this rank's bucket 0 is
// allreduced with (one allreduce of a buffer that holds a copy of bucket 0
// and then the tail). The divide-by-world-size never touches the tail:
// gradients are divided as they are copied into the bucket, or the bucket's
// own elements are, and the tail is written after. (At three ranks or more
// the buffer is laid out so that Gloo sums each of bucket 0's elements in
// the order it sums them in bucket 0 alone: point 3.)
//
// What it guarantees is what the separate check did, because collectives pair
// by order and every collective that can be paired with a check is shaped
// like the checks it can meet:
//  1. Where it applies (rides_on_bucket0 and the reducer's own_check:
//     Gloo, bucket 0 dense on the CPU in float32 or float64,
//     no hook that every rank confirmed, no layers
//     dropped, no buffers broadcast before forwards, not under Join, and
//     skip_all_reduce_unused_params off), every check of every rank has
//     the carrier's shape: a backward's rides on bucket 0, which
//     always travels first (buckets launch in index order, bucket 0 is never
//     skipped there); a check with no bucket to ride on (a forward's, should
//     one broadcast buffers after all; a rank's whose communication hook was
//     registered after the first forward) is an allreduce of a carrier of
//     zeros in bucket 0's place and the tail. The conditions are the same on
//     every rank: the layout, the options and the model are agreed, all
//     ranks enter Join together, and a hook registered late still counts as
//     none until a check confirmed it (its rank sends such a check).
//  2. Ranks out of step therefore pair a check with a check, as before, and
//     every rank reads every rank's slots when bucket 0 completes: before
//     any bucket's gradient is written back, the ranks with data that
//     disagree raise the same message and drop their other buckets. The
//     gradients were summed, as the separate check's were launched while
//     buckets flew, but none reaches .grad.
//  3. The sums stay exact: every slot but the rider is written by one rank
//     (zeros elsewhere), the rider sums votes of 0 or 1, and every piece
//     has at most 22 bits, so float32 adds them without rounding;
//     decode_pieces raises on a piece that is not a whole number below 2^24,
//     as a bucket 0 of another layout could give. And the gradients stay
//     bitwise those of bucket 0's own allreduce (torch's DDP's): at two
//     ranks a + b is b + a, whichever rank Gloo's ring starts a segment on,
//     and the carrier is bucket 0 then the tail. At three or more, a tail
//     simply appended would make the buffer longer, Gloo's ring would cut
//     it into other segments, and some of bucket 0's elements would be
//     summed in another order; so the carrier keeps each element in the
//     ring chunk of the index Gloo gives it in bucket 0 alone, which fixes
//     the order of its additions, and puts the tail in the room after each
//     chunk (Note [Gloo's ring chunks] in reducer/agreement/ring_chunks.h).
//     The unused room holds zeros, whose sums stay zeros.
//  4. Elsewhere (a hook registered before the first forward, layer
//     dropping, Join, buffers broadcast, NCCL, reduced precision, a
//     sharded bucket 0) the separate check of Note [Ranks out of step]
//     runs, on every rank alike. With the optimizer sharded and bucket 0
//     replicated the check rides: Note [The step check on a replicated
//     bucket 0].
// The cost: bucket 0 is copied into the buffer before its allreduce and
// back after it (memory bandwidth, on the CPU), and at three ranks or more
// the carrier holds a few elements per ring segment of padding besides
// bucket 0 and the tail, instead of one more latency-bound collective per
// iteration (docs/BENCHMARKS.md gives what each costs).

// Note [The step check on a replicated bucket 0]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With the optimizer sharded (Note [Sharded buckets] in
// reducer/transport/reduce_scatter.h) the transport runs no hook but
// answers runs_hook() as one does, so the check ran on its own. Where
// bucket 0 is replicated (Note [Replicated small buckets]) it is
// allreduced by the transport the reducer uses without sharding,
// CarrierWithStepCheck over Gloo, and the check rides on it exactly as in
// Note [The step check on bucket 0] (BucketTransport::carries_step_check):
// a model whose buckets are all replicated runs one collective per
// backward, as torch's DDP does. Where bucket 0 is sharded nothing changes.
// Points 1 to 4 still hold:
//  - The same decision on every rank. Whether bucket 0 is replicated is
//    ReduceScatter::replicates() of bucket 0's byte size, the world size
//    and shard_min_bytes: the layout is agreed (Note [Agreeing on the
//    bucket layout] in reducer/layout/bucket_layout.h, a rebuild applied on
//    every rank at the same backward), shard_min_bytes is agreed before
//    the reduce-scatter is set (agreed_shard_min_bytes in
//    ddp_ext/_sharded_optimizer.py), and the reducer asks it afresh at every
//    backward. The other conditions of point 1 are as without sharding;
//    hooks and Join are refused with sharding, so no hook can be
//    registered late.
//  - Bucket 0 is launched first in every synchronising backward (index
//    order; a sharded backward skips no bucket), so the check is still the
//    first collective a backward issues: the separate check and bucket 0's
//    allreduce, the first two collectives of each backward, become one. The
//    step's all-gathers (Gloo collectives launched from Python after the
//    backward, or behind the next forward, always before the next backward
//    begins) and the other buckets' reduce-scatters keep their places
//    around it.
//  - What the rest can pair with when ranks are out of step. Every rank's
//    iteration is the same sequence (the agreed layout and shard_min_bytes
//    fix which buckets are reduce-scattered and all-gathered), so a rank
//    that skipped a backward, or ran one more, pairs each backward's first
//    collective with a peer's first collective of a backward, a carrier
//    with a carrier, as the separate check paired with a separate check;
//    the remaining buckets then meet buckets of the same index, as they did.
//    A sharded bucket's reduce-scatter at three ranks or more is a ring of
//    point-to-point sends, which Gloo pairs by peer and tag apart from
//    collectives, so it can meet no check, carried or not. At two ranks it
//    is an all-to-all, a collective: it can meet, at the same position, a
//    peer's collective of that position, as before; the step's all-gathers
//    likewise. What a check can meet is thus what it met before, less the
//    separate bucket 0 allreduce, which no longer exists. NCCL's
//    reduce_scatter never meets a carrier: over NCCL the check is separate.
//  - Exact sums and gradients: bucket 0's allreduce is the carrier's of
//    point 3 (the replicated bucket's bits are those of torch's DDP), and
//    its shard is then copied out of the unpacked bucket.
// The carrier of bucket 0 is finished with the check at the end of the
// backward (PeerStepCheck::await_backward), not when later buckets wait
// for room among the buckets in flight, so it may stay in memory a little
// longer: fewer than shard_min_bytes.

// See Note [The step check on bucket 0]: whether a reducer's step checks
// ride on (or are shaped like) its bucket 0 `first`, over `group`.
// `own_check`: whether anything calls for a check of its own (a hook that
// every rank confirmed, buffers broadcast, layers dropped, Join,
// skip_all_reduce_unused_params).
bool rides_on_bucket0(const Bucket& first, const c10d::ProcessGroup& group, bool own_check);

class StepCheck {
 public:
  static constexpr int kTimings = StepSlots::kTimings;
  StepCheck(int rank, int world_size, c10::Device device);

  // This rank's entry in the check of a backward at training step `step`
  // (its plan and hooks fingerprints positive, its rider and timings as
  // StepEntry says); the reducer fills in the rest by name.
  static StepEntry backward_entry(int64_t step);

  // Starts the check of a backward with this rank's `entry` (backward_entry).
  void launch_backward(c10d::ProcessGroup& group, const StepEntry& entry);

  // Every rank's step timings (rank-major) from the last check waited for,
  // if any rank wrote some; empty otherwise.
  const std::vector<int64_t>& timings() const {
    return timings_;
  }

  // Starts the check of a forward's buffer broadcast, after `backwards`
  // synchronising backward passes.
  void launch_forward(c10d::ProcessGroup& group, int64_t backwards);

  // Takes part in a check without a position: for a rank that joined.
  void launch_as_joined(c10d::ProcessGroup& group);

  bool launched() const;

  // See Note [The step check on bucket 0]. Writes a backward check into the
  // tail (of `dtype`) that bucket 0's allreduce carries; no collective.
  void ride_on_bucket0(const StepEntry& entry, c10::ScalarType dtype);
  // Whether the check of this backward rides on bucket 0 and was not read.
  bool riding() const {
    return std::holds_alternative<Riding>(flight_);
  }
  // Bucket 0's `flat` and the tail, in one buffer laid out as Note [Gloo's
  // ring chunks] says, to allreduce while riding().
  const at::Tensor& carry(const at::Tensor& flat);
  // After that allreduce completed: copies bucket 0's part back into `flat`.
  void unpack(const at::Tensor& flat) const;
  // Then reads the check, as wait() does.
  std::string read_ridden();
  // A check shaped like the carrier of a bucket 0 of `flat`'s dtype and size:
  // for a backward that has no bucket 0 to ride on (a communication hook
  // registered after the first forward), and for forwards.
  void launch_backward_shaped_like(
      c10d::ProcessGroup& group, const at::Tensor& flat, const StepEntry& entry);
  std::string check_forward_shaped_like(
      c10d::ProcessGroup& group, const at::Tensor& flat, int64_t backwards,
      StallWatch* watch);

  // Waits for the check in flight. Returns an empty string when every rank
  // with data wrote what this rank wrote, else the error message (the same on
  // every rank).
  // With a `watch`, waits through it (Note [Hang attribution]).
  std::string wait(StallWatch* watch = nullptr);

  // Forgets a check in flight without waiting for it.
  void drop();

  // A whole forward check (any check left over from an unfinished iteration
  // dropped): its message, as wait() gives it.
  std::string check_forward(
      c10d::ProcessGroup& group, int64_t backwards, StallWatch* watch = nullptr);
  // A whole check as a rank that joined.
  void match_as_joined(c10d::ProcessGroup& group);

  // The rider slot summed over every rank by the last check waited for.
  int64_t summed_rider() const {
    return summed_rider_;
  }

 private:
  void start(c10d::ProcessGroup& group, const StepEntry& entry);
  // Writes `entry` into host_ and, as pieces, into a tail of `dtype`.
  void write_tail(const StepEntry& entry, c10::ScalarType dtype);
  // See Note [Gloo's ring chunks]: the layout of a carrier of `flat`, and the
  // carrier (carrier_) of `flat`'s elements and the tail.
  const ChunkedCarrier& layout_for(const at::Tensor& flat);
  void pack(const at::Tensor& flat);
  void start_shaped_like(
      c10d::ProcessGroup& group, const at::Tensor& flat, const StepEntry& entry);
  // `from_tail`: the check travelled as pieces in tail_ (Note [The step
  // check on bucket 0]).
  std::string read(bool from_tail);

  int rank_;
  int world_size_;
  StepSlots layout_;
  int64_t summed_rider_ = 0;
  int64_t written_ = 0; // this rank's slot in the check in flight
  std::vector<int64_t> timings_;
  // The slots (StepSlots's layout), on the CPU.
  at::Tensor host_;
  at::Tensor slots_; // the same on the parameters' device (host_ on CPU)
  // See Note [The step check on bucket 0].
  at::Tensor tail_; // the slots as pieces, on the CPU
  at::Tensor carrier_; // what is allreduced: bucket 0 (or zeros like it) and the tail
  std::optional<ChunkedCarrier> carried_; // carrier_'s layout

  // The check under way: none; an allreduce of its own (of slots_, or of a
  // carrier shaped like bucket 0's when `from_tail`); or written into tail_,
  // to leave with bucket 0's allreduce.
  struct Idle {};
  struct InFlight {
    c10::intrusive_ptr<c10d::Work> work;
    bool from_tail;
  };
  struct Riding {};
  std::variant<Idle, InFlight, Riding> flight_;
};

} // namespace ddp_ext::reducer
