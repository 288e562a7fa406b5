#pragma once

#include <ATen/core/ivalue.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "comm_hooks/comm_hook.h"
#include "comm_hooks/compression/int8_exchange.h"
#include "process_groups/ordered_launches.h"
#include "comm_hooks/compression/precision_policy.h"
#include "comm_hooks/compression/residuals.h"

namespace ddp_ext::compression {

struct AdaptivePrecisionOptions {
  // When to choose what; see PolicyOptions.
  PolicyOptions policy;
  // Elements per int8 scale. Default: 1024 (scales add 0.4% to the bytes).
  int64_t int8_chunk = 1024;
  // How 8-bit payloads travel; see Note [Eight bits at any world size].
  // Default: int8_exchange_for(world size).
  std::optional<Int8Exchange> int8_exchange;
};

// One format decision, as the tests and reports see it.
struct PrecisionDecision {
  int64_t iteration;                // first iteration it applies to
  std::string mode;                 // window_mode_name
  std::vector<std::string> formats; // per bucket, precision_name
  std::optional<double> full_cost_ms;
  std::optional<double> compressed_cost_ms;
};

// The adaptive-precision communication hook's state and work; see Note
// [Adaptive precision] in comm_hooks/compression/precision_policy.h. Follows torch's
// hook contract: run() takes a bucket of gradients not yet divided by the
// world size and returns a future whose value is the averaged bucket. One
// instance per DDP model.
class AdaptivePrecision : public std::enable_shared_from_this<AdaptivePrecision> {
 public:
  // `companion`: a group of the same ranks that carries nothing else, for
  // the second round of kReduceScatter; needed only with that exchange.
  // See Note [Eight bits at any world size], Ordering.
  AdaptivePrecision(c10::intrusive_ptr<c10d::ProcessGroup> group,
                    AdaptivePrecisionOptions options,
                    c10::intrusive_ptr<c10d::ProcessGroup> companion = {});

  c10::intrusive_ptr<c10::ivalue::Future> run(c10d::GradBucket& bucket);

  // Synchronising iterations begun (counted at each iteration's first bucket).
  int64_t iterations() const;
  // Bytes this rank handed to collectives for buckets (payloads only, not
  // the once-a-window agreement of a few numbers).
  int64_t bytes_sent() const;
  std::string mode() const;
  std::vector<std::string> formats() const;
  std::vector<PrecisionDecision> decisions() const;
  Int8Exchange int8_exchange() const { return int8_exchange_; }
  // What bucket `index` owes to later iterations (error feedback); undefined
  // if nothing. A copy.
  at::Tensor residual(size_t index) const;

 private:
  using Clock = std::chrono::steady_clock;
  using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;

  void begin_bucket(size_t index);
  void finish_iteration_cost();
  void conclude_window(const at::Tensor& like, std::unique_lock<std::mutex>& lock);
  FuturePtr send_full(c10d::GradBucket& bucket, at::Tensor& flat);
  FuturePtr send_half(c10d::GradBucket& bucket, at::Tensor& flat);
  FuturePtr send_int8(c10d::GradBucket& bucket, at::Tensor& flat);
  FuturePtr send_int8_gathered(at::Tensor& owed, c10d::GradBucket& bucket, at::Tensor& flat);
  FuturePtr send_int8_scattered(at::Tensor& owed, c10d::GradBucket& bucket, at::Tensor& flat);
  // Records that a bucket's reduction finished now (for the cost).
  void note_completion();
  // The future's value becomes `result`, once `finish` has run on completion.
  FuturePtr complete_with(FuturePtr sent, at::Tensor result,
                          std::function<void()> finish);

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  const int64_t world_size_;
  const int64_t int8_chunk_;
  const Int8Exchange int8_exchange_;
  const c10::intrusive_ptr<c10d::ProcessGroup> companion_;
  // kReduceScatter's second rounds, in hook order.
  const std::shared_ptr<OrderedLaunches> gathers_;

  mutable std::mutex mutex_; // everything below but the completion time
  PrecisionPolicy policy_;
  Residuals residuals_;
  std::vector<PrecisionDecision> decisions_;
  int64_t iteration_ = -1;
  std::optional<size_t> last_index_;
  int64_t bytes_sent_ = 0;
  // The window under way: per-bucket squared norms, and per-iteration costs.
  std::vector<double> window_sq_norms_;
  double window_cost_ms_ = 0;
  int64_t window_costs_ = 0;
  // The iteration under way: time spent encoding, and when its last bucket
  // had been handed to the process group.
  double encode_ms_ = 0;
  std::optional<Clock::time_point> last_launch_;

  std::mutex completion_mutex_;
  std::optional<Clock::time_point> last_completion_;
};

// An AdaptivePrecision as the reducer's hook (no Python, no GIL). It keeps
// no state the reducer's rebuilds could invalidate: its error feedback
// follows parameters (comm_hooks/compression/residuals.h).
class AdaptivePrecisionCommHook : public comm_hooks::CommHook {
 public:
  explicit AdaptivePrecisionCommHook(std::shared_ptr<AdaptivePrecision> state)
      : state_(std::move(state)) {}
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override;
  at::Tensor parseHookResult(const c10::IValue& result) override;
  bool keeps_per_bucket_state() const override {
    return false;
  }

 private:
  std::shared_ptr<AdaptivePrecision> state_;
};

} // namespace ddp_ext::compression
