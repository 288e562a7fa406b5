#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <exception>
#include <vector>

namespace ddp_ext::process_groups::mpi {

// The Work an MPI collective returns. The progress thread completes it
// (see Note [MPI progress thread]): wait() blocks until then and rethrows
// the collective's error, get_future() gives a Future of the output tensors
// that completes, or fails, at the same moment, so `.then()` chains (DDP's
// communication hooks) run on the progress thread as they do on Gloo's.
class MpiWork final : public c10d::Work {
 public:
  MpiWork(int rank, c10d::OpType op_type, std::vector<at::Tensor> outputs);

  // Marks the work done: completes the future with the outputs, or fails it.
  // Called once, by the progress thread, without the MPI lock.
  void complete(std::exception_ptr error = nullptr, int source_rank = -1);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  // For recv from any source: the rank the message came from.
  int sourceRank() const override;
  std::vector<at::Tensor> result() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  int source_rank_ = -1;
};

} // namespace ddp_ext::process_groups::mpi
