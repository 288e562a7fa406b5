#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <atomic>
#include <condition_variable>
#include <exception>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "reducer/base/accumulator_hooks.h"
#include "reducer/base/averaging.h"
#include "reducer/core/late_gradients.h"
#include "reducer/layout/bucket.h"
#include "reducer/layout/bucket_layout.h"
#include "reducer/layout/gradient_order.h"
#include "reducer/participation/backward_usage.h"
#include "reducer/participation/layer_drop.h"
#include "reducer/base/reducer_options.h"
#include "reducer/finish/end_of_backward.h"
#include "reducer/observation/observer.h"
#include "reducer/observation/step_timings.h"
#include "reducer/observation/stall_watch.h"
#include "reducer/participation/static_graph.h"
#include "reducer/agreement/step_check.h"
#include "reducer/observation/timeline.h"
#include "reducer/participation/usage.h"
#include "reducer/transport/bucket_hook.h"
#include "reducer/transport/bucket_transport.h"

namespace ddp_ext::reducer {

// Note [Reducer phases]
// ~~~~~~~~~~~~~~~~~~~~~
// Within one training iteration the reducer moves through explicit phases:
//
//   kIdle ──prepare_for_backward──▶ kExpectingGradients ──first gradient──▶
//   kReducing ──last bucket launched, end of backward: finalize──▶ kIdle
//
//   any phase but kReducing ──prepare_for_local_backward──▶ kAccumulating
//   kAccumulating ──prepare_for_backward──▶ kExpectingGradients
//
// kIdle: no backward is expected (before the first forward, after a
//   finished reduction, under torch.no_grad). A gradient that arrives now
//   came from a backward the reducer was never told about (a backward over
//   the wrapped module outside the wrapper, a second backward over the same
//   graph): as torch's DDP does, it stays in .grad, unaveraged. See Note
//   [Unprepared backward].
// kAccumulating: the last forward ran inside no_sync (or no_sync was entered
//   with nothing armed): backward passes only accumulate into .grad.
// kExpectingGradients: a synchronising forward ran. A forward may start again
//   from here (a forward without backward is legal) and simply re-arms.
// kReducing: gradients are being copied into buckets and allreduced. A
//   forward that starts in this phase means the previous backward never gave
//   some parameters a gradient: prepare_for_forward raises "Expected to have
//   finished reduction in the prior iteration", naming them. Every rank that
//   skipped a parameter raises there. A rank that skipped nothing, while
//   another rank did, cannot know: it waits in its backward for an allreduce
//   its peer never starts, until the process group's timeout (torch's DDP
//   behaves the same). find_unused_parameters=True avoids both.
//
// Every transition goes through Reducer::enter(), which asserts where it
// comes from.
enum class Phase { kIdle, kAccumulating, kExpectingGradients, kReducing };

const char* phase_name(Phase phase);

// The gradient reducer of paper section 3.2 (Algorithm 1): copies gradients
// into buckets as autograd produces them, reduces each bucket as soon as it
// is full, in the same bucket order on every rank, and writes the averages
// back to .grad at the end of the backward pass.
// Always owned by a std::shared_ptr (the Python binding's holder); see Note
// [Reducer lifetime].
class Reducer : public std::enable_shared_from_this<Reducer> {
 public:
  // params[i] is named param_names[i] (used in error messages); every
  // parameter must require grad. The buckets are laid out with
  // options.bucket_caps (Note [Agreeing on the bucket layout]).
  // sparse_gradients[i] (empty: none) marks parameters whose gradients are
  // sparse; each gets a bucket of its own. See Note [Sparse gradients].
  Reducer(
      std::vector<at::Tensor> params,
      std::vector<std::string> param_names,
      c10::intrusive_ptr<c10d::ProcessGroup> process_group,
      ReducerOptions options,
      const std::vector<bool>& sparse_gradients = {});

  // Removes every autograd hook this reducer installed.
  ~Reducer();

  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Called at the start of every forward with gradients enabled. Raises on
  // every rank if the previous synchronising backward left gradients
  // unreduced. `training_step`: the forward synchronises and the module is in
  // training mode; see Note [Ranks out of step].
  void prepare_for_forward(bool training_step = false);

  // torch's _rebuild_buckets: called at the start of every forward with
  // gradients enabled, after Join's notification (and by a joined rank's
  // Join hook at the same point). Does the first rebuild if it is due and
  // returns whether it did; raises if the last synchronising backward left
  // gradients unreduced. See Note [Agreeing on the bucket layout].
  bool rebuild_buckets();
  // torch's _push_all_rebuilt_params: a rank that joined shadowed a
  // synchronising backward, so the first rebuild is due at the next forward.
  void shadowed_backward();

  // Called at the end of a forward whose backward must synchronise gradients
  // (or by frameworks before a backward that runs inside the forward).
  // `outputs` are the forward's output tensors; with find_unused_parameters
  // the autograd graph is searched from them. See Note [Unused parameters].
  // `dropped`: indices of the parameters of the layers every forward since
  // the last synchronisation dropped, the same on every rank;
  // `accumulated_only`: those of layers this forward dropped but an earlier
  // one under no_sync ran (reduced from what .grad accumulated). See Note
  // [Layer dropping].
  void prepare_for_backward(
      const std::vector<at::Tensor>& outputs,
      const std::vector<size_t>& dropped = {},
      const std::vector<size_t>& accumulated_only = {});

  // Static graph only: true between the first synchronising forward and the
  // end of its backward. See Note [Static graph].
  bool learning_static_graph() const;

  // Called from the backward of the output sink during the learning
  // iteration: queues finish_learning_iteration() to run when the whole
  // backward pass (nested ones included) has finished.
  void queue_finish_learning_iteration();

  // Ends the learning iteration of a static graph now, if one is under way
  // (torch's Reducer::_delay_all_reduce). Call after its backward finished.
  void finish_learning_iteration();

  // Called at the end of a forward inside no_sync: its backward only
  // accumulates, even if an earlier forward without backward expected
  // gradients.
  void prepare_for_local_backward();

  // Called when no_sync is entered: a backward with nothing armed only
  // accumulates (what an idle reducer does too, see Note [Unprepared
  // backward]; kAccumulating names it).
  void allow_local_accumulation();

  // Makes the graph static: only before the first synchronising backward,
  // and never with droppable layers (Note [Static graph]).
  void set_static_graph();

  // Replaces the default bucket allreduce with `hook` (a HookTransport: Note
  // [Bucket transports]). Once only, and not in the middle of an iteration.
  void register_comm_hook(std::shared_ptr<BucketHook> hook);

  // Reduces `bucket` as a bucket of this reducer would be: through the
  // registered hook, or else a summing allreduce. For ranks that shadow
  // collectives after running out of data (Join).
  c10::intrusive_ptr<c10::ivalue::Future> run_comm_hook(c10d::GradBucket& bucket);

  // Checks, before the buffer broadcast at the start of a forward, that every
  // rank is at the same training step; raises on every rank if not. See
  // Note [Ranks out of step].
  void check_step_before_forward_collectives();

  // Takes part in a step check for a rank that ran out of data
  // (Join); see Note [Ranks out of step].
  void match_step_check_as_joined();

  // Training steps begun so far; see Note [Ranks out of step].
  int64_t training_steps() const;

  // A summing allreduce of `bucket` (torch's _run_allreduce_hook).
  c10::intrusive_ptr<c10::ivalue::Future> run_allreduce(c10d::GradBucket& bucket);

  // GradBuckets shaped like this reducer's, filled with zeros, in launch order.
  std::vector<c10d::GradBucket> zeros_like_grad_buckets() const;

  // The per-parameter usage bitmap as it would be allreduced (a copy on the
  // parameters' device). See Note [Unused parameters].
  at::Tensor local_used_map();

  // See Note [Join and the divide factor]: `work` is this iteration's
  // allreduce counting the ranks that still have data.
  void set_forward_pass_work(
      c10::intrusive_ptr<c10d::Work> work, bool divide_by_initial_world_size);

  // Raises, as prepare_for_forward would, if the last synchronising backward
  // did not finish reducing.
  void check_finalized() const;

  // Removes the autograd hooks now (the destructor does it otherwise).
  void remove_autograd_hooks();

  // Forgets the iteration under way and communicates on `process_group`
  // from now on.
  void update_process_group(c10::intrusive_ptr<c10d::ProcessGroup> process_group);

  // Reads the bucket layout (the buckets, the caps, the observed gradient
  // order) under the reducer's lock: `read(const BucketLayout&)`.
  template <typename Read>
  auto read_layout(Read read) const {
    const auto lock = lock_state(Access::kRead);
    return read(layout_);
  }

  // Re-lays the buckets with `caps` (between iterations only; returns
  // whether the layout changed). Every rank must set the same caps at the
  // same point: Note [Agreeing on the bucket layout].
  bool set_bucket_caps(const std::vector<int64_t>& caps);

  // Synchronising backward passes begun so far.
  int64_t iterations() const;

  // The instants of the last iteration; see Note [Runtime statistics].
  RuntimeTimes runtime_times() const;

  // See Note [Stragglers] in reducer/observation/step_timings.h. every <= 0: off.
  void set_straggler_every(int64_t every);
  // The training step and every rank's figures (rank-major,
  // StepTimings::kTimings each, microseconds + 1) of the last exchange;
  // figures empty before one.
  std::pair<int64_t, std::vector<int64_t>> straggler_figures() const;

  // Whether every synchronising iteration so far left the same parameters
  // unused (what static_graph requires).
  bool unused_parameters_stable() const;

  Phase phase() const;

  // See ReducerOptions::overlap_with_backward. Not while reducing.
  void set_overlap_with_backward(bool overlap);

  // Starts or stops recording the communication timeline; take_timeline()
  // returns what was recorded (and sets `dropped` to the events the buffer
  // had no room for), waiting at most `wait_ms` for the completions of
  // launched buckets. See Note [Communication timeline].
  void set_timeline(bool on);
  std::vector<TimelineEvent> take_timeline(int64_t* dropped, int64_t wait_ms);

  // Waits with a deadline of `timeout_ms` and reports to `handler` what
  // this rank is doing when one passes, a wait fails or a backward ends
  // unfinished; timeout_ms <= 0 or no handler: plain waits. See Note [Hang
  // attribution] in reducer/observation/stall_watch.h.
  void set_stall_handler(
      int64_t timeout_ms, std::function<void(const StallReport&)> handler);

  // The fingerprint of the communication hooks registered (1: none), which
  // every backward's step check compares; `confirm`: a hook registered after
  // the first forward, so the next backward launches no bucket before the
  // check agrees. See Note [Hooks registered after the first forward] in
  // reducer/agreement/step_check.h.
  void set_comm_hook_fingerprint(int64_t fingerprint, bool confirm);

  // Called, when set, with the parameter indices of each bucket as soon as
  // that bucket's reduced gradients are in .grad, at the end of a
  // synchronising backward, bucket after bucket in launch order, without the
  // reducer's lock; empty: off. See Note [Stepping reduced buckets] in
  // reducer/finish/step_per_bucket.h.
  using BucketStep = reducer::BucketStep;
  void set_bucket_step(BucketStep step);

  // See Note [The next forward's buckets first] in
  // reducer/finish/step_and_defer_tail.h: with a bucket step, the buckets
  // holding about `fraction` of the gradient bytes, those of the first
  // layers, are launched first-layer first once the backward has ended, and
  // left on the wire by it; 0: off.
  void set_forward_tail(double fraction);
  // The buckets a backward left on the wire, in launch order: each one's
  // index and parameter indices.
  std::vector<std::pair<size_t, std::vector<size_t>>> deferred_buckets() const;
  // Waits for the deferred bucket `bucket_index` and writes its gradients
  // back to .grad; a no-op for one not deferred (any more).
  void finish_deferred(size_t bucket_index);

  // See Note [Late gradients] in reducer/core/late_gradients.h: whether a
  // backward after the last synchronisation, over the same forward, left
  // gradients on this rank alone; and the indices of their parameters, in
  // order, forgotten once taken.
  bool has_late_gradients() const;
  std::vector<size_t> take_late_gradients();

  // Called by the autograd hook of parameter `index` once its gradient
  // accumulator has run. `gradient_arrived` is false when autograd ran the
  // accumulator with no gradient (an output the loss did not use).
  void on_gradient_ready(size_t index, bool gradient_arrived);

 private:
  void enter(Phase from, Phase to);
  void start_reducing();
  // `arrived`: false for a parameter marked ready when the backward starts
  // because its layer was dropped (Note [Layer dropping]).
  void mark_ready(size_t index, bool arrived = true);
  void copy_into_bucket(size_t index, bool scale);
  void launch_ready_buckets();
  void launch(size_t bucket_index);
  void launch_all_buckets();
  bool tracks_usage() const;
  bool may_be_globally_unused(size_t index) const;
  void finalize_backward();
  void queue_at_end_of_backward(void (Reducer::*step)());
  // See Note [Used by no rank]: once per synchronising backward, after the
  // usage bitmap's allreduce.
  BackwardUsage conclude_usage();
  void write_back_gradients(const BackwardUsage& usage);
  void write_back_bucket(Bucket& bucket, const BackwardUsage& usage);
  void write_back_views(
      const std::vector<at::Tensor>& views, const std::vector<size_t>& param_indices,
      const BackwardUsage& usage, bool as_view);
  void wait_for_launched_buckets();
  void wait_for_bucket(size_t bucket_index);
  // What a transport is lent for one call; see Note [Bucket transports].
  TransportContext transport_context();
  // See Note [The next forward's buckets first]: whether this backward may
  // hold buckets, and the refusal to start what would reuse their memory.
  bool may_hold_buckets() const;
  void check_nothing_deferred(const char* what) const;
  // See Note [The end of a backward] (reducer/core/buckets_of_backward.h).
  class BucketsOfBackward;
  void reset_step_check();
  // See Note [The step check on bucket 0]: whether anything calls for a
  // step check of its own rather than one riding on bucket 0.
  bool needs_own_step_check() const;
  // Drops the collectives of the iteration under way without waiting for
  // them, and what it stashed.
  void abandon_iteration();
  void raise_if_out_of_step();
  bool stays_local() const;
  std::string unfinished_reduction_message() const;
  // Leaves the unfinished iteration (kReducing) and raises why.
  [[noreturn]] void raise_unfinished_reduction();
  // Observes the finished backward's order and applies an agreed rebuild.
  void conclude_layout(bool launched_at_end);
  // Refills each bucket's pending count for the backward being armed.
  void arm_buckets();
  // See Note [Hang attribution]: this rank's side of a StallEvent, and the
  // check, at the end of a backward, that every bucket was launched
  // (reducer/core/stall_report.cpp).
  StallReport stall_report(const StallEvent& event) const;
  void watch_backward_end();
  void check_backward_ended();

  // The reducer's lock, to read its state or to change it; a reader never
  // waits for more than another thread's short critical section. See Note
  // [Windows without the lock] in reducer/core/state_lock.cpp.
  enum class Access { kRead, kChange };
  std::unique_lock<std::mutex> lock_state(Access access) const;
  // Opens and closes a window in which the thread that changes the reducer
  // lets its lock go: around a communication hook, every wait for a
  // collective or a hook's future, and the hang handler. `what` (a string
  // literal) names it in the error a change from inside it raises.
  void open_window(const char* what);
  void close_window();
  // The same, as an UnlockedWindow opens them.
  class Windows final : public LockWindows {
   public:
    explicit Windows(Reducer& reducer) : reducer_(reducer) {}
    void open(const char* what) override {
      reducer_.open_window(what);
    }
    void close() override {
      reducer_.close_window();
    }

   private:
    Reducer& reducer_;
  };
  Windows lock_windows_{*this};

  const std::vector<at::Tensor> params_;
  const std::vector<std::string> param_names_;
  const std::vector<bool> sparse_gradients_;
  c10::intrusive_ptr<c10d::ProcessGroup> process_group_;
  ReducerOptions options_; // overlap_with_backward changes
  // See Note [A world of one rank].
  bool gradients_stay_local_;
  // See Note [Bucket transports]: Allreduce, CarrierWithStepCheck or
  // HookTransport; never null. Shared with a joined rank's shadowing, which
  // runs it without the lock.
  std::shared_ptr<BucketTransport> transport_;

  // Calls on_gradient_ready; see Note [Reducer lifetime].
  AccumulatorHooks hooks_;

  // The buckets, their caps and order, and every rebuild; see Note
  // [Agreeing on the bucket layout].
  BucketLayout layout_;

  // See Note [Gradient averaging] and Note [Join and the divide factor].
  Averaging averaging_;

  // Guards everything below; hooks may run on several autograd threads.
  mutable std::mutex mutex_;
  // See Note [Windows without the lock]: what each open window is for,
  // innermost last (empty: none is open), and the one thread that opened
  // them; changers from other threads wait on windows_closed_.
  std::vector<const char*> windows_;
  std::atomic<std::thread::id> window_thread_{};
  mutable std::condition_variable windows_closed_;
  Phase phase_ = Phase::kIdle;
  int64_t iterations_ = 0;
  // See Note [Ranks out of step]; step_check_ is unset in a world of one.
  int64_t training_steps_ = 0;
  int64_t backwards_begun_ = 0;
  std::optional<StepCheck> step_check_;
  std::vector<bool> ready_; // per parameter, this iteration
  size_t next_bucket_ = 0; // first bucket not yet launched

  // See Note [Static graph] and Note [Unused parameters].
  StaticGraph static_graph_;
  Usage usage_;

  // See Note [Layer dropping]: the parameters dropped in this iteration.
  DropPlan drop_plan_;
  std::vector<size_t> accumulated_only_;
  bool drops_layers_ = false; // some parameter belongs to a droppable layer
  bool plan_confirmed_ = true; // the step check was awaited this iteration
  // See Note [Hooks registered after the first forward].
  int64_t hook_fingerprint_ = 1;
  bool hook_unconfirmed_ = false;

  // See Note [Communication timeline]: off unless asked for.
  Timeline timeline_;

  // See Note [Hang attribution].
  StallWatch stall_;
  int64_t backward_step_ = 0; // training_steps_ when the backward began
  bool reported_unfinished_ = false;

  // See Note [Runtime statistics] and Note [Stragglers].
  StepTimings timings_;

  // See Note [The end of a backward]: WriteBackAll, StepPerBucket or
  // StepAndDeferTail; never null.
  std::unique_ptr<EndOfBackward> end_of_backward_ = std::make_unique<WriteBackAll>();

  // See Note [Late gradients]: an observer.
  LateGradients late_;

  // See Note [Reducer observers]: timings_, timeline_ and late_.
  ReducerObservers observers_;
};

} // namespace ddp_ext::reducer
