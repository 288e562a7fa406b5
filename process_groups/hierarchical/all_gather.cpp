// HierarchicalBackend's all-gather: Note [Hierarchical all-gather] in
// process_groups/hierarchical/backend.h.

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <utility>
#include <vector>

#include "process_groups/hierarchical/backend.h"
#include "process_groups/hierarchical/future_work.h"
#include "process_groups/hierarchical/in_turn.h"
#include "process_groups/single_tensor_collectives.h"

namespace ddp_ext::hierarchical {
namespace {

// One all-gather's tensors, shared by its steps' callbacks.
struct Gather {
  at::Tensor output; // the caller's, H x L x S: shard (h, l) of rank h * L + l
  at::Tensor input;  // this rank's shard (maybe a view of `output`)
  int64_t local_rank = 0;
  c10::intrusive_ptr<c10::ivalue::Future> result;

  void fail(std::exception_ptr error) {
    if (!result->completed()) {
      result->setError(std::move(error));
    }
  }
};

bool runs_in_two_steps(const at::Tensor& output, const at::Tensor& input, int64_t world_size) {
  return output.device().is_cpu() && input.device().is_cpu() && !output.is_sparse() && !input.is_sparse() &&
      output.is_contiguous() && input.is_contiguous() && output.scalar_type() == input.scalar_type() &&
      input.numel() > 0 && output.numel() == input.numel() * world_size;
}

} // namespace

int64_t HierarchicalBackend::hierarchical_gathers() const {
  return gathered_->load();
}

c10::intrusive_ptr<c10d::Work> HierarchicalBackend::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  if (!groups_.gather_across || !runs_in_two_steps(output, input, getSize())) {
    return process_groups::all_gather_single(*groups_.flat, output, input, opts);
  }
  gathered_->fetch_add(1);
  const int64_t hosts = groups_.gather_across->getSize();
  const int64_t local = groups_.gather_inside->getSize();
  auto gather = std::make_shared<Gather>();
  gather->output = output.view({hosts, local, -1});
  gather->input = input.view({-1});
  gather->local_rank = groups_.gather_inside->getRank();
  gather->result = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));

  // Step 1, here: this local rank's shard of every host, in place.
  std::vector<std::vector<at::Tensor>> across(1);
  for (int64_t h = 0; h < hosts; ++h) {
    across[0].push_back(gather->output.select(0, h).select(0, gather->local_rank));
  }
  std::vector<at::Tensor> mine{gather->input};
  auto first = groups_.gather_across->allgather(across, mine, c10d::AllgatherOptions());
  const auto ticket = insides_->take();
  auto inside = groups_.gather_inside->getBackend(c10::DeviceType::CPU); // Note [Hierarchical allreduce], ordering
  // Step 2, once step 1 has arrived: the H shards of local rank l' for every l' (strided views).
  auto gather_inside = [gather, inside]() {
    const int64_t local = gather->output.size(1);
    std::vector<std::vector<at::Tensor>> within(1);
    for (int64_t l = 0; l < local; ++l) {
      within[0].push_back(gather->output.select(1, l));
    }
    std::vector<at::Tensor> column{gather->output.select(1, gather->local_rank)};
    auto second = inside->allgather(within, column, c10d::AllgatherOptions());
    second->getFuture()->addCallback([gather](c10::ivalue::Future& finished) {
      if (finished.hasError()) {
        gather->fail(finished.exception_ptr());
        return;
      }
      gather->result->markCompleted(c10::IValue(std::vector<at::Tensor>{gather->output}));
    });
  };
  launch_in_turn(first, insides_, ticket, [gather](std::exception_ptr error) { gather->fail(error); },
                 gather_inside);
  return c10::make_intrusive<FutureWork>(getRank(), c10d::OpType::_ALLGATHER_BASE, gather->result);
}

} // namespace ddp_ext::hierarchical
