#include "process_groups/hierarchical/future_work.h"

#include <c10/util/Exception.h>

namespace ddp_ext::hierarchical {

FutureWork::FutureWork(int rank, c10d::OpType op,
                       c10::intrusive_ptr<c10::ivalue::Future> future)
    : c10d::Work(rank, op), future_(std::move(future)) {}

bool FutureWork::isCompleted() {
  return future_->completed();
}

bool FutureWork::isSuccess() const {
  return future_->completed() && !future_->hasError();
}

std::exception_ptr FutureWork::exception() const {
  return future_->hasError() ? future_->exception_ptr() : nullptr;
}

std::vector<at::Tensor> FutureWork::result() {
  return future_->value().toTensorVector();
}

bool FutureWork::wait(std::chrono::milliseconds timeout) {
  TORCH_CHECK(timeout == kNoTimeout, "FutureWork::wait takes no timeout (the steps' groups have theirs)");
  future_->wait();
  future_->value(); // rethrows a step's error
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> FutureWork::getFuture() {
  return future_;
}

} // namespace ddp_ext::hierarchical
