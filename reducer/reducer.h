#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "reducer/accumulator_ptr.h"
#include "reducer/bucket.h"
#include "reducer/bucket_layout.h"
#include "reducer/gradient_order.h"
#include "reducer/layer_drop.h"
#include "reducer/reducer_options.h"
#include "reducer/step_check.h"
#include "reducer/timeline.h"

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
//   came from a backward the reducer was never told about (a backward that
//   runs inside the wrapper's forward, a second backward over the same
//   graph): it is an error, never a silently unsynchronised gradient. See
//   Note [Unprepared backward].
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

// Number of post hooks on the gradient accumulator of leaf tensor `param`;
// lets tests check that a reducer removes the hooks it installed.
size_t accumulator_post_hook_count(const at::Tensor& param);

// The gradient reducer of paper section 3.2 (Algorithm 1): copies gradients
// into buckets as autograd produces them, reduces each bucket as soon as it
// is full, in the same bucket order on every rank, and writes the averages
// back to .grad at the end of the backward pass.
// Always owned by a std::shared_ptr (the Python binding's holder); see Note
// [Reducer lifetime].
class Reducer : public std::enable_shared_from_this<Reducer> {
 public:
  // params[i] is named param_names[i] (used in error messages); buckets lists
  // parameter indices per bucket in launch order (see assign_buckets). Every
  // parameter must require grad and appear in exactly one bucket.
  // sparse_gradients[i] (empty: none) marks parameters whose gradients are
  // sparse; each must have a bucket of its own. See Note [Sparse gradients].
  Reducer(
      std::vector<at::Tensor> params,
      std::vector<std::string> param_names,
      const std::vector<std::vector<size_t>>& buckets,
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
  // accumulates instead of being refused. See Note [Unprepared backward].
  void allow_local_accumulation();

  // Makes the graph static: only before the first synchronising backward.
  void set_static_graph();

  // Replaces the default bucket allreduce. Once only, and not in the middle
  // of an iteration. See Note [Communication hooks]. A hook that keeps no
  // state per bucket (`stateless`) lets continuous rebuilding go on; see
  // Note [Gradient order prediction].
  void register_comm_hook(
      std::unique_ptr<c10d::CommHookInterface> hook, bool stateless = false);

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

  // The bucket layout, as parameter indices per bucket in launch order.
  std::vector<std::vector<size_t>> bucket_indices() const;

  // Bytes of each bucket, in launch order.
  std::vector<int64_t> bucket_sizes() const;

  // Synchronising backward passes begun so far.
  int64_t iterations() const;

  // See Note [Gradient order prediction]: whether the first rebuild has
  // happened (torch's has_rebuilt_buckets), how many rebuilds changed the
  // layout, the order gradients became ready in the last synchronising
  // backward (empty before one finished), and that backward's overlap
  // fraction and launch delay (unset before one finished).
  bool has_rebuilt_buckets() const;
  int64_t rebuilds() const;
  std::vector<size_t> observed_order() const;
  std::optional<double> overlap_fraction() const;
  std::optional<double> launch_delay() const;

  // See Note [Auto-tuned bucket caps] in ddp_ext/_auto_buckets.py. The caps
  // buckets are assigned with (the k-th bucket of each kind capped at
  // caps[k], the last repeating), the layout `caps` would give the current
  // bucket order without applying it, and re-laying the buckets with `caps`
  // (between iterations only; returns whether the layout changed). Every
  // rank must set the same caps at the same point.
  std::vector<int64_t> bucket_caps() const;
  std::vector<std::vector<size_t>> layout_for_caps(
      const std::vector<int64_t>& caps) const;
  bool set_bucket_caps(const std::vector<int64_t>& caps);

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
  std::string dropped_gradient_message(size_t index) const;
  void copy_into_bucket(size_t index, bool scale);
  void copy_sparse_gradient(Bucket& bucket, size_t index, const at::Tensor& grad);
  void launch_ready_buckets();
  void launch(size_t bucket_index);
  void launch_all_buckets();
  void launch_used_bitmap_allreduce();
  std::vector<bool> wait_for_used_bitmap();
  bool tracks_usage() const;
  bool may_be_globally_unused(size_t index) const;
  bool unused_locally(size_t index) const;
  void finalize_backward();
  void queue_at_end_of_backward(void (Reducer::*step)());
  void finish_learning_iteration_locked();
  void write_back_gradients(const std::vector<bool>& globally_used);
  void wait_for_launched_buckets();
  void take_divide_factor();
  void reset_step_check();
  // Drops the collectives of the iteration under way without waiting for
  // them, and what it stashed.
  void abandon_iteration();
  void raise_if_out_of_step();
  void set_average_factor(int64_t ranks);
  bool stays_local() const;
  c10d::GradBucket grad_bucket(size_t bucket_index, at::Tensor buffer) const;
  std::string names_of_parameters_not_ready() const;
  std::string unfinished_reduction_message() const;
  void remove_autograd_hooks_locked();
  void index_buckets();
  std::vector<std::vector<size_t>> bucket_indices_locked() const;
  int64_t cast_order_vote();
  void conclude_gradient_order(bool launched_at_end);
  std::vector<size_t> agreed_order();
  void rebuild_buckets(const std::vector<std::vector<size_t>>& layout);
  std::vector<size_t> layout_order_locked() const;
  // Refills each bucket's pending count for the backward being armed.
  void arm_buckets();
  LayoutInputs layout_inputs() const;
  void reserve_timeline();

  const std::vector<at::Tensor> params_;
  const std::vector<std::string> param_names_;
  c10::intrusive_ptr<c10d::ProcessGroup> process_group_;
  ReducerOptions options_; // overlap_with_backward and static_graph change
  // See Note [A world of one rank].
  bool gradients_stay_local_;
  // See Note [Communication hooks]; null: the default averaging allreduce.
  std::unique_ptr<c10d::CommHookInterface> comm_hook_;

  // The gradient accumulator of each parameter, held so that autograd keeps
  // using the node our hook is installed on, and the key to remove the hook.
  std::vector<AccumulatorPtr> accumulators_;
  std::vector<uintptr_t> hook_keys_;

  std::vector<Bucket> buckets_;
  // Where each parameter lives: bucket index and position within it.
  std::vector<size_t> bucket_of_param_;
  std::vector<size_t> slot_of_param_;
  const std::vector<bool> sparse_gradients_;
  // The flat tensors every bucket is a slice of; see Note [Bucket memory].
  std::vector<at::Tensor> arenas_;

  // 1 / world_size as a wrapped scalar, so that the scale is applied like a
  // Python number (no type promotion). See Note [Gradient averaging].
  at::Tensor average_factor_;
  int64_t divide_ranks_ = 1; // the same as a count, for sparse gradients

  // Guards everything below; hooks may run on several autograd threads.
  mutable std::mutex mutex_;
  Phase phase_ = Phase::kIdle;
  int64_t iterations_ = 0;
  // See Note [Ranks out of step]; step_check_ is unset in a world of one.
  int64_t training_steps_ = 0;
  int64_t backwards_begun_ = 0;
  std::optional<StepCheck> step_check_;
  std::vector<bool> ready_; // per parameter, this iteration
  size_t next_bucket_ = 0; // first bucket not yet launched
  std::vector<size_t> unused_; // params marked ready by the first hook
  std::vector<bool> is_unused_; // the same, per parameter
  bool unused_stable_ = true; // see unused_parameters_stable()

  // See Note [Join and the divide factor].
  c10::intrusive_ptr<c10d::Work> forward_pass_work_;
  bool divide_by_initial_world_size_ = true;

  // See Note [Static graph].
  bool learning_iteration_ = false;
  bool graph_learned_ = false;
  std::vector<size_t> static_unused_locally_;
  std::vector<bool> static_used_globally_;
  // Hook firings per parameter: counted while learning, then expected.
  std::vector<int> firings_;
  std::vector<int> firings_expected_;

  // See Note [Unused parameters]: per-parameter usage since the last
  // synchronisation (int32 on CPU), and its copy on the parameters' device for
  // the allreduce.
  at::Tensor local_used_;
  at::Tensor used_for_allreduce_;
  c10::intrusive_ptr<c10d::Work> used_work_;
  // .grad values of locally unused parameters whose .grad is a bucket view,
  // kept so a globally unused parameter's .grad can be restored untouched.
  std::vector<std::pair<size_t, at::Tensor>> stashed_grads_;

  // See Note [Layer dropping]: the parameters dropped in this iteration.
  DropPlan drop_plan_;
  std::vector<size_t> accumulated_only_;
  bool drops_layers_ = false; // some parameter belongs to a droppable layer
  bool plan_confirmed_ = true; // the step check was awaited this iteration

  // See Note [Gradient order prediction]: the observed order and the watch,
  // and this iteration's vote (whether one was cast, and this rank's), which
  // the step check sums.
  GradientOrder gradient_order_;
  bool order_vote_cast_ = false;
  int64_t own_order_vote_ = 0;

  // See Note [Communication timeline]: off unless asked for.
  Timeline timeline_;
};

} // namespace ddp_ext::reducer
