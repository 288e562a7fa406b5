#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

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
// on the caller's thread, in call order.
//
// Only what the reducer needs is hierarchical: a SUM allreduce of one
// dense CPU tensor. Any other allreduce, and broadcast and barrier, go to the flat
// group; other collectives are refused (this backend is handed to the
// reducer only; ddp.process_group stays the flat group).

struct HierarchicalGroups {
  c10::intrusive_ptr<c10d::ProcessGroup> flat;         // every rank
  c10::intrusive_ptr<c10d::ProcessGroup> intra;        // this host's ranks: step 1
  c10::intrusive_ptr<c10d::ProcessGroup> inter;        // this local rank on every host: step 2
  c10::intrusive_ptr<c10d::ProcessGroup> intra_gather; // this host's ranks again: step 3
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

 private:
  HierarchicalGroups groups_;
  std::shared_ptr<OrderedLaunches> across_;  // step 2, in call order
  std::shared_ptr<OrderedLaunches> gathers_; // step 3, in call order
  std::shared_ptr<std::atomic<int64_t>> calls_;
};

} // namespace ddp_ext::hierarchical
