#pragma once

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <vector>

namespace ddp_ext::hierarchical {

// A c10d::Work done when `future` is (its value: the list of result
// tensors), for collectives made of several steps.
class FutureWork final : public c10d::Work {
 public:
  FutureWork(int rank, c10d::OpType op, c10::intrusive_ptr<c10::ivalue::Future> future);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  std::vector<at::Tensor> result() override;
  bool wait(std::chrono::milliseconds timeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

} // namespace ddp_ext::hierarchical
