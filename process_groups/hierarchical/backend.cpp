#include "process_groups/hierarchical/backend.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <utility>

#include "process_groups/hierarchical/future_work.h"
#include "process_groups/hierarchical/in_turn.h"
#include "process_groups/single_tensor_collectives.h"

namespace ddp_ext::hierarchical {
namespace {

using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;

// One allreduce's buffers, shared by its steps' callbacks.
struct Steps {
  at::Tensor tensor;   // the caller's, overwritten with the result
  at::Tensor padded;   // L segments: the input of step 1, the output of step 3
  at::Tensor received; // step 1: the host's ranks' copies of this rank's segment
  at::Tensor segment;  // this rank's segment: step 1's sum, step 2's result
  c10d::ReduceOp op;
  FuturePtr result;

  void fail(std::exception_ptr error) {
    if (!result->completed()) {
      result->setError(std::move(error));
    }
  }
};

// Runs `then` once `work` is done, or fails `steps` (`then` may throw).
void after(const c10::intrusive_ptr<c10d::Work>& work, const std::shared_ptr<Steps>& steps,
           std::function<void()> then) {
  work->getFuture()->addCallback([steps, then = std::move(then)](c10::ivalue::Future& done) {
    if (done.hasError()) {
      steps->fail(done.exception_ptr());
      return;
    }
    try {
      then();
    } catch (...) {
      steps->fail(std::current_exception());
    }
  });
}

} // namespace

HierarchicalBackend::HierarchicalBackend(HierarchicalGroups groups)
    : c10d::Backend(groups.flat->getRank(), groups.flat->getSize()),
      groups_(std::move(groups)),
      across_(std::make_shared<OrderedLaunches>()),
      gathers_(std::make_shared<OrderedLaunches>()),
      calls_(std::make_shared<std::atomic<int64_t>>(0)),
      insides_(std::make_shared<OrderedLaunches>()),
      gathered_(std::make_shared<std::atomic<int64_t>>(0)) {
  TORCH_CHECK(groups_.intra && groups_.inter && groups_.intra_gather,
              "HierarchicalBackend needs the intra-host, inter-host and gather groups");
  const int64_t local = groups_.intra->getSize();
  TORCH_CHECK(groups_.intra_gather->getSize() == local &&
                  groups_.intra_gather->getRank() == groups_.intra->getRank() &&
                  local * groups_.inter->getSize() == groups_.flat->getSize(),
              "HierarchicalBackend: ", groups_.flat->getSize(), " ranks are not ",
              groups_.inter->getSize(), " hosts of ", local, " ranks (intra-host groups of ",
              local, " and ", groups_.intra_gather->getSize(), ")");
  TORCH_CHECK(!groups_.gather_across == !groups_.gather_inside, "HierarchicalBackend: give both gather groups or none");
  TORCH_CHECK(!groups_.gather_across ||
                  (groups_.gather_across->getSize() == groups_.inter->getSize() &&
                   groups_.gather_across->getRank() == groups_.inter->getRank() &&
                   groups_.gather_inside->getSize() == local &&
                   groups_.gather_inside->getRank() == groups_.intra->getRank()),
              "HierarchicalBackend: the gather groups are not the inter-host and intra-host groups' ranks");
}

int64_t HierarchicalBackend::hierarchical_calls() const {
  return calls_->load();
}

c10::intrusive_ptr<c10d::Work> HierarchicalBackend::allreduce(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
  if (tensors.size() != 1 || !tensors[0].device().is_cpu() || tensors[0].is_sparse() ||
      !tensors[0].is_contiguous() || tensors[0].numel() == 0 ||
      opts.reduceOp != c10d::ReduceOp::SUM) {
    return groups_.flat->allreduce(tensors, opts);
  }
  calls_->fetch_add(1);
  auto steps = std::make_shared<Steps>();
  steps->tensor = tensors[0];
  steps->op = opts.reduceOp;
  steps->result = c10::make_intrusive<c10::ivalue::Future>(
      c10::ListType::create(c10::TensorType::get()));
  const int64_t numel = steps->tensor.numel();
  const int64_t local = groups_.intra->getSize();
  const int64_t segment = (numel + local - 1) / local;
  if (segment * local == numel) {
    // Equal segments: step 1 reads the tensor and step 3 writes it in place.
    steps->padded = steps->tensor.view({-1});
  } else {
    steps->padded = at::empty({segment * local}, steps->tensor.options());
    steps->padded.narrow(0, 0, numel).copy_(steps->tensor.view({-1}));
    steps->padded.narrow(0, numel, segment * local - numel).zero_();
  }
  steps->segment = at::empty({segment}, steps->tensor.options());

  // See Note [Hierarchical allreduce]. Step 1, here, in call order: segment
  // l of every rank of the host goes to local rank l (Gloo's reduce-scatter
  // gives no future to wait on), which sums them in rank order.
  steps->received = at::empty({segment * local}, steps->tensor.options());
  std::vector<int64_t> equal_splits;
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  auto first = groups_.intra->alltoall_base(steps->received, steps->padded, equal_splits, equal_splits);
#pragma GCC diagnostic pop
  const auto across_ticket = across_->take();
  const auto gather_ticket = gathers_->take();
  auto groups = groups_;
  auto across = across_;
  auto gathers = gathers_;

  auto gather = [steps, groups]() {
    auto third = process_groups::all_gather_single(
        *groups.intra_gather->getBackend(c10::DeviceType::CPU), steps->padded, steps->segment,
        c10d::AllgatherOptions());
    after(third, steps, [steps]() {
      if (!steps->padded.is_same(steps->tensor) &&
          steps->padded.data_ptr() != steps->tensor.data_ptr()) {
        steps->tensor.view({-1}).copy_(steps->padded.narrow(0, 0, steps->tensor.numel()));
      }
      steps->result->markCompleted(c10::IValue(std::vector<at::Tensor>{steps->tensor}));
    });
  };
  auto reduce_across = [steps, groups, gathers, gather_ticket, gather]() {
    std::vector<at::Tensor> segment{steps->segment};
    c10d::AllreduceOptions across_opts;
    across_opts.reduceOp = steps->op;
    auto second = groups.inter->getBackend(c10::DeviceType::CPU)->allreduce(segment, across_opts);
    launch_in_turn(second, gathers, gather_ticket, [steps](std::exception_ptr error) { steps->fail(error); },
                   gather);
  };
  first->getFuture()->addCallback(
      [steps, across, gathers, across_ticket, gather_ticket, reduce_across](c10::ivalue::Future& done) {
        const bool failed = done.hasError();
        if (failed) {
          steps->fail(done.exception_ptr());
        }
        across->ready(across_ticket, [steps, reduce_across, gathers, gather_ticket, failed]() {
          if (failed) {
            gathers->ready(gather_ticket, [] {});
            return;
          }
          try {
            const int64_t local = steps->received.numel() / steps->segment.numel();
            at::Tensor copies = steps->received.view({local, -1});
            steps->segment.copy_(copies[0]);
            for (int64_t r = 1; r < local; ++r) {
              steps->segment.add_(copies[r]);
            }
            reduce_across();
          } catch (...) {
            steps->fail(std::current_exception());
            gathers->ready(gather_ticket, [] {});
          }
        });
      });
  return c10::make_intrusive<FutureWork>(getRank(), c10d::OpType::ALLREDUCE, steps->result);
}

c10::intrusive_ptr<c10d::Work> HierarchicalBackend::broadcast(
    std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) {
  return groups_.flat->broadcast(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> HierarchicalBackend::barrier(const c10d::BarrierOptions& opts) {
  return groups_.flat->barrier(opts);
}

} // namespace ddp_ext::hierarchical
