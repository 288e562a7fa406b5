#include "reducer/core/reducer.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>

#include <algorithm>
#include <utility>

#include "reducer/base/averaging.h"
#include "reducer/core/buckets_of_backward.h"
#include "reducer/base/cuda_streams.h"
#include "reducer/base/errors.h"
#include "reducer/core/gradient_copy.h"
#include "reducer/layout/bucket_memory.h"
#include "reducer/agreement/step_check.h"
#include "reducer/participation/usage.h"
#include "reducer/transport/allreduce.h"

namespace ddp_ext::reducer {

// Note [A world of one rank]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// With a single rank the average of each gradient is the gradient itself,
// so the reducer leaves gradients where autograd put them, unless .grad must
// be a bucket view, a communication hook must see them, or they must be
// rounded to a reduce dtype: hooks keep their bookkeeping (so every error is
// raised as with more ranks) but copy nothing, no collective is launched, and
// nothing is written back. Parameters that got no gradient keep their .grad,
// which is what "used by no rank" means in a world of one. Only over torch's
// own backends (Gloo, NCCL, UCC, MPI, XCCL), where skipping a collective
// cannot be seen: any other group, such as one written in Python, is user
// code whose collectives may do more than reduce (count steps, coordinate
// replicas), so it gets every collective torch's DDP would call, alone too.
// A world of one has no peer to be out of step with: Note [Step check
// policies] in reducer/transport/step_check_policy.h.

static_assert(StepCheck::kTimings == StepTimings::kTimings, "Note [Stragglers]");

namespace {

// Checks what the reducer is given before anything is laid out.
std::vector<at::Tensor> checked_params(
    std::vector<at::Tensor> params, const std::vector<std::string>& names) {
  TORCH_CHECK(!params.empty(), "Reducer needs at least one parameter");
  TORCH_CHECK(
      names.size() == params.size(), "Reducer got ", params.size(),
      " parameters but ", names.size(), " names");
  return params;
}

bool any_droppable(const std::vector<int64_t>& units) {
  return std::any_of(units.begin(), units.end(), [](int64_t unit) { return unit >= 0; });
}

} // namespace

Reducer::Reducer(
    std::vector<at::Tensor> params,
    std::vector<std::string> param_names,
    c10::intrusive_ptr<c10d::ProcessGroup> process_group,
    ReducerOptions options,
    const std::vector<bool>& sparse_gradients)
    : params_(checked_params(std::move(params), param_names)),
      param_names_(std::move(param_names)),
      sparse_gradients_(sparse_gradients),
      process_group_(std::move(process_group)),
      options_(options),
      gradients_stay_local_(false),
      transport_(std::make_shared<Allreduce>()),
      layout_(params_, param_names_, sparse_gradients_, options_),
      averaging_(process_group_ ? process_group_->getSize() : 1),
      static_graph_(params_.size(), any_droppable(options_.layer_units)),
      usage_(params_.size(), params_.front().device(), options_.find_unused_parameters),
      drop_plan_(params_.size()),
      drops_layers_(any_droppable(options_.layer_units)),
      late_(params_.size()) {
  TORCH_CHECK(process_group_, "Reducer needs a process group");
  gradients_stay_local_ = stays_local();
  reset_step_check();
  layout_.order().set_first_rebuild(!options_.find_unused_parameters);
  ready_.assign(params_.size(), false);
  observers_.add(&timings_); // See Note [Reducer observers].
  observers_.add(&timeline_);
  observers_.add(&late_);
  // See Note [Windows without the lock]: every wait lets the lock go.
  stall_.set_window([this](bool open) {
    if (open) {
      open_window("a wait for one of its collectives or a hook's future");
    } else {
      close_window();
    }
  });
  hooks_.install(params_, param_names_, [this](size_t index, bool arrived) {
    on_gradient_ready(index, arrived);
  });
}

Reducer::~Reducer() {
  remove_autograd_hooks(); // See Note [Reducer lifetime].
}

void Reducer::remove_autograd_hooks() {
  const auto lock = lock_state(Access::kChange);
  hooks_.remove();
}

void Reducer::abandon_iteration() {
  for (auto& bucket : layout_.buckets()) {
    bucket.work.reset();
    bucket.future.reset();
  }
  usage_.drop(/*clear=*/false);
  static_graph_.abandon();
}

void Reducer::enter(Phase from, Phase to) {
  TORCH_INTERNAL_ASSERT(
      phase_ == from, "reducer moving to phase '", phase_name(to),
      "' expected to be in '", phase_name(from), "' but is in '",
      phase_name(phase_), "'");
  phase_ = to;
}

bool Reducer::stays_local() const {
  // See Note [A world of one rank].
  return process_group_->getSize() == 1 && torch_backend(*process_group_) &&
      !options_.gradient_as_bucket_view &&
      !options_.reduce_dtype && !transport_->runs_hook();
}

bool Reducer::tracks_usage() const {
  return usage_.searches() || (static_graph_.on() && !static_graph_.learned());
}

bool Reducer::may_be_globally_unused(size_t index) const {
  if (drop_plan_.dropped(index)) {
    return true; // and is: every rank dropped it
  }
  if (static_graph_.learned()) {
    return !static_graph_.used_globally()[index];
  }
  return tracks_usage() && !usage_.used_locally(index);
}

void Reducer::prepare_for_forward(bool training_step) {
  const auto lock = lock_state(Access::kChange);
  observers_.notify(&ReducerObserver::on_forward); // See Note [Reducer observers].
  if (training_step) {
    ++training_steps_; // See Note [Ranks out of step].
  }
  if (phase_ == Phase::kReducing) {
    raise_unfinished_reduction();
  }
}

void Reducer::check_finalized() const {
  const auto lock = lock_state(Access::kRead);
  TORCH_CHECK(phase_ != Phase::kReducing, unfinished_reduction_message());
}

void Reducer::prepare_for_backward(
    const std::vector<at::Tensor>& outputs,
    const std::vector<size_t>& dropped,
    const std::vector<size_t>& accumulated_only) {
  const auto lock = lock_state(Access::kChange);
  if (phase_ == Phase::kReducing) {
    raise_unfinished_reduction(); // a framework prepared a backward itself
  }
  drop_plan_.set(dropped); // checks the indices
  for (size_t index : accumulated_only) {
    TORCH_CHECK(index < params_.size() && !drop_plan_.dropped(index),
                "parameter index ", index, " cannot be accumulated-only");
  }
  check_nothing_deferred("a synchronising backward");
  enter(phase_, Phase::kExpectingGradients);
  ++iterations_;
  observers_.notify(&ReducerObserver::on_backward_armed);
  step_check_->drop(); // before the wait: a bucket 0 that carried it is not unpacked
  wait_for_launched_buckets(); // left over from an unfinished iteration
  layout_.forget_vote();
  layout_.order().begin_iteration();
  std::fill(ready_.begin(), ready_.end(), false);
  next_bucket_ = 0;
  accumulated_only_ = accumulated_only;
  // See Note [Layer dropping] and Note [Hooks registered after the first forward].
  plan_confirmed_ = !drops_layers_ && !hook_unconfirmed_;
  observers_.notify(
      &ReducerObserver::on_iteration_ahead, params_.size(), layout_.buckets().size());
  arm_buckets();
  usage_.drop(/*clear=*/false);
  static_graph_.arm();
  std::vector<size_t> unused;
  if (static_graph_.on()) {
    unused = static_graph_.unused_locally();
  } else if (usage_.searches()) {
    unused = find_unreached_accumulators(outputs, hooks_.accumulators());
  }
  usage_.set_unused(std::move(unused), /*compare=*/iterations_ > 1);
}

void Reducer::prepare_for_local_backward() {
  const auto lock = lock_state(Access::kChange);
  TORCH_INTERNAL_ASSERT(phase_ != Phase::kReducing,
                        "prepare_for_forward must run before prepare_for_local_backward");
  enter(phase_, Phase::kAccumulating);
}

void Reducer::allow_local_accumulation() {
  const auto lock = lock_state(Access::kChange);
  if (phase_ == Phase::kIdle) {
    enter(Phase::kIdle, Phase::kAccumulating);
  }
}

void Reducer::start_reducing() {
  enter(Phase::kExpectingGradients, Phase::kReducing);
  observers_.notify(&ReducerObserver::on_backward_begin);
  backward_step_ = training_steps_;
  reported_unfinished_ = false;
  const int64_t order_vote = layout_.cast_vote();
  const bool checked = step_check_->launch_backward(
      layout_.buckets().front(), needs_own_step_check(), *transport_,
      transport_context(), [&] {
        StepEntry entry = StepCheck::backward_entry(training_steps_);
        entry.rider = order_vote;
        entry.plan = drop_plan_.fingerprint();
        entry.hooks = hook_fingerprint_;
        // See Note [Stragglers]: every rank is at the same step, so all publish.
        entry.timings = timings_.to_publish(training_steps_);
        return entry;
      });
  if (checked) {
    ++backwards_begun_;
    if (stall_.on() && !static_graph_.learning()) {
      watch_backward_end(); // queued before finalize_backward, so it runs first
    }
  }
  averaging_.take(process_group_->getSize()); // See Note [Join and the divide factor].
  // See Note [Layer dropping].
  for (size_t dropped : drop_plan_.indices()) {
    mark_ready(dropped, /*arrived=*/false);
  }
  for (size_t index : accumulated_only_) {
    if (!ready_[index]) {
      mark_ready(index, /*arrived=*/false);
    }
  }
  for (size_t unused : usage_.unused()) {
    if (!ready_[unused]) {
      mark_ready(unused);
    }
  }
}

void Reducer::on_gradient_ready(size_t index, bool gradient_arrived) {
  const auto lock = lock_state(Access::kChange);
  if (gradient_arrived && tracks_usage()) {
    usage_.mark_used(index);
  }
  switch (phase_) {
    case Phase::kAccumulating:
      return; // See Note [Reducer phases]: no_sync.
    case Phase::kIdle: // See Note [Unprepared backward]: left in .grad, as torch's DDP.
      if (gradient_arrived) {
        late_.record(index); // See Note [Late gradients].
      }
      return;
    case Phase::kExpectingGradients:
      start_reducing();
      break;
    case Phase::kReducing:
      break;
  }
  if (drop_plan_.dropped(index)) {
    TORCH_CHECK(
        !gradient_arrived,
        dropped_gradient_message(process_group_->getRank(), param_names_[index]));
    return; // marked ready when the backward started
  }
  if (static_graph_.learning()) {
    static_graph_.count_firing(index); // See Note [Static graph]: marked at the end.
    layout_.order().record(index); // the last firing counts
    return;
  }
  if (static_graph_.on() &&
      !static_graph_.ready_after_firing(
          index, usage_.unused_locally(index), gradient_arrived,
          process_group_->getRank(), param_names_[index])) {
    return;
  }
  mark_ready(index);
}

void Reducer::mark_ready(size_t index, bool arrived) {
  TORCH_CHECK(
      !ready_[index], marked_twice_message(process_group_->getRank(), param_names_[index]));
  ready_[index] = true;
  // The timeline flags a dropped parameter (only one that did not arrive can be).
  timeline_.instant(
      TimelineEvent::kGradientReady, index, !arrived && drop_plan_.dropped(index));
  // See Note [Gradient order prediction]: one with no gradient in this
  // backward keeps its place.
  if (!arrived) {
    layout_.order().record_dropped(index);
  } else if (!static_graph_.learning()) {
    layout_.order().record(index);
  }
  Bucket& bucket = layout_.bucket_of(index);
  if (!bucket.dropped) { // See Note [Layer dropping]: it does not travel.
    note_fill_stream(bucket.filled_on, params_[index].device());
    if (!options_.batched_grad_copy) {
      copy_into_bucket(index, /*scale=*/transport_->averages_while_copying());
    }
  }
  if (--bucket.pending == 0) {
    launch_ready_buckets();
  }
}

void Reducer::copy_into_bucket(size_t index, bool scale) {
  if (gradients_stay_local_) {
    return; // See Note [A world of one rank].
  }
  Bucket& bucket = layout_.bucket_of(index);
  const at::Tensor& grad = params_[index].grad();
  at::NoGradGuard no_grad;
  if (bucket.sparse) {
    // See Note [Sparse gradients]: a hook gets it undivided, as a dense one.
    bucket.sparse_grad = sparse_contribution(
        params_[index], grad, scale ? averaging_.ranks() : 1, param_names_[index]);
    return;
  }
  if (bucket.released) {
    regrow_bucket_memory(bucket); // See Note [Sharded buckets].
  }
  const at::Tensor& view = bucket.views[layout_.slot_of(index)];
  if (grad.defined() && !grad.is_sparse() && is_bucket_view(grad, view) &&
      may_be_globally_unused(index)) {
    usage_.stash(index, grad);
  }
  copy_into_view(
      grad, view, scale ? &averaging_.factor() : nullptr, param_names_[index]);
}

void Reducer::launch_ready_buckets() {
  const auto& buckets = layout_.buckets();
  const bool launching = options_.overlap_with_backward && !static_graph_.learning();
  // See Note [The next forward's buckets first].
  const size_t held_from = end_of_backward_->held_from(buckets.size());
  while (next_bucket_ < buckets.size() && buckets[next_bucket_].pending == 0) {
    if (launching && next_bucket_ < held_from) {
      launch(next_bucket_);
    }
    ++next_bucket_;
  }
  if (next_bucket_ < buckets.size() || static_graph_.learning()) {
    return; // See Note [Static graph] for who finishes a learning iteration.
  }
  for (size_t b = buckets.size(); launching && b-- > held_from;) {
    launch(b); // first layers first
  }
  if (usage_.searches() && !static_graph_.on() && !gradients_stay_local_) {
    usage_.launch_allreduce(*process_group_); // a world of one: local is global
  }
  queue_at_end_of_backward(&Reducer::finalize_backward);
}

void Reducer::launch(size_t bucket_index) {
  observers_.notify(&ReducerObserver::on_bucket_launch, bucket_index);
  if (gradients_stay_local_) {
    return; // See Note [A world of one rank].
  }
  Bucket& bucket = layout_.buckets()[bucket_index];
  if (bucket.dropped) {
    return; // See Note [Layer dropping].
  }
  if (!plan_confirmed_) {
    // See Note [Layer dropping]: no bucket leaves before the ranks agree.
    plan_confirmed_ = true;
    raise_if_out_of_step();
  }
  TimelineRange range(timeline_, TimelineEvent::kBucketLaunch, bucket_index);
  // See Note [CUDA streams]: after every stream that filled the bucket.
  note_fill_stream(bucket.filled_on, bucket.params.front().device());
  const bool averages = transport_->averages_while_copying();
  if (options_.batched_grad_copy) {
    for (size_t index : bucket.param_indices) {
      copy_into_bucket(index, /*scale=*/bucket.sparse && averages);
    }
    if (averages && !bucket.sparse) {
      at::NoGradGuard no_grad;
      bucket.flat.mul_(averaging_.factor());
    }
  }
  if (options_.skip_all_reduce_unused_params &&
      std::all_of(
          bucket.param_indices.begin(), bucket.param_indices.end(),
          [this](size_t index) { return usage_.unused_locally(index); })) {
    return; // Unused on every rank too, by the option's contract.
  }
  transport_->launch(
      bucket_index, layout_.buckets().size(), bucket, transport_context(), range);
}

void Reducer::launch_all_buckets() {
  for (size_t b = 0; b < layout_.buckets().size(); ++b) {
    launch(b);
  }
}

void Reducer::wait_for_launched_buckets() {
  for (size_t b = 0; b < next_bucket_; ++b) {
    wait_for_bucket(b);
  }
}

void Reducer::wait_for_bucket(size_t b) {
  transport_->finish(b, layout_.buckets()[b], transport_context());
}

void Reducer::finalize_backward() {
  const auto lock = lock_state(Access::kChange);
  TORCH_INTERNAL_ASSERT(phase_ == Phase::kReducing && !static_graph_.learning());
  TORCH_INTERNAL_ASSERT(next_bucket_ == layout_.buckets().size());
  TimelineRange range(timeline_, TimelineEvent::kFinalize);
  observers_.notify(&ReducerObserver::on_gradients_done);
  if (!options_.overlap_with_backward) {
    launch_all_buckets();
  }
  raise_if_out_of_step();
  BucketsOfBackward buckets(*this); // See Note [The end of a backward].
  const std::exception_ptr step_failed = end_of_backward_->finish(buckets);
  conclude_layout(/*launched_at_end=*/!options_.overlap_with_backward);
  enter(Phase::kReducing, Phase::kIdle);
  if (reported_unfinished_) {
    reported_unfinished_ = false; // a second backward completed it after all
    stall_.report(StallEvent::kResolved);
  }
  if (step_failed) {
    std::rethrow_exception(step_failed);
  }
}

void Reducer::queue_at_end_of_backward(void (Reducer::*step)()) {
  // See Note [Reducer lifetime].
  const int rank = process_group_->getRank();
  torch::autograd::Engine::get_default_engine().queue_callback(
      [weak = weak_from_this(), step, rank] {
        const std::shared_ptr<Reducer> self = weak.lock();
        TORCH_CHECK(
            self, "DistributedDataParallel on rank ", rank,
            " was destroyed during its backward pass, so this iteration's "
            "gradients were not averaged across ranks. Keep the wrapper alive "
            "until backward returns.");
        ((*self).*step)();
      });
}

void Reducer::update_process_group(
    c10::intrusive_ptr<c10d::ProcessGroup> process_group) {
  const auto lock = lock_state(Access::kChange);
  TORCH_CHECK(process_group, "update_process_group needs a process group");
  // Work on the old group is dropped, not awaited: it may never complete.
  abandon_iteration();
  averaging_.forget_forward_pass_work();
  layout_.forget_vote();
  layout_.order().restart();
  std::fill(ready_.begin(), ready_.end(), false);
  next_bucket_ = 0;
  end_of_backward_->forget_deferred(); // on the old group too
  drop_plan_.clear();
  phase_ = Phase::kIdle;
  process_group_ = std::move(process_group);
  gradients_stay_local_ = stays_local();
  averaging_.set_ranks(process_group_->getSize());
  reset_step_check(); // drops a check in flight on the old group
}

} // namespace ddp_ext::reducer
