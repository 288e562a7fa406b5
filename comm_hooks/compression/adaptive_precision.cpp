#include "comm_hooks/compression/adaptive_precision.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>

#include "comm_hooks/compression/accumulate.h"
#include "comm_hooks/compression/int8_codec.h"

namespace ddp_ext::compression {
namespace {

constexpr size_t kMaxDecisions = 10000;

double milliseconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

std::vector<std::string> format_names(const PrecisionPolicy& policy, size_t buckets) {
  std::vector<std::string> names;
  for (size_t b = 0; b < buckets; ++b) {
    names.emplace_back(precision_name(policy.format(b)));
  }
  return names;
}

} // namespace

AdaptivePrecision::AdaptivePrecision(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                     AdaptivePrecisionOptions options,
                                     c10::intrusive_ptr<c10d::ProcessGroup> companion)
    : group_(std::move(group)),
      world_size_(group_->getSize()),
      int8_chunk_(options.int8_chunk),
      int8_exchange_(options.int8_exchange.value_or(int8_exchange_for(world_size_))),
      companion_(std::move(companion)),
      gathers_(std::make_shared<OrderedLaunches>()),
      policy_(options.policy) {
  TORCH_CHECK(int8_chunk_ > 0, "int8_chunk must be positive, got ", int8_chunk_);
  TORCH_CHECK(int8_exchange_ != Int8Exchange::kReduceScatter || !policy_.options().int8_allowed ||
                  (companion_ && companion_->getSize() == world_size_ &&
                   companion_->getRank() == group_->getRank()),
              "AdaptivePrecision: the reduce_scatter exchange of 8-bit payloads needs a "
              "companion process group of the same ranks (see Note [Eight bits at any world size])");
}

c10::intrusive_ptr<c10::ivalue::Future> AdaptivePrecision::run(c10d::GradBucket& bucket) {
  std::unique_lock<std::mutex> lock(mutex_);
  const size_t index = bucket.getIndex();
  at::Tensor flat = bucket.getBufferRef().view({-1});
  if (!last_index_ || index <= *last_index_) {
    finish_iteration_cost();
    ++iteration_;
    if (iteration_ > 0 && iteration_ % policy_.options().check_every == 0) {
      conclude_window(flat, lock);
    }
  }
  last_index_ = index;
  begin_bucket(index);

  const auto start = Clock::now();
  FuturePtr sent;
  if (flat.scalar_type() != at::kFloat) {
    sent = send_full(bucket, flat); // only float32 is compressed
  } else {
    switch (policy_.format(index)) {
      case Precision::kFull:
        sent = send_full(bucket, flat);
        break;
      case Precision::kHalf:
        sent = send_half(bucket, flat);
        break;
      case Precision::kInt8:
        sent = send_int8(bucket, flat);
        break;
    }
  }
  const auto launched = Clock::now();
  encode_ms_ += milliseconds(launched - start);
  last_launch_ = launched;
  return sent;
}

void AdaptivePrecision::begin_bucket(size_t index) {
  if (window_sq_norms_.size() <= index) {
    window_sq_norms_.resize(index + 1, 0.0);
  }
}

void AdaptivePrecision::finish_iteration_cost() {
  std::optional<Clock::time_point> completed;
  {
    std::lock_guard<std::mutex> guard(completion_mutex_);
    completed = std::exchange(last_completion_, std::nullopt);
  }
  if (last_launch_ && completed && *completed >= *last_launch_) {
    window_cost_ms_ += encode_ms_ + milliseconds(*completed - *last_launch_);
    ++window_costs_;
  }
  encode_ms_ = 0;
  last_launch_.reset();
}

void AdaptivePrecision::conclude_window(const at::Tensor& like,
                                        std::unique_lock<std::mutex>& lock) {
  // See Note [Adaptive precision], Agreement: one float64 tensor of the
  // window's per-bucket squared norms, this rank's mean cost, and whether
  // it measured one; summed over ranks.
  const size_t buckets = window_sq_norms_.size();
  std::vector<double> figures(window_sq_norms_);
  figures.push_back(window_costs_ > 0 ? window_cost_ms_ / window_costs_ : 0.0);
  figures.push_back(window_costs_ > 0 ? 1.0 : 0.0);
  at::Tensor agreed = at::tensor(figures, at::dtype(at::kDouble)).to(like.device());
  std::vector<at::Tensor> tensors{agreed};
  lock.unlock();
  group_->allreduce(tensors)->wait();
  at::Tensor summed = agreed.cpu();
  lock.lock();

  const double* values = summed.data_ptr<double>();
  WindowReport report;
  report.bucket_sq_norms.assign(values, values + buckets);
  if (values[buckets + 1] > 0) {
    report.cost_ms = values[buckets] / values[buckets + 1];
  }
  policy_.conclude_window(report, iteration_);
  std::fill(window_sq_norms_.begin(), window_sq_norms_.end(), 0.0);
  window_cost_ms_ = 0;
  window_costs_ = 0;
  if (decisions_.size() < kMaxDecisions) {
    decisions_.push_back(PrecisionDecision{
        iteration_, window_mode_name(policy_.mode()), format_names(policy_, buckets),
        policy_.full_cost_ms(), policy_.compressed_cost_ms()});
  }
}

AdaptivePrecision::FuturePtr AdaptivePrecision::complete_with(
    FuturePtr sent, at::Tensor result, std::function<void()> finish) {
  std::weak_ptr<AdaptivePrecision> weak = weak_from_this();
  return sent->then(
      [weak, result = std::move(result), finish = std::move(finish)](
          c10::ivalue::Future& done) -> c10::IValue {
        TORCH_CHECK(!done.hasError(), done.tryRetrieveErrorMessage());
        finish();
        if (auto self = weak.lock()) {
          self->note_completion();
        }
        return c10::IValue(result);
      },
      c10::TensorType::get());
}

void AdaptivePrecision::note_completion() {
  const auto now = Clock::now();
  std::lock_guard<std::mutex> guard(completion_mutex_);
  if (!last_completion_ || *last_completion_ < now) {
    last_completion_ = now;
  }
}

AdaptivePrecision::FuturePtr AdaptivePrecision::send_full(c10d::GradBucket& bucket,
                                                          at::Tensor& flat) {
  window_sq_norms_[bucket.getIndex()] += squared_norm(flat);
  flat.div_(world_size_);
  if (flat.scalar_type() == at::kFloat) {
    // Whatever earlier roundings owed goes out now; nothing is left behind.
    at::Tensor owed = residuals_.take(bucket.getIndex(), bucket.getParameters(), flat);
    if (owed.defined()) {
      flat.add_(owed);
    }
  }
  bytes_sent_ += flat.numel() * flat.element_size();
  std::vector<at::Tensor> tensors{flat};
  return complete_with(group_->allreduce(tensors)->getFuture(), bucket.getBuffer(), [] {});
}

AdaptivePrecision::FuturePtr AdaptivePrecision::send_half(c10d::GradBucket& bucket,
                                                          at::Tensor& flat) {
  at::Tensor& owed = residuals_.of(bucket.getIndex(), bucket.getParameters(), flat);
  window_sq_norms_[bucket.getIndex()] +=
      accumulate_scaled(owed, flat, 1.0 / static_cast<double>(world_size_));
  at::Tensor half = owed.to(at::kHalf);
  owed.sub_(half);
  bytes_sent_ += half.numel() * half.element_size();
  std::vector<at::Tensor> tensors{half};
  return complete_with(group_->allreduce(tensors)->getFuture(), bucket.getBuffer(),
                       [flat, half] { flat.copy_(half); });
}

AdaptivePrecision::FuturePtr AdaptivePrecision::send_int8(c10d::GradBucket& bucket,
                                                          at::Tensor& flat) {
  at::Tensor& owed = residuals_.of(bucket.getIndex(), bucket.getParameters(), flat);
  window_sq_norms_[bucket.getIndex()] +=
      accumulate_scaled(owed, flat, 1.0 / static_cast<double>(world_size_));
  return int8_exchange_ == Int8Exchange::kAllgather
      ? send_int8_gathered(owed, bucket, flat)
      : send_int8_scattered(owed, bucket, flat);
}

AdaptivePrecision::FuturePtr AdaptivePrecision::send_int8_gathered(at::Tensor& owed,
                                                                   c10d::GradBucket& bucket,
                                                                   at::Tensor& flat) {
  const int64_t bytes = int8_payload_bytes(flat.numel(), int8_chunk_);
  at::Tensor payload = at::empty({bytes}, flat.options().dtype(at::kByte));
  encode_int8(owed, payload, int8_chunk_);
  bytes_sent_ += bytes;
  // See Note [Adaptive precision]: gathered, then summed in rank order.
  std::vector<std::vector<at::Tensor>> gathered(1);
  for (int64_t r = 0; r < world_size_; ++r) {
    gathered[0].push_back(at::empty_like(payload));
  }
  std::vector<at::Tensor> inputs{payload};
  auto sent = group_->allgather(gathered, inputs)->getFuture();
  const int64_t chunk = int8_chunk_;
  return complete_with(std::move(sent), bucket.getBuffer(),
                       [flat, payloads = gathered[0], chunk]() mutable {
                         decode_sum_int8(payloads, flat, chunk);
                       });
}

namespace {

// The steps of one bucket's kReduceScatter exchange that run on completion
// callbacks; see Note [Eight bits at any world size].
struct ScatteredBucket {
  Int8Segments segments;
  int64_t rank;
  int64_t chunk;
  at::Tensor owed;     // this rank's residual of the whole bucket
  at::Tensor flat;     // the bucket, where the average is written
  at::Tensor buffer;   // the bucket as the hook's result
  at::Tensor received; // round 1: every rank's payload of this rank's segment
  c10::intrusive_ptr<c10::ivalue::Future> result;

  int64_t slot(int64_t r) const {
    return (segments.bytes[r] + 3) / 4 * 4;
  }

  // Round 1 has arrived: sums this rank's segment, encodes the sum again,
  // and feeds what that misses back into this rank's residual. Returns the
  // payload for round 2, padded to the largest slot.
  at::Tensor owner_payload() {
    const int64_t numel = segments.numel[rank];
    const int64_t bytes = segments.bytes[rank];
    at::Tensor mine = at::zeros({segments.largest_slot}, received.options());
    if (numel == 0) {
      return mine;
    }
    std::vector<at::Tensor> payloads;
    for (int64_t r = 0; r < static_cast<int64_t>(segments.numel.size()); ++r) {
      payloads.push_back(received.narrow(0, r * slot(rank), bytes));
    }
    at::Tensor sum = at::empty({numel}, owed.options());
    decode_sum_int8(payloads, sum, chunk);
    at::Tensor payload = mine.narrow(0, 0, bytes);
    encode_int8(sum, payload, chunk);
    owed.narrow(0, segments.begin[rank], numel).add_(sum);
    return mine;
  }

  // Round 2 has arrived: every owner's payload, decoded into its segment.
  void decode(const std::vector<at::Tensor>& gathered) {
    for (size_t r = 0; r < gathered.size(); ++r) {
      if (segments.numel[r] == 0) {
        continue;
      }
      at::Tensor out = flat.narrow(0, segments.begin[r], segments.numel[r]);
      decode_sum_int8({gathered[r].narrow(0, 0, segments.bytes[r])}, out, chunk);
    }
  }
};

} // namespace

AdaptivePrecision::FuturePtr AdaptivePrecision::send_int8_scattered(at::Tensor& owed,
                                                                    c10d::GradBucket& bucket,
                                                                    at::Tensor& flat) {
  auto job = std::make_shared<ScatteredBucket>();
  job->segments = int8_segments(flat.numel(), int8_chunk_, world_size_);
  job->rank = group_->getRank();
  job->chunk = int8_chunk_;
  job->owed = owed;
  job->flat = flat;
  job->buffer = bucket.getBuffer();
  job->result = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
  const Int8Segments& seg = job->segments;

  // Round 1: segment s's payload goes to rank s.
  at::Tensor outgoing = at::zeros({seg.total_bytes}, flat.options().dtype(at::kByte));
  std::vector<int64_t> out_splits;
  for (int64_t s = 0; s < world_size_; ++s) {
    out_splits.push_back(job->slot(s));
    if (seg.numel[s] == 0) {
      continue;
    }
    at::Tensor values = owed.narrow(0, seg.begin[s], seg.numel[s]);
    at::Tensor payload = outgoing.narrow(0, seg.offset[s], seg.bytes[s]);
    encode_int8(values, payload, int8_chunk_);
  }
  job->received = at::empty({world_size_ * job->slot(job->rank)}, outgoing.options());
  std::vector<int64_t> in_splits(world_size_, job->slot(job->rank));
  bytes_sent_ += seg.total_bytes + seg.largest_slot;
  // alltoall_base: all_to_all_single's name in every supported torch.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  auto first = group_->alltoall_base(job->received, outgoing, in_splits, out_splits)->getFuture();
#pragma GCC diagnostic pop
  const OrderedLaunches::Ticket ticket = gathers_->take();

  std::weak_ptr<AdaptivePrecision> weak = weak_from_this();
  auto companion = companion_;
  auto gathers = gathers_;
  first->addCallback([job, ticket, companion, gathers, weak,
                      outgoing](c10::ivalue::Future& done) {
    at::Tensor mine;
    std::exception_ptr failed;
    if (done.hasError()) {
      failed = done.exception_ptr();
    } else {
      try {
        mine = job->owner_payload();
      } catch (...) {
        failed = std::current_exception();
      }
    }
    // Round 2, in hook order on the companion group (a failed round 1
    // still takes its turn, launching nothing).
    gathers->ready(ticket, [job, companion, weak, mine, failed]() {
      if (failed) {
        job->result->setError(failed);
        return;
      }
      try {
        auto gathered = std::make_shared<std::vector<std::vector<at::Tensor>>>(1);
        for (int64_t r = 0; r < companion->getSize(); ++r) {
          (*gathered)[0].push_back(at::empty_like(mine));
        }
        std::vector<at::Tensor> inputs{mine};
        auto second = companion->allgather(*gathered, inputs)->getFuture();
        second->addCallback([job, gathered, weak](c10::ivalue::Future& done) {
          if (done.hasError()) {
            job->result->setError(done.exception_ptr());
            return;
          }
          try {
            job->decode((*gathered)[0]);
          } catch (...) {
            job->result->setError(std::current_exception());
            return;
          }
          if (auto self = weak.lock()) {
            self->note_completion();
          }
          job->result->markCompleted(c10::IValue(job->buffer));
        });
      } catch (...) {
        job->result->setError(std::current_exception());
      }
    });
  });
  return job->result;
}

int64_t AdaptivePrecision::iterations() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return iteration_ + 1;
}

int64_t AdaptivePrecision::bytes_sent() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return bytes_sent_;
}

std::string AdaptivePrecision::mode() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return window_mode_name(policy_.mode());
}

std::vector<std::string> AdaptivePrecision::formats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return format_names(policy_, window_sq_norms_.size());
}

std::vector<PrecisionDecision> AdaptivePrecision::decisions() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return decisions_;
}

at::Tensor AdaptivePrecision::residual(size_t index) const {
  std::lock_guard<std::mutex> lock(mutex_);
  at::Tensor values = residuals_.get(index);
  return values.defined() ? values.clone() : values;
}

c10::intrusive_ptr<c10::ivalue::Future> AdaptivePrecisionCommHook::runHook(
    c10d::GradBucket& bucket) {
  return state_->run(bucket);
}

at::Tensor AdaptivePrecisionCommHook::parseHookResult(const c10::IValue& result) {
  return c10d::detail::parseCppCommHookResult(result);
}

} // namespace ddp_ext::compression
