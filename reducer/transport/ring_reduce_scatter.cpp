// Gloo's reduce-scatter as a ring of sends: Note [A ring of sends for the reduce-scatter].
#include "reducer/transport/ring_reduce_scatter.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <exception>
#include <string>
#include <utility>

#include "reducer/agreement/ring_chunks.h"

namespace ddp_ext::reducer {

RingPlan RingPlan::of(int64_t length, int64_t element_size, int world_size) {
  TORCH_INTERNAL_ASSERT(length > 0 && world_size >= 3);
  RingPlan plan;
  plan.length = length;
  plan.chunk = gloo_ring_chunk(length, element_size, world_size);
  plan.shard = (length + world_size - 1) / world_size;
  plan.world_size = world_size;
  return plan;
}

int64_t RingPlan::chunk_begin(int64_t c) const {
  return std::min(c * chunk, length);
}

int64_t RingPlan::chunk_length(int64_t c) const {
  return std::clamp<int64_t>(length - c * chunk, 0, chunk);
}

std::vector<RingPiece> RingPlan::fixups() const {
  std::vector<RingPiece> pieces;
  for (int c = 0; c < world_size; ++c) {
    for (int r = 0; r < world_size; ++r) {
      const int64_t lo = std::max(c * chunk, r * shard);
      const int64_t hi = std::min({c * chunk + chunk, r * shard + shard, length});
      if (hi > lo) {
        pieces.push_back(RingPiece{c, r, lo, hi - lo});
      }
    }
  }
  return pieces;
}

int64_t RingPlan::sent_elements(int rank) const {
  int64_t sent = length - chunk_length(rank);
  for (const RingPiece& piece : fixups()) {
    if (piece.from == rank && piece.to != rank) {
      sent += piece.length;
    }
  }
  return sent;
}

class RingWork;

struct RingReduceScatter::Ring {
  c10::intrusive_ptr<c10d::Backend> gloo;
  at::Tensor flat;
  at::Tensor shard;
  size_t index = 0;
  RingPlan plan;
  int rank = 0;
  std::shared_ptr<std::atomic<bool>> cut_short; // the transport's: See the Note

  std::mutex mutex; // guards what follows, and every write into flat and shard
  bool cancelled = false;
  bool completed = false;
  RingWork* work = nullptr; // cleared when the Work is dropped
  std::vector<c10::intrusive_ptr<c10d::Work>> pending; // sends and receives posted

  // Stops the ring: no more writes, its pending sends and receives aborted.
  // `detach`: its Work is being dropped.
  void cancel(bool detach);
  void complete(std::exception_ptr error);
  // Runs the ring on the calling thread; raises what stopped it.
  void execute();

 private:
  int tag(int round) const {
    const int64_t slot = static_cast<int64_t>(index) * plan.world_size + round;
    return kTagBase + static_cast<int>(slot % kTagBase);
  }
  c10::intrusive_ptr<c10d::Work> post(at::Tensor tensor, int peer, int tag, bool send);
  void wait(const c10::intrusive_ptr<c10d::Work>& work);
  template <typename Write>
  void write(const Write& what) {
    std::lock_guard<std::mutex> lock(mutex);
    TORCH_CHECK(!cancelled, "the ring was cancelled");
    at::NoGradGuard no_grad;
    what();
  }
};

// A bucket's reduce-scatter: completed by the ring's thread.
class RingWork : public c10d::Work {
 public:
  explicit RingWork(std::shared_ptr<RingReduceScatter::Ring> ring)
      : c10d::Work(-1, c10d::OpType::REDUCE_SCATTER),
        ring_(std::move(ring)),
        future_(c10::make_intrusive<c10::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()))) {}
  ~RingWork() override {
    ring_->cancel(/*detach=*/true); // See the Note: dropped before completion.
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    return future_;
  }

  // Called with the ring's mutex held.
  void complete(const std::exception_ptr& error) {
    finish(error);
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue(std::vector<at::Tensor>{ring_->shard}));
    }
  }

 private:
  std::shared_ptr<RingReduceScatter::Ring> ring_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

namespace {

std::exception_ptr ring_error(size_t index, const std::string& what) {
  try {
    C10_THROW_ERROR(
        DistBackendError, "the reduce-scatter of bucket " + std::to_string(index) +
            " (a ring of sends over Gloo) failed: " + what);
  } catch (...) {
    return std::current_exception();
  }
}

} // namespace

void RingReduceScatter::Ring::cancel(bool detach) {
  std::vector<c10::intrusive_ptr<c10d::Work>> aborted;
  {
    std::lock_guard<std::mutex> lock(mutex);
    cancelled = true;
    if (!completed) {
      cut_short->store(true);
    }
    if (detach) {
      work = nullptr;
    }
    aborted = pending;
  }
  for (const auto& p2p : aborted) {
    p2p->abort();
  }
}

void RingReduceScatter::Ring::complete(std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(mutex);
  if (completed) {
    return;
  }
  completed = true;
  if (error) {
    cut_short->store(true);
  }
  if (work) {
    work->complete(error);
  }
}

c10::intrusive_ptr<c10d::Work> RingReduceScatter::Ring::post(
    at::Tensor tensor, int peer, int tag, bool send) {
  std::lock_guard<std::mutex> lock(mutex);
  TORCH_CHECK(!cancelled, "the ring was cancelled");
  std::vector<at::Tensor> tensors{std::move(tensor)};
  auto p2p = send ? gloo->send(tensors, peer, tag) : gloo->recv(tensors, peer, tag);
  pending.push_back(p2p);
  return p2p;
}

void RingReduceScatter::Ring::wait(const c10::intrusive_ptr<c10d::Work>& p2p) {
  const bool done = p2p->wait(); // Gloo's timeout: the process group's
  std::lock_guard<std::mutex> lock(mutex);
  pending.erase(std::find(pending.begin(), pending.end(), p2p));
  TORCH_CHECK(done && !cancelled, "the ring was cancelled");
}

void RingReduceScatter::Ring::execute() {
  const int ranks = plan.world_size;
  const int next = (rank + 1) % ranks;
  const int previous = (rank + ranks - 1) % ranks;
  at::Tensor received = at::empty({plan.chunk}, flat.options());
  // The ring: the partial sums travel down to the chunk's owner.
  for (int round = 0; round + 1 < ranks; ++round) {
    const int sent = plan.sent_chunk(rank, round);
    const int got = (sent + 1) % ranks;
    const int64_t sent_length = plan.chunk_length(sent);
    const int64_t got_length = plan.chunk_length(got);
    c10::intrusive_ptr<c10d::Work> receive;
    c10::intrusive_ptr<c10d::Work> send;
    if (got_length > 0) {
      receive = post(received.narrow(0, 0, got_length), next, tag(round), /*send=*/false);
    }
    if (sent_length > 0) {
      send = post(
          flat.narrow(0, plan.chunk_begin(sent), sent_length), previous, tag(round), /*send=*/true);
    }
    if (receive) {
      wait(receive);
      // This rank's values plus the partial: Note [Ring-ordered sum]'s order.
      write([&] {
        flat.narrow(0, plan.chunk_begin(got), got_length).add_(received.narrow(0, 0, got_length));
      });
    }
    if (send) {
      wait(send);
    }
  }
  // The fix-up: each shard's elements from the chunks that hold them.
  const int fixup = tag(ranks - 1);
  const int64_t first = static_cast<int64_t>(rank) * plan.shard;
  const std::vector<RingPiece> pieces = plan.fixups();
  std::vector<c10::intrusive_ptr<c10d::Work>> sends;
  for (const RingPiece& piece : pieces) {
    if (piece.from == rank && piece.to != rank) {
      sends.push_back(
          post(flat.narrow(0, piece.begin, piece.length), piece.to, fixup, /*send=*/true));
    }
  }
  for (const RingPiece& piece : pieces) {
    if (piece.to != rank) {
      continue;
    }
    at::Tensor out = shard.narrow(0, piece.begin - first, piece.length);
    if (piece.from == rank) {
      write([&] { out.copy_(flat.narrow(0, piece.begin, piece.length)); });
    } else {
      wait(post(received.narrow(0, 0, piece.length), piece.from, fixup, /*send=*/false));
      write([&] { out.copy_(received.narrow(0, 0, piece.length)); });
    }
  }
  const int64_t within = std::clamp<int64_t>(plan.length - first, 0, plan.shard);
  if (within < plan.shard) {
    write([&] { shard.narrow(0, within, plan.shard - within).zero_(); });
  }
  for (const auto& send : sends) {
    wait(send);
  }
}

c10::intrusive_ptr<c10d::Work> RingReduceScatter::launch(
    const c10::intrusive_ptr<c10d::Backend>& gloo, at::Tensor flat, at::Tensor shard,
    size_t index) {
  TORCH_CHECK(
      !cut_short_->load(),
      "the reduce-scatter of bucket ", index,
      " cannot run: an earlier reduce-scatter of this wrapper (a ring of sends over Gloo) ended "
      "unfinished, after an error on some rank, and its peers' messages may still be in flight. "
      "Build the DistributedDataParallel wrapper and its overlap_optimizer(..., shard=True) again "
      "to go on training.");
  auto ring = std::make_shared<Ring>();
  ring->cut_short = cut_short_;
  ring->gloo = gloo;
  ring->plan = RingPlan::of(flat.numel(), flat.element_size(), gloo->getSize());
  TORCH_INTERNAL_ASSERT(shard.numel() == ring->plan.shard && flat.is_contiguous());
  ring->flat = std::move(flat);
  ring->shard = std::move(shard);
  ring->index = index;
  ring->rank = gloo->getRank();
  auto work = c10::make_intrusive<RingWork>(ring);
  ring->work = work.get();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(ring));
    for (int lane = static_cast<int>(threads_.size()); lane < kLanes; ++lane) {
      threads_.emplace_back([this, lane] { run(lane); });
    }
  }
  wake_.notify_one();
  return work;
}

void RingReduceScatter::run(int lane) {
  while (true) {
    std::shared_ptr<Ring> ring;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (stopping_) {
        return;
      }
      ring = std::move(queue_.front());
      queue_.pop_front();
      running_[lane] = ring;
    }
    std::exception_ptr error;
    try {
      ring->execute();
    } catch (const std::exception& failure) {
      error = ring_error(ring->index, failure.what());
    }
    ring->complete(error);
    std::lock_guard<std::mutex> lock(mutex_);
    running_[lane].reset();
  }
}

RingReduceScatter::~RingReduceScatter() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    for (const auto& ring : running_) {
      if (ring) {
        ring->cancel(/*detach=*/false);
      }
    }
  }
  wake_.notify_all();
  for (std::thread& thread : threads_) {
    thread.join();
  }
  for (const auto& ring : queue_) {
    ring->cancel(/*detach=*/false);
    ring->complete(ring_error(ring->index, "the reducer was destroyed"));
  }
}

} // namespace ddp_ext::reducer
