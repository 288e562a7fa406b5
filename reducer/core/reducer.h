#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "reducer/base/accumulator_hooks.h"
#include "reducer/base/averaging.h"
#include "reducer/base/reducer_options.h"
#include "reducer/core/late_gradients.h"
#include "reducer/core/phase.h"
#include "reducer/core/state_lock.h"
#include "reducer/finish/end_of_backward.h"
#include "reducer/layout/bucket_layout.h"
#include "reducer/observation/observer.h"
#include "reducer/observation/stall_watch.h"
#include "reducer/observation/step_timings.h"
#include "reducer/observation/timeline.h"
#include "reducer/participation/backward_usage.h"
#include "reducer/participation/layer_drop.h"
#include "reducer/participation/static_graph.h"
#include "reducer/participation/usage.h"
#include "reducer/transport/bucket_hook.h"
#include "reducer/transport/bucket_transport.h"
#include "reducer/transport/step_check_policy.h"

namespace ddp_ext::reducer {

// The gradient reducer of paper section 3.2 (Algorithm 1), as a small core
// (phases, readiness, launch order in the same bucket order on every rank)
// that owns one object per variant: its bucket transport (Note [Bucket
// transports]), its step check (Note [Step check policies]) and its end of
// a backward (Note [The end of a backward]).
// Always owned by a std::shared_ptr: Note [Reducer lifetime].
class Reducer : public std::enable_shared_from_this<Reducer>, private LockWindows {
 public:
  // params[i] is named param_names[i]; every parameter requires grad. The
  // buckets are laid out with options.bucket_caps (Note [Agreeing on the
  // bucket layout]); sparse_gradients[i] (empty: none) gives parameter i a
  // sparse bucket of its own (Note [Sparse gradients]).
  Reducer(
      std::vector<at::Tensor> params,
      std::vector<std::string> param_names,
      c10::intrusive_ptr<c10d::ProcessGroup> process_group,
      ReducerOptions options,
      const std::vector<bool>& sparse_gradients = {});
  ~Reducer(); // removes every autograd hook this reducer installed

  // The iteration (Note [Reducer phases]). At every forward with gradients
  // enabled; raises if the last synchronising backward left gradients
  // unreduced. `training_step`: see Note [Ranks out of step].
  void prepare_for_forward(bool training_step = false);
  // torch's _rebuild_buckets (the first rebuild, if due) and
  // _push_all_rebuilt_params (Note [Agreeing on the bucket layout]).
  bool rebuild_buckets();
  void shadowed_backward();
  // At the end of a forward whose backward synchronises: `outputs` are
  // searched for unused parameters (Note [Unused parameters]); `dropped` and
  // `accumulated_only`: see Note [Layer dropping].
  void prepare_for_backward(
      const std::vector<at::Tensor>& outputs,
      const std::vector<size_t>& dropped = {},
      const std::vector<size_t>& accumulated_only = {});
  // no_sync: a forward inside it; entering it (Note [Unprepared backward]).
  void prepare_for_local_backward();
  void allow_local_accumulation();
  // Raises, as prepare_for_forward would, if the last backward did not finish.
  void check_finalized() const;
  // From parameter `index`'s autograd hook (false: ran with no gradient).
  void on_gradient_ready(size_t index, bool gradient_arrived);

  // Static graphs (Note [Static graph]): set before the first synchronising
  // backward; the learning iteration ends when its backward has (queued from
  // the output sink) or now (torch's _delay_all_reduce).
  void set_static_graph();
  bool learning_static_graph() const;
  void queue_finish_learning_iteration();
  void finish_learning_iteration();

  // Hooks (once, between iterations: Note [Bucket transports]) and Join: a
  // bucket reduced as this reducer's would be, or summed (torch's
  // _run_allreduce_hook); Note [Join and the divide factor].
  void register_comm_hook(std::shared_ptr<BucketHook> hook);
  c10::intrusive_ptr<c10::ivalue::Future> run_comm_hook(c10d::GradBucket& bucket);
  c10::intrusive_ptr<c10::ivalue::Future> run_allreduce(c10d::GradBucket& bucket);
  std::vector<c10d::GradBucket> zeros_like_grad_buckets() const;
  void set_forward_pass_work(
      c10::intrusive_ptr<c10d::Work> work, bool divide_by_initial_world_size);

  // The step check (Note [Ranks out of step]): before a forward's buffer
  // broadcast, as a joined rank, and the hooks' fingerprint it compares
  // (Note [Hooks registered after the first forward]).
  void check_step_before_forward_collectives();
  void match_step_check_as_joined();
  void set_comm_hook_fingerprint(int64_t fingerprint, bool confirm);

  void remove_autograd_hooks();
  // Forgets the iteration under way; communicates on `process_group` from now on.
  void update_process_group(c10::intrusive_ptr<c10d::ProcessGroup> process_group);

  // Reads the bucket layout under the reducer's lock: `read(const BucketLayout&)`.
  template <typename Read>
  auto read_layout(Read read) const {
    const auto lock = lock_state(Access::kRead);
    return read(layout_);
  }
  // Settings between iterations: new caps (the same on every rank; returns
  // whether the layout changed) and ReducerOptions::overlap_with_backward.
  bool set_bucket_caps(const std::vector<int64_t>& caps);
  void set_overlap_with_backward(bool overlap);

  // Figures: steps and synchronising backwards begun, the usage bitmap,
  // whether every iteration left the same parameters unused, the phase.
  int64_t training_steps() const;
  int64_t iterations() const;
  at::Tensor local_used_map();
  bool unused_parameters_stable() const;
  Phase phase() const;

  // Note [Reducer observers]: Note [Runtime statistics], Note [Stragglers]
  // (every <= 0: off), Note [Communication timeline], Note [Hang attribution].
  RuntimeTimes runtime_times() const;
  void set_straggler_every(int64_t every);
  std::pair<int64_t, std::vector<int64_t>> straggler_figures() const;
  void set_timeline(bool on);
  std::vector<TimelineEvent> take_timeline(int64_t* dropped, int64_t wait_ms);
  void set_stall_handler(int64_t timeout_ms, std::function<void(const StallReport&)> handler);

  // Note [The end of a backward]: a step per reduced bucket (empty: off) or
  // reduce-scattered buckets (Note [Sharded buckets]); the forward's share.
  using BucketStep = reducer::BucketStep;
  void set_bucket_step(BucketStep step);
  void set_reduce_scatter(BucketStep step, int64_t replicated_below = 0);
  void set_forward_tail(double fraction);
  std::vector<std::pair<size_t, std::vector<size_t>>> deferred_buckets() const;
  void finish_deferred(size_t bucket_index);

  // Note [Late gradients]: whether a backward after the last
  // synchronisation left gradients on this rank alone, and their parameters.
  bool has_late_gradients() const;
  std::vector<size_t> take_late_gradients();

 private:
  // The iteration (reducer.cpp).
  void enter(Phase from, Phase to);
  void start_reducing();
  // `arrived`: false for a dropped layer's parameter (Note [Layer dropping]).
  void mark_ready(size_t index, bool arrived = true);
  void copy_into_bucket(size_t index, bool scale);
  void launch_ready_buckets();
  void launch(size_t bucket_index);
  void launch_all_buckets();
  TransportContext transport_context();
  void wait_for_launched_buckets();
  void wait_for_bucket(size_t bucket_index);
  void finalize_backward();
  void queue_at_end_of_backward(void (Reducer::*step)());
  // Drops the collectives under way without waiting, and what it stashed.
  void abandon_iteration();
  bool stays_local() const;
  bool tracks_usage() const;
  bool may_be_globally_unused(size_t index) const;
  // The layout (rebuilds.cpp): pending counts refilled; a rebuild agreed.
  void arm_buckets();
  void conclude_layout(bool launched_at_end);
  // The write-back (write_back.cpp; Note [Used by no rank]).
  BackwardUsage conclude_usage();
  void write_back_gradients(const BackwardUsage& usage);
  void write_back_bucket(Bucket& bucket, const BackwardUsage& usage);
  void write_back_views(
      const std::vector<at::Tensor>& views, const std::vector<size_t>& param_indices,
      const BackwardUsage& usage, bool as_view);
  // The end of a backward (end_of_backward.cpp, buckets_of_backward.h).
  class BucketsOfBackward;
  bool may_hold_buckets() const;
  void check_nothing_deferred(const char* what) const;
  // The step check (step_agreement.cpp; Note [The step check on bucket 0]).
  void reset_step_check();
  bool needs_own_step_check() const;
  void raise_if_out_of_step();
  // Hang reports (stall_report.cpp; Note [Hang attribution]).
  std::string unfinished_reduction_message() const;
  [[noreturn]] void raise_unfinished_reduction();
  StallReport stall_report(const StallEvent& event) const;
  void watch_backward_end();
  void check_backward_ended();
  // A setting refused while gradients are being reduced: `what` names it.
  void check_between_iterations(const char* what) const;

  // The lock and its windows (state_lock.cpp; Note [Windows without the
  // lock]), which an UnlockedWindow opens and closes (LockWindows).
  enum class Access { kRead, kChange };
  std::unique_lock<std::mutex> lock_state(Access access) const;
  void open_window(const char* what) override;
  void close_window() override;

  const std::vector<at::Tensor> params_;
  const std::vector<std::string> param_names_;
  const std::vector<bool> sparse_gradients_;
  c10::intrusive_ptr<c10d::ProcessGroup> process_group_;
  ReducerOptions options_; // overlap_with_backward changes
  bool gradients_stay_local_; // Note [A world of one rank]
  // Allreduce, CarrierWithStepCheck or HookTransport; never null. Shared with
  // a joined rank's shadowing, which runs it without the lock.
  std::shared_ptr<BucketTransport> transport_;
  AccumulatorHooks hooks_; // calls on_gradient_ready (Note [Reducer lifetime])
  BucketLayout layout_; // Note [Agreeing on the bucket layout]
  Averaging averaging_; // Note [Gradient averaging]

  mutable StateLock lock_; // guards everything below

  Phase phase_ = Phase::kIdle;
  int64_t iterations_ = 0;
  int64_t training_steps_ = 0; // Note [Ranks out of step]
  int64_t backwards_begun_ = 0;
  // NoStepCheck or PeerStepCheck (Note [Step check policies]); never null.
  std::unique_ptr<StepCheckPolicy> step_check_;
  std::vector<bool> ready_; // per parameter, this iteration
  size_t next_bucket_ = 0; // first bucket not yet launched
  StaticGraph static_graph_;
  Usage usage_;
  // Note [Layer dropping]: this iteration's plan, whether the step check
  // confirmed it, and Note [Hooks registered after the first forward].
  DropPlan drop_plan_;
  std::vector<size_t> accumulated_only_;
  bool drops_layers_ = false;
  bool plan_confirmed_ = true;
  int64_t hook_fingerprint_ = 1;
  bool hook_unconfirmed_ = false;

  Timeline timeline_;
  StallWatch stall_;
  int64_t backward_step_ = 0; // training_steps_ when the backward began
  bool reported_unfinished_ = false;
  StepTimings timings_;
  // WriteBackAll, StepPerBucket or StepAndDeferTail; never null.
  std::unique_ptr<EndOfBackward> end_of_backward_ = std::make_unique<WriteBackAll>();
  LateGradients late_;
  ReducerObservers observers_; // timings_, timeline_ and late_
};

} // namespace ddp_ext::reducer
