#include "process_groups/mpi/work.h"

#include <ATen/core/jit_type.h>
#include <c10/util/Exception.h>

#include <utility>

namespace ddp_ext::process_groups::mpi {

MpiWork::MpiWork(int rank, c10d::OpType op_type, std::vector<at::Tensor> outputs)
    : c10d::Work(rank, op_type),
      outputs_(std::move(outputs)),
      future_(c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()))) {}

void MpiWork::complete(std::exception_ptr error, int source_rank) {
  {
    std::lock_guard<std::mutex> guard(mutex_);
    source_rank_ = source_rank;
  }
  // Work first, so that a waiter woken by the future sees the work done too.
  finish(error);
  if (error) {
    future_->setError(error);
  } else {
    future_->markCompleted(c10::IValue(outputs_));
  }
}

bool MpiWork::isCompleted() {
  std::lock_guard<std::mutex> guard(mutex_);
  return completed_;
}

bool MpiWork::isSuccess() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return completed_ && !exception_;
}

std::exception_ptr MpiWork::exception() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return exception_;
}

int MpiWork::sourceRank() const {
  std::lock_guard<std::mutex> guard(mutex_);
  TORCH_CHECK(source_rank_ >= 0,
              "ddp_ext_mpi: sourceRank() is known only for a completed "
              "receive; wait() for it first.");
  return source_rank_;
}

std::vector<at::Tensor> MpiWork::result() {
  return outputs_;
}

c10::intrusive_ptr<c10::ivalue::Future> MpiWork::getFuture() {
  return future_;
}

} // namespace ddp_ext::process_groups::mpi
