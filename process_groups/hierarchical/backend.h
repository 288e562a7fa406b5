#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "process_groups/ordered_launches.h"

namespace ddp_ext::hierarchical {

// Note [Hierarchical allreduce]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With H hosts of L ranks each, joined by a link slower than the inside of
// a host, a flat ring allreduce of N bytes over W = H * L ranks makes each
// host send 2 (W - 1)/W * N across the slow link. This backend allreduces
// one tensor in three steps over groups the caller made with
// dist.new_group (Gloo):
//
//   1. reduce-scatter inside the host (`intra`): local rank l gets the
//      host's sum of segment l (the tensor cut in L equal segments, the
//      last padded with zeros), as an all-to-all of segments summed by
//      their owner in local-rank order (Gloo's reduce-scatter gives no
//      future to chain the next step on);
//   2. allreduce of segment l across hosts, among the ranks of local rank
//      l (`inter`): every host sends 2 (H - 1)/H * N across the link in
//      all, its L ranks each sending a segment of N / L, side by side;
//   3. allgather of the segments inside the host (`intra_gather`).
//
// Sums run in another order than the flat ring's (host sums first), so the
// result may differ from flat allreduce in the last bits of float sums;
// every rank gets the same bits (step 2's result is identical on the ranks
// of a segment, and step 3 copies).
//
// Ordering: steps 2 and 3 start when the step before has arrived, so they
// are issued from completion callbacks; each runs on its own group that
// carries nothing else, issued there in the order the allreduces were
// called (OrderedLaunches), which is the same on every rank. Step 1 runs
// on the caller's thread, in call order. The callbacks call the groups'
// Gloo backends directly, not through the dispatcher: on a Gloo thread a
// dispatched collective is an operator call the profiler records, and
// torch's profiler crashes when it stops while another thread is in one.
//
// Only what the reducer needs is hierarchical: a SUM allreduce of one
// dense CPU tensor, and the sharded optimizer's all-gather (Note
// [Hierarchical all-gather]). Any other allreduce or all-gather, and
// broadcast and barrier, go to the flat group; other collectives are
// refused (this backend is handed to the reducer and the sharded
// optimizer only; ddp.process_group stays the flat group).

// Note [Hierarchical all-gather]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The sharded optimizer all-gathers each bucket's shards (S elements per
// rank, rank r = host h * L + local rank l) into the bucket, in rank order.
// Gloo's ring sends every shard but one over each host's link: (W - 1)/W
// of the bucket. In two steps it sends (H - 1)/H:
//   1. all-gather across hosts, among the ranks of local rank l
//      (`gather_across`): each shard crosses the link once, to one rank of
//      each other host; rank (h, l) then holds the shards of (h', l) for
//      every host h', written in place into the output;
//   2. all-gather inside the host (`gather_inside`) of those H shards: the
//      output's shards (h', l') for every l' (strided views of it).
// It only copies, so the bits are the flat all-gather's; each rank sends
// (H - 1) S across and (L - 1) H S inside, (W - 1) S in all, as the ring.
// Step 2 starts when step 1 has arrived, issued from its completion
// callback in call order (OrderedLaunches), on groups that carry nothing
// else; step 1 runs on the caller's thread, in call order. Gloo's
// all-gather reads its input into a temporary before writing its output,
// so the input may be the rank's own range of the output. Where the groups
// are not given, or the tensors are not one contiguous dense CPU output of
// W inputs, the flat group's all-gather runs.

struct HierarchicalGroups {
  c10::intrusive_ptr<c10d::ProcessGroup> flat;         // every rank
  c10::intrusive_ptr<c10d::ProcessGroup> intra;        // this host's ranks: step 1
  c10::intrusive_ptr<c10d::ProcessGroup> inter;        // this local rank on every host: step 2
  c10::intrusive_ptr<c10d::ProcessGroup> intra_gather; // this host's ranks again: step 3
  // Note [Hierarchical all-gather] (optional: without them it is flat).
  c10::intrusive_ptr<c10d::ProcessGroup> gather_across; // this local rank on every host: step 1
  c10::intrusive_ptr<c10d::ProcessGroup> gather_inside; // this host's ranks: step 2
};

class HierarchicalBackend final : public c10d::Backend {
 public:
  static constexpr const char* kName = "ddp_ext_hierarchical";

  explicit HierarchicalBackend(HierarchicalGroups groups);

  const HierarchicalGroups& groups() const {
    return groups_;
  }
  // Allreduces run in three steps so far.
  int64_t hierarchical_calls() const;
  // All-gathers run in two steps so far.
  int64_t hierarchical_gathers() const;

  const std::string getBackendName() const override {
    return kName;
  }

  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) override;

 private:
  HierarchicalGroups groups_;
  std::shared_ptr<OrderedLaunches> across_;  // step 2, in call order
  std::shared_ptr<OrderedLaunches> gathers_; // step 3, in call order
  std::shared_ptr<std::atomic<int64_t>> calls_;
  std::shared_ptr<OrderedLaunches> insides_; // all-gathers' step 2, in call order
  std::shared_ptr<std::atomic<int64_t>> gathered_;
};

} // namespace ddp_ext::hierarchical
