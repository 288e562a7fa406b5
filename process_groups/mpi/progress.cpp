#include "process_groups/mpi/progress.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>

namespace ddp_ext::process_groups::mpi {

namespace {

using Clock = std::chrono::steady_clock;

// Back-off between unproductive tests. See Note [MPI progress thread] step 3.
constexpr auto kSpinFor = std::chrono::microseconds(100);
constexpr auto kMaxSleep = std::chrono::microseconds(500);

std::exception_ptr backend_error(const std::string& message) {
  try {
    C10_THROW_ERROR(DistBackendError, message);
  } catch (...) {
    return std::current_exception();
  }
}

} // namespace

MpiProgress::MpiProgress(std::string description)
    : description_(std::move(description)), thread_([this] { run(); }) {}

MpiProgress::~MpiProgress() {
  {
    std::lock_guard<std::mutex> guard(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.get_id() == std::this_thread::get_id()) {
    // The last reference went in a `.then()` callback on this very thread.
    thread_.detach();
    return;
  }
  thread_.join();
}

bool MpiProgress::broken() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return static_cast<bool>(broken_);
}

void MpiProgress::enqueue(MpiOp op) {
  std::exception_ptr broken;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    broken = broken_;
    if (!broken) {
      queue_.push_back(std::move(op));
    }
  }
  if (broken) {
    op.work->complete(broken);
    return;
  }
  wake_.notify_one();
}

void MpiProgress::fail(MpiOp& op, std::exception_ptr error) {
  op.work->complete(std::move(error));
}

void MpiProgress::start(MpiOp op) {
  std::vector<MPI_Request> requests;
  try {
    std::lock_guard<std::mutex> guard(mpi_lock());
    requests = op.start();
  } catch (...) {
    fail(op, std::current_exception());
    return;
  }
  const auto deadline = Clock::now() + op.timeout;
  in_flight_.push_back(InFlight{std::move(op), std::move(requests), deadline});
}

std::size_t MpiProgress::poll() {
  std::vector<InFlight> done;
  std::vector<std::exception_ptr> errors;
  std::vector<int> sources;
  {
    std::lock_guard<std::mutex> guard(mpi_lock());
    for (auto it = in_flight_.begin(); it != in_flight_.end();) {
      const auto type = it->op.work->retrieveOpType();
      const bool receive = type == c10d::OpType::RECV ||
          type == c10d::OpType::RECVANYSOURCE;
      // Only a receive reads its status (the sender's rank).
      MPI_Status status;
      int flag = 0;
      const int rc = MPI_Testall(
          static_cast<int>(it->requests.size()), it->requests.data(), &flag,
          receive ? &status : MPI_STATUSES_IGNORE);
      if (rc == MPI_SUCCESS && !flag) {
        ++it;
        continue;
      }
      std::exception_ptr error;
      try {
        check(rc, it->op.name);
      } catch (...) {
        error = std::current_exception();
      }
      errors.push_back(error);
      sources.push_back(receive ? status.MPI_SOURCE : -1);
      done.push_back(std::move(*it));
      it = in_flight_.erase(it);
    }
  }
  // Finish steps and callbacks run without the MPI lock: a `.then()`
  // callback may issue the next collective.
  for (std::size_t i = 0; i < done.size(); ++i) {
    auto& op = done[i].op;
    std::exception_ptr error = errors[i];
    if (!error && op.finish) {
      try {
        op.finish();
      } catch (...) {
        error = std::current_exception();
      }
    }
    op.work->complete(error, error ? -1 : sources[i]);
  }
  return done.size();
}

void MpiProgress::expire(Clock::time_point now) {
  const auto late = std::find_if(
      in_flight_.begin(), in_flight_.end(),
      [&](const InFlight& f) { return now >= f.deadline; });
  if (late == in_flight_.end()) {
    return;
  }
  const auto error = backend_error(
      "ddp_ext_mpi: " + std::string(late->op.name) + " on " + description_ +
      " timed out after " + std::to_string(late->op.timeout.count()) +
      " ms: a peer did not take part in it (it may have died, hung, or "
      "called a different collective). MPI cannot cancel a collective, so "
      "this process group is now unusable: every collective on it fails "
      "from now on. Destroy it and end the job; MPI jobs cannot replace a "
      "rank, so the job must be restarted.");
  std::deque<MpiOp> queued;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    broken_ = error;
    queued.swap(queue_);
  }
  mark_abandoned();
  for (auto& f : in_flight_) {
    fail(f.op, error);
    abandoned_.push_back(std::move(f)); // MPI may still write its buffers
  }
  in_flight_.clear();
  for (auto& op : queued) {
    fail(op, error);
  }
}

void MpiProgress::run() {
  auto last_progress = Clock::now();
  while (true) {
    std::deque<MpiOp> fresh;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      if (in_flight_.empty()) {
        wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      } else {
        const auto idle = Clock::now() - last_progress;
        if (idle >= kSpinFor) {
          const auto sleep = std::min<Clock::duration>(idle / 8, kMaxSleep);
          wake_.wait_for(lock, sleep, [&] { return !queue_.empty(); });
        }
      }
      if (stopping_ && queue_.empty() && in_flight_.empty()) {
        return;
      }
      fresh.swap(queue_);
    }
    if (!fresh.empty()) {
      last_progress = Clock::now();
    }
    for (auto& op : fresh) {
      start(std::move(op));
    }
    if (poll() > 0) {
      last_progress = Clock::now();
    } else if (in_flight_.empty()) {
      continue;
    } else {
      std::this_thread::yield();
    }
    expire(Clock::now());
  }
}

} // namespace ddp_ext::process_groups::mpi
