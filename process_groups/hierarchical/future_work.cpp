#include "process_groups/hierarchical/future_work.h"

#include <c10/util/Exception.h>

#include <condition_variable>
#include <memory>
#include <mutex>

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
  if (timeout != kNoTimeout && !future_->completed()) {
    // Like Gloo's work: raise when the deadline passes first. The state is
    // shared with the callback, which may run after this wait gave up.
    struct Done {
      std::mutex mutex;
      std::condition_variable cv;
      bool done = false;
    };
    auto done = std::make_shared<Done>();
    future_->addCallback([done](c10::ivalue::Future&) {
      std::lock_guard<std::mutex> lock(done->mutex);
      done->done = true;
      done->cv.notify_all();
    });
    std::unique_lock<std::mutex> lock(done->mutex);
    TORCH_CHECK(done->cv.wait_for(lock, timeout, [&] { return done->done; }),
                "Timed out after ", timeout.count(), " ms waiting for a hierarchical collective");
  }
  future_->wait();
  future_->value(); // rethrows a step's error
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> FutureWork::getFuture() {
  return future_;
}

} // namespace ddp_ext::hierarchical
