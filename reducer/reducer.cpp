#include "reducer/reducer.h"

#include <ATen/ATen.h>
#include <ATen/ScalarOps.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <utility>

#include "reducer/cuda_streams.h"
#include "reducer/step_check.h"
#include "reducer/unused_parameters.h"

namespace ddp_ext::reducer {

// Note [Overlap and bucket order]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Buckets hold parameters in reverse registration order, the order in which
// the backward pass usually produces their gradients (paper section 3.2.3).
// A hook copies its gradient into the bucket; when a bucket's last gradient
// arrives, its allreduce is launched asynchronously while autograd goes on
// computing earlier layers. Collectives must be issued in the same order on
// every rank, yet gradients may arrive in different orders on different
// ranks: so a full bucket is launched only once every bucket before it has
// been launched (`next_bucket_`). When the last bucket is launched, a
// callback is queued on the autograd engine; it runs when the whole backward
// has finished, waits for every allreduce and writes the averages to .grad.
//
// Note [Static graph]
// ~~~~~~~~~~~~~~~~~~~
// With static_graph the set of parameters that get a gradient is the same in
// every iteration, so it is learned once instead of searched for each time.
// The first synchronising backward is the learning iteration: hooks record
// which parameters got a gradient and how often each accumulator ran (a block
// checkpointed reentrantly runs its accumulators once per recomputation), but
// mark nothing ready and launch nothing. The forward routes its outputs
// through the output sink, whose backward (the first node of the outer
// backward pass) queues finish_learning_iteration() on the engine. That runs
// after the whole backward, nested reentrant passes included: it marks every
// parameter ready (its accumulated .grad goes into the bucket), reduces every
// bucket and the used bitmap, and remembers the bitmap and the firing counts.
// Later iterations mark the locally unused parameters ready at their first
// hook and every other parameter at its last expected firing, overlap as
// usual, and leave the .grad of globally unused parameters alone, with no
// graph search and no bitmap allreduce. Because nothing is searched from the
// outputs, gradients produced by reentrant activation checkpointing are fine.
//
// Note [A world of one rank]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// With a single rank the average of each gradient is the gradient itself,
// so the reducer leaves gradients where autograd put them, unless .grad must
// be a bucket view, a communication hook must see them, or they must be
// rounded to a reduce dtype: hooks keep their bookkeeping (so every error is
// raised as with more ranks) but copy nothing, no collective is launched, and
// nothing is written back. Parameters that got no gradient keep their .grad,
// which is what "used by no rank" means in a world of one.
//
// Note [Gradient averaging]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// Each gradient is multiplied by 1/world_size while it is copied into its
// bucket (one pass instead of a copy and a scale), and the buckets are then
// summed. Scaling before summing, as torch's DDP does, keeps low-precision
// sums in range and gives the same rounding as torch's DDP. With
// batched_grad_copy the copies wait until the bucket is launched and the
// whole bucket is scaled at once: the same products, so the same bits.
//
// Note [Join and the divide factor]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Under torch.distributed.algorithms.join.Join, every forward of a rank that
// still has data starts an allreduce of 1 (ranks that ran out of data add 0),
// and ddp_ext/_join.py hands its work to set_forward_pass_work. With
// divide_by_initial_world_size=False the first gradient of the backward waits
// for it and averages over that many ranks instead of the world size; the
// ranks that joined shadow each bucket's reduction with zeros (run_comm_hook
// on zeros_like_grad_buckets), so the sum is over the ranks with data.
//
// Note [Sparse gradients]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A parameter whose module produces sparse gradients (an Embedding or
// EmbeddingBag with sparse=True) has a bucket of its own with no flat
// buffer: when it is ready its gradient is divided by the number of ranks
// (a division, as torch's DDP does for sparse gradients, so the values are
// the same) and reduced by the process group's sparse allreduce, whose
// result becomes .grad. A rank that did not use the parameter contributes an
// empty sparse tensor. Communication hooks take dense buckets only.
//
// Note [Reducer lifetime]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// The wrapper (and so the reducer) may be freed while a backward pass it
// prepared is running, by a hook for example. The destructor removes the
// autograd hooks, so no later gradient reaches it; the callbacks queued on
// the autograd engine hold only a weak reference, and raise instead of
// touching a destroyed reducer.
//
// Note [Unprepared backward]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// A gradient that arrives while the reducer is idle belongs to a backward
// pass nobody prepared it for: its outputs did not come through the
// wrapper's forward (a backward inside forward, as in manual optimization),
// or the iteration's gradients were already reduced (a second backward over
// the same graph). Left alone it would stay unaveraged on this rank and the
// replicas would drift apart without a word, so the hook raises instead.
// Accumulating locally is said explicitly: a forward inside no_sync, or
// entering no_sync, moves the reducer to kAccumulating.

namespace {

class GradientReadyHook : public torch::autograd::FunctionPostHook {
 public:
  GradientReadyHook(Reducer* reducer, size_t index)
      : reducer_(reducer), index_(index) {}

  // `inputs` holds the gradient handed to the accumulator; it is undefined
  // when autograd ran the accumulator with no gradient.
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& inputs) override {
    reducer_->on_gradient_ready(
        index_, !inputs.empty() && inputs[0].defined());
    return outputs;
  }

 private:
  Reducer* reducer_;
  size_t index_;
};

constexpr size_t kUnassigned = std::numeric_limits<size_t>::max();

// A sparse gradient of `param`'s shape with no entries (sparse along the
// first dimension, as an embedding's).
at::Tensor empty_sparse_like(const at::Tensor& param) {
  std::vector<int64_t> value_sizes = param.sizes().vec();
  value_sizes[0] = 0;
  return at::sparse_coo_tensor(
      at::empty({1, 0}, param.options().dtype(at::kLong)),
      at::empty(value_sizes, param.options()), param.sizes());
}

// What bucket assignment needs to know about each parameter, for rebuilds.
std::vector<TensorSpec> tensor_specs(
    const std::vector<at::Tensor>& params,
    std::optional<c10::ScalarType> reduce_dtype,
    const std::vector<bool>& sparse,
    const std::vector<int64_t>& units) {
  TORCH_CHECK(units.empty() || units.size() == params.size(), "Reducer got ",
              units.size(), " layer units for ", params.size(), " parameters");
  std::vector<TensorSpec> specs;
  specs.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& param = params[i];
    const auto bucket_dtype = reduce_dtype.value_or(param.scalar_type());
    specs.push_back(TensorSpec{
        param.numel() * static_cast<int64_t>(c10::elementSize(bucket_dtype)),
        param.scalar_type(), param.device(), !sparse.empty() && sparse.at(i),
        units.empty() ? -1 : units[i]});
  }
  return specs;
}

} // namespace

const char* phase_name(Phase phase) {
  switch (phase) {
    case Phase::kIdle:
      return "idle";
    case Phase::kAccumulating:
      return "accumulating";
    case Phase::kExpectingGradients:
      return "expecting gradients";
    case Phase::kReducing:
      return "reducing";
  }
  return "unknown";
}

size_t accumulator_post_hook_count(const at::Tensor& param) {
  const auto accumulator = torch::autograd::impl::try_get_grad_accumulator(param);
  return accumulator ? accumulator->post_hooks().size() : 0;
}

Reducer::Reducer(
    std::vector<at::Tensor> params,
    std::vector<std::string> param_names,
    const std::vector<std::vector<size_t>>& buckets,
    c10::intrusive_ptr<c10d::ProcessGroup> process_group,
    ReducerOptions options,
    const std::vector<bool>& sparse_gradients)
    : params_(std::move(params)),
      param_names_(std::move(param_names)),
      process_group_(std::move(process_group)),
      options_(options),
      gradients_stay_local_(false),
      sparse_gradients_(sparse_gradients),
      drop_plan_(params_.size()),
      gradient_order_(
          tensor_specs(
              params_, options.reduce_dtype, sparse_gradients, options.layer_units),
          options.bucket_caps,
          options.rebuild_buckets) {
  const size_t n = params_.size();
  TORCH_CHECK(n > 0, "Reducer needs at least one parameter");
  TORCH_CHECK(
      param_names_.size() == n, "Reducer got ", n, " parameters but ",
      param_names_.size(), " names");
  TORCH_CHECK(process_group_, "Reducer needs a process group");
  gradients_stay_local_ = stays_local();
  set_average_factor(process_group_->getSize());
  reset_step_check();
  drops_layers_ = std::any_of(
      options_.layer_units.begin(), options_.layer_units.end(),
      [](int64_t unit) { return unit >= 0; });
  gradient_order_.set_first_rebuild(
      !options_.find_unused_parameters || options_.static_graph);

  buckets_ = lay_out_buckets(layout_inputs(), buckets, arenas_);
  index_buckets();
  if (options_.gradient_as_bucket_view) {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < n; ++i) {
      at::Tensor& grad = params_[i].mutable_grad();
      const Bucket& bucket = buckets_[bucket_of_param_[i]];
      if (grad.defined() && !bucket.sparse) {
        const at::Tensor& view = bucket.views[slot_of_param_[i]];
        view.copy_(grad);
        grad = view;
      }
    }
  }

  ready_.assign(n, false);
  local_used_ = at::zeros({static_cast<int64_t>(n)}, at::kInt);
  const auto device = params_.front().device();
  used_for_allreduce_ = device.is_cpu()
      ? local_used_
      : at::zeros({static_cast<int64_t>(n)}, at::TensorOptions(at::kInt).device(device));

  accumulators_.reserve(n);
  hook_keys_.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    auto accumulator = torch::autograd::impl::grad_accumulator(params_[i]);
    TORCH_CHECK(accumulator, "parameter ", param_names_[i],
                " has no gradient accumulator");
    hook_keys_.push_back(accumulator->add_post_hook(
        std::make_unique<GradientReadyHook>(this, i)));
    accumulators_.push_back(std::move(accumulator));
  }
}

LayoutInputs Reducer::layout_inputs() const {
  return LayoutInputs{
      params_, param_names_, sparse_gradients_, options_.reduce_dtype,
      options_.gradient_as_bucket_view};
}

void Reducer::index_buckets() {
  const size_t n = params_.size();
  bucket_of_param_.assign(n, kUnassigned);
  slot_of_param_.assign(n, kUnassigned);
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const auto& indices = buckets_[b].param_indices;
    for (size_t slot = 0; slot < indices.size(); ++slot) {
      bucket_of_param_[indices[slot]] = b;
      slot_of_param_[indices[slot]] = slot;
    }
  }
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(bucket_of_param_[i] != kUnassigned, "parameter ",
                param_names_[i], " is in no bucket");
  }
  gradient_order_.set_layout(bucket_indices_locked());
}

Reducer::~Reducer() {
  std::lock_guard<std::mutex> lock(mutex_);
  remove_autograd_hooks_locked();
}

void Reducer::remove_autograd_hooks() {
  std::lock_guard<std::mutex> lock(mutex_);
  remove_autograd_hooks_locked();
}

void Reducer::remove_autograd_hooks_locked() {
  for (size_t i = 0; i < accumulators_.size(); ++i) {
    accumulators_[i]->del_post_hook(hook_keys_[i]);
  }
  accumulators_.clear();
  hook_keys_.clear();
}

void Reducer::set_average_factor(int64_t ranks) {
  TORCH_CHECK(ranks > 0, "cannot average gradients over ", ranks, " ranks");
  if (average_factor_.defined() && ranks == divide_ranks_) {
    return; // Called every iteration: no new scalar unless Join changed it.
  }
  divide_ranks_ = ranks;
  average_factor_ = c10::scalar_to_tensor(at::Scalar(1.0 / ranks));
  average_factor_.unsafeGetTensorImpl()->set_wrapped_number(true);
}

void Reducer::reset_step_check() {
  step_check_.reset();
  if (process_group_->getSize() > 1) {
    step_check_.emplace(
        process_group_->getRank(), process_group_->getSize(),
        params_.front().device());
  }
}

void Reducer::abandon_iteration() {
  for (auto& bucket : buckets_) {
    bucket.work.reset();
    bucket.future.reset();
  }
  used_work_.reset();
  stashed_grads_.clear();
  learning_iteration_ = false;
}

void Reducer::raise_if_out_of_step() {
  // See Note [Ranks out of step].
  if (!step_check_ || !step_check_->launched()) {
    return;
  }
  std::string message;
  {
    TimelineRange range(timeline_, TimelineEvent::kStepCheckWait);
    message = step_check_->wait();
  }
  if (message.empty()) {
    return;
  }
  // A peer may have raised instead of reducing: drop this backward's
  // collectives rather than wait for partners that may never come.
  abandon_iteration();
  local_used_.zero_();
  enter(phase_, Phase::kIdle);
  TORCH_CHECK(false, message);
}

void Reducer::check_step_before_forward_collectives() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (step_check_) {
    step_check_->drop(); // left over from an unfinished iteration
    step_check_->launch_forward(*process_group_, backwards_begun_);
    const std::string message = step_check_->wait();
    TORCH_CHECK(message.empty(), message);
  }
}

void Reducer::match_step_check_as_joined() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (step_check_) {
    step_check_->drop();
    step_check_->launch_as_joined(*process_group_);
    step_check_->wait();
  }
}

void Reducer::set_timeline(bool on) {
  std::lock_guard<std::mutex> lock(mutex_);
  timeline_.set_on(on);
  if (on) {
    reserve_timeline(); // for a backward already prepared
  }
}

void Reducer::reserve_timeline() {
  // See Note [Communication timeline]: at most one gradient instant per
  // parameter, a launch, hook and completion per bucket, and a few more.
  timeline_.reserve(params_.size() + 4 * buckets_.size() + 16, buckets_.size());
}

std::vector<TimelineEvent> Reducer::take_timeline(int64_t* dropped, int64_t wait_ms) {
  std::lock_guard<std::mutex> lock(mutex_);
  return timeline_.take(dropped, wait_ms);
}

int64_t Reducer::training_steps() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return training_steps_;
}

void Reducer::enter(Phase from, Phase to) {
  TORCH_INTERNAL_ASSERT(
      phase_ == from, "reducer moving to phase '", phase_name(to),
      "' expected to be in '", phase_name(from), "' but is in '",
      phase_name(phase_), "'");
  phase_ = to;
}

Phase Reducer::phase() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return phase_;
}

int64_t Reducer::iterations() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return iterations_;
}

bool Reducer::unused_parameters_stable() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return unused_stable_;
}

void Reducer::set_overlap_with_backward(bool overlap) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(
      phase_ != Phase::kReducing,
      "overlap_with_backward cannot change while gradients are being reduced");
  options_.overlap_with_backward = overlap;
}

void Reducer::set_static_graph() {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(
      iterations_ == 0,
      "set_static_graph() should be called before training loop starts and "
      "after DistributedDataParallel is constructed.");
  options_.static_graph = true;
  gradient_order_.set_first_rebuild(true);
}

void Reducer::register_comm_hook(std::shared_ptr<comm_hooks::CommHook> hook) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(hook, "register_comm_hook needs a hook");
  TORCH_CHECK(
      comm_hook_ == nullptr,
      "register_comm_hook or register_builtin_comm_hook can only be called once.");
  TORCH_CHECK(
      phase_ != Phase::kReducing,
      "a communication hook cannot be registered while gradients are being "
      "reduced; register it between iterations");
  for (const auto& bucket : buckets_) {
    TORCH_CHECK(
        !bucket.sparse, "ddp_ext's communication hooks reduce dense buckets "
        "only, and parameter ", param_names_[bucket.param_indices.front()],
        " has sparse gradients (an Embedding with sparse=True)");
  }
  comm_hook_ = std::move(hook);
  gradients_stay_local_ = stays_local();
  if (comm_hook_->keeps_per_bucket_state()) {
    gradient_order_.allow_continuous(false);
  }
}

bool Reducer::stays_local() const {
  // See Note [A world of one rank].
  return process_group_->getSize() == 1 && !options_.gradient_as_bucket_view &&
      !options_.reduce_dtype && comm_hook_ == nullptr;
}

bool Reducer::learning_static_graph() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return learning_iteration_;
}

bool Reducer::tracks_usage() const {
  return options_.find_unused_parameters ||
      (options_.static_graph && !graph_learned_);
}

bool Reducer::may_be_globally_unused(size_t index) const {
  if (drop_plan_.dropped(index)) {
    return true; // and is: every rank dropped it
  }
  if (options_.static_graph && graph_learned_) {
    return !static_used_globally_[index];
  }
  return tracks_usage() && local_used_.data_ptr<int32_t>()[index] == 0;
}

bool Reducer::unused_locally(size_t index) const {
  return !is_unused_.empty() && is_unused_[index];
}

std::vector<std::vector<size_t>> Reducer::bucket_indices() const {
  std::lock_guard<std::mutex> lock(mutex_); // a rebuild may replace buckets_
  return bucket_indices_locked();
}

std::vector<std::vector<size_t>> Reducer::bucket_indices_locked() const {
  std::vector<std::vector<size_t>> result;
  for (const auto& bucket : buckets_) {
    result.push_back(bucket.param_indices);
  }
  return result;
}

std::vector<int64_t> Reducer::bucket_sizes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<int64_t> result;
  for (const auto& bucket : buckets_) {
    const at::Tensor& param = bucket.params.front();
    result.push_back(
        bucket.sparse ? param.numel() * param.element_size()
                      : bucket.flat.numel() * bucket.flat.element_size());
  }
  return result;
}

std::string Reducer::unfinished_reduction_message() const {
  const std::string missing = names_of_parameters_not_ready();
  const bool all_arrived = next_bucket_ == buckets_.size();
  std::ostringstream message;
  message << "Expected to have finished reduction in the prior iteration "
             "before starting a new one. On rank "
          << process_group_->getRank() << ", ";
  if (all_arrived) {
    message << "every gradient of the previous backward pass arrived, but "
               "its end was never reached (the backward pass or a collective "
               "raised an error), so .grad holds unreduced values. Look for "
               "that earlier error.";
  } else if (options_.find_unused_parameters) {
    message << "these parameters were reachable from the forward's outputs "
               "yet got no gradient in the previous backward pass, so their "
               "buckets were never reduced: "
            << missing
            << ". find_unused_parameters=True is set: make sure forward "
               "returns every tensor that depends on them.";
  } else {
    message << "the previous backward pass produced no gradient for these "
               "parameters, so their buckets were never reduced: "
            << missing
            << ". If the forward does not always use them (a branch not "
               "taken, a frozen part, an output left out of the loss), pass "
               "find_unused_parameters=True to DistributedDataParallel; "
               "otherwise make sure every parameter takes part in the loss.";
  }
  return message.str();
}

void Reducer::prepare_for_forward(bool training_step) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (training_step) {
    ++training_steps_; // See Note [Ranks out of step].
  }
  if (phase_ != Phase::kReducing) {
    return;
  }
  const std::string message = unfinished_reduction_message();
  // Raise without waiting for the buckets already launched: when ranks
  // skipped different parameters, some of those allreduces have no partner
  // and waiting would hang this rank instead of telling its user. A caller
  // that catches this and goes on waits for them in prepare_for_backward.
  enter(Phase::kReducing, Phase::kIdle);
  TORCH_CHECK(false, message);
}

void Reducer::check_finalized() const {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(phase_ != Phase::kReducing, unfinished_reduction_message());
}

void Reducer::prepare_for_backward(
    const std::vector<at::Tensor>& outputs,
    const std::vector<size_t>& dropped,
    const std::vector<size_t>& accumulated_only) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(
      (dropped.empty() && accumulated_only.empty()) || !options_.static_graph,
      "static_graph=True needs the same parameters used in every iteration, "
      "and a LayerDrop changes them: leave static_graph off (ddp_ext skips "
      "dropped layers without find_unused_parameters).");
  if (phase_ == Phase::kReducing) {
    // Only reachable when a framework prepares a backward itself.
    const std::string message = unfinished_reduction_message();
    enter(Phase::kReducing, Phase::kIdle);
    TORCH_CHECK(false, message);
  }
  drop_plan_.set(dropped); // checks the indices
  for (size_t index : accumulated_only) {
    TORCH_CHECK(index < params_.size() && !drop_plan_.dropped(index),
                "parameter index ", index, " cannot be accumulated-only");
  }
  enter(phase_, Phase::kExpectingGradients);
  ++iterations_;
  wait_for_launched_buckets(); // left over from an unfinished iteration
  if (step_check_) {
    step_check_->drop();
  }
  order_vote_cast_ = false;
  gradient_order_.begin_iteration();
  std::fill(ready_.begin(), ready_.end(), false);
  next_bucket_ = 0;
  accumulated_only_ = accumulated_only;
  plan_confirmed_ = !drops_layers_;
  if (timeline_.on()) {
    reserve_timeline();
  }
  arm_buckets();
  used_work_.reset();
  stashed_grads_.clear();
  std::vector<size_t> previously_unused = std::move(unused_);
  unused_.clear();
  learning_iteration_ = options_.static_graph && !graph_learned_;
  if (learning_iteration_) {
    firings_.assign(params_.size(), 0);
  } else if (options_.static_graph) {
    firings_ = firings_expected_;
  }
  if (options_.static_graph) {
    unused_ = static_unused_locally_;
  } else if (options_.find_unused_parameters) {
    unused_ = find_unreached_accumulators(outputs, accumulators_);
  }
  if (iterations_ > 1 && unused_ != previously_unused) {
    unused_stable_ = false;
  }
  is_unused_.assign(params_.size(), false);
  for (size_t index : unused_) {
    is_unused_[index] = true;
  }
}

void Reducer::arm_buckets() {
  for (auto& bucket : buckets_) {
    bucket.pending = bucket.param_indices.size();
    bucket.dropped = drop_plan_.drops_all(bucket.param_indices);
    bucket.filled_on.reset();
  }
}

void Reducer::prepare_for_local_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_INTERNAL_ASSERT(
      phase_ != Phase::kReducing,
      "prepare_for_forward must run before prepare_for_local_backward");
  enter(phase_, Phase::kAccumulating);
}

void Reducer::allow_local_accumulation() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (phase_ == Phase::kIdle) {
    enter(Phase::kIdle, Phase::kAccumulating);
  }
}

void Reducer::set_forward_pass_work(
    c10::intrusive_ptr<c10d::Work> work, bool divide_by_initial_world_size) {
  std::lock_guard<std::mutex> lock(mutex_);
  forward_pass_work_ = std::move(work);
  divide_by_initial_world_size_ = divide_by_initial_world_size;
}

void Reducer::take_divide_factor() {
  // See Note [Join and the divide factor].
  int64_t ranks = process_group_->getSize();
  if (forward_pass_work_ && !divide_by_initial_world_size_) {
    forward_pass_work_->wait();
    const auto counted = forward_pass_work_->result();
    TORCH_INTERNAL_ASSERT(!counted.empty());
    ranks = std::llround(counted.front().cpu().item<double>());
  }
  forward_pass_work_.reset();
  set_average_factor(ranks);
}

void Reducer::start_reducing() {
  enter(Phase::kExpectingGradients, Phase::kReducing);
  timeline_.instant(TimelineEvent::kBackwardBegin, -1);
  const int64_t order_vote = cast_order_vote();
  if (step_check_) {
    ++backwards_begun_;
    step_check_->launch_backward(
        *process_group_, training_steps_, order_vote, drop_plan_.fingerprint());
    timeline_.instant(TimelineEvent::kStepCheckLaunch, -1);
  }
  take_divide_factor();
  // See Note [Layer dropping].
  for (size_t dropped : drop_plan_.indices()) {
    mark_ready(dropped, /*arrived=*/false);
  }
  for (size_t index : accumulated_only_) {
    if (!ready_[index]) {
      mark_ready(index, /*arrived=*/false);
    }
  }
  for (size_t unused : unused_) {
    if (!ready_[unused]) {
      mark_ready(unused);
    }
  }
}

void Reducer::on_gradient_ready(size_t index, bool gradient_arrived) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (gradient_arrived && tracks_usage()) {
    local_used_.data_ptr<int32_t>()[index] = 1;
  }
  switch (phase_) {
    case Phase::kAccumulating:
      return; // See Note [Reducer phases]: no_sync.
    case Phase::kIdle:
      // See Note [Unprepared backward].
      TORCH_CHECK(
          !gradient_arrived,
          "DistributedDataParallel on rank ", process_group_->getRank(),
          " got a gradient for parameter ", param_names_[index],
          " in a backward pass it was not prepared for, so it would not be "
          "averaged across ranks. This happens when backward runs on outputs "
          "that did not come from the wrapper's forward (a backward inside "
          "forward, as in manual optimization: call "
          "ddp_model.reducer.prepare_for_backward(outputs) before it), or "
          "when a second backward runs after the gradients were already "
          "reduced. To accumulate gradients locally on purpose, run forward "
          "and backward inside ddp_model.no_sync().");
      return;
    case Phase::kExpectingGradients:
      start_reducing();
      break;
    case Phase::kReducing:
      break;
  }
  if (drop_plan_.dropped(index)) {
    TORCH_CHECK(!gradient_arrived, dropped_gradient_message(index));
    return; // marked ready when the backward started
  }
  if (learning_iteration_) {
    ++firings_[index]; // See Note [Static graph]: marked at the end.
    gradient_order_.record(index); // the last firing counts
    return;
  }
  if (options_.static_graph) {
    if (unused_locally(index)) {
      TORCH_CHECK(
          !gradient_arrived, "static_graph=True, but parameter ",
          param_names_[index], " got a gradient on rank ",
          process_group_->getRank(), " although it got none in the first "
          "iteration: the set of parameters used must not change. Use "
          "find_unused_parameters=True instead of static_graph for such models.");
      return;
    }
    TORCH_CHECK(
        firings_[index] > 0,
        "Expected to mark a variable ready only once. On rank ",
        process_group_->getRank(), ", parameter ", param_names_[index],
        " received more gradients in this backward pass than in the first "
        "iteration, which static_graph=True requires to be the same in "
        "every iteration.");
    if (--firings_[index] > 0) {
      return;
    }
  }
  mark_ready(index);
}

void Reducer::mark_ready(size_t index, bool arrived) {
  TORCH_CHECK(
      !ready_[index],
      "Expected to mark a variable ready only once. On rank ",
      process_group_->getRank(), ", parameter ", param_names_[index],
      " received a gradient after it had already been reduced in this "
      "backward pass. This happens when autograd runs a parameter's "
      "accumulator twice in one backward (reentrant activation checkpointing, "
      "torch.utils.checkpoint with use_reentrant=True, or a backward that "
      "runs inside another), or when find_unused_parameters=True did not see "
      "the parameter from the forward's outputs. Use "
      "torch.utils.checkpoint(..., use_reentrant=False) or static_graph=True, "
      "and return from forward every tensor that depends on the parameter.");
  ready_[index] = true;
  // The timeline flags a dropped parameter (only one that did not arrive can be).
  timeline_.instant(
      TimelineEvent::kGradientReady, index, !arrived && drop_plan_.dropped(index));
  // See Note [Gradient order prediction]: one with no gradient in this
  // backward keeps its place.
  if (!arrived) {
    gradient_order_.record_dropped(index);
  } else if (!learning_iteration_) {
    gradient_order_.record(index);
  }
  Bucket& bucket = buckets_[bucket_of_param_[index]];
  if (!bucket.dropped) { // See Note [Layer dropping]: it does not travel.
    note_fill_stream(bucket.filled_on, params_[index].device());
    if (!options_.batched_grad_copy) {
      copy_into_bucket(index, /*scale=*/comm_hook_ == nullptr);
    }
  }
  if (--bucket.pending == 0) {
    launch_ready_buckets();
  }
}

std::string Reducer::dropped_gradient_message(size_t index) const {
  std::ostringstream message;
  message << "DistributedDataParallel on rank " << process_group_->getRank()
          << ": parameter " << param_names_[index]
          << " belongs to a layer that LayerDrop dropped in this iteration, "
             "yet it got a gradient. The buckets of dropped layers are not "
             "communicated, so this gradient would not be averaged across "
             "ranks. A dropped layer's parameters must not be used "
             "elsewhere in the forward: share them through a module outside "
             "the LayerDrop, or do not call the dropped layer.";
  return message.str();
}

void Reducer::copy_into_bucket(size_t index, bool scale) {
  if (gradients_stay_local_) {
    return; // See Note [A world of one rank].
  }
  Bucket& bucket = buckets_[bucket_of_param_[index]];
  const at::Tensor& grad = params_[index].grad();
  at::NoGradGuard no_grad;
  if (bucket.sparse) {
    copy_sparse_gradient(bucket, index, grad);
    return;
  }
  const at::Tensor& view = bucket.views[slot_of_param_[index]];
  if (!grad.defined()) {
    view.zero_();
    return;
  }
  TORCH_CHECK(!grad.is_sparse(), "parameter ", param_names_[index],
              " has a sparse gradient; ddp_ext reduces dense gradients only");
  if (is_bucket_view(grad, view)) {
    if (may_be_globally_unused(index)) {
      stashed_grads_.emplace_back(index, grad.clone());
    }
    if (scale) {
      view.mul_(average_factor_);
    }
  } else if (scale) {
    at::Tensor out = view;
    at::mul_out(out, grad, average_factor_);
  } else {
    view.copy_(grad);
  }
}

void Reducer::copy_sparse_gradient(
    Bucket& bucket, size_t index, const at::Tensor& grad) {
  // See Note [Sparse gradients].
  const at::Tensor& param = params_[index];
  if (!grad.defined()) {
    bucket.sparse_grad = empty_sparse_like(param);
    return;
  }
  TORCH_CHECK(
      grad.is_sparse(), "parameter ", param_names_[index], " was expected to "
      "get a sparse gradient (its module produces them) but got a dense one");
  bucket.sparse_grad = grad.div(divide_ranks_);
}

void Reducer::launch_ready_buckets() {
  while (next_bucket_ < buckets_.size() &&
         buckets_[next_bucket_].pending == 0) {
    if (options_.overlap_with_backward && !learning_iteration_) {
      launch(next_bucket_);
    }
    ++next_bucket_;
  }
  if (next_bucket_ < buckets_.size() || learning_iteration_) {
    return; // See Note [Static graph] for who finishes a learning iteration.
  }
  if (options_.find_unused_parameters && !options_.static_graph) {
    launch_used_bitmap_allreduce();
  }
  queue_at_end_of_backward(&Reducer::finalize_backward);
}

c10d::GradBucket Reducer::grad_bucket(size_t bucket_index, at::Tensor buffer) const {
  const Bucket& bucket = buckets_[bucket_index];
  return c10d::GradBucket(
      bucket_index, buckets_.size(), std::move(buffer), bucket.offsets,
      bucket.lengths, bucket.sizes, bucket.params, std::nullopt);
}

void Reducer::launch(size_t bucket_index) {
  if (gradients_stay_local_) {
    return; // See Note [A world of one rank].
  }
  Bucket& bucket = buckets_[bucket_index];
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
  if (options_.batched_grad_copy) {
    for (size_t index : bucket.param_indices) {
      copy_into_bucket(index, /*scale=*/false);
    }
    if (comm_hook_ == nullptr) {
      at::NoGradGuard no_grad;
      bucket.flat.mul_(average_factor_);
    }
  }
  if (options_.skip_all_reduce_unused_params &&
      std::all_of(
          bucket.param_indices.begin(), bucket.param_indices.end(),
          [this](size_t index) { return unused_locally(index); })) {
    return; // Unused on every rank too, by the option's contract.
  }
  if (comm_hook_ != nullptr) {
    c10d::GradBucket handed = grad_bucket(bucket_index, bucket.flat);
    {
      TimelineRange hook_range(timeline_, TimelineEvent::kCommHook, bucket_index);
      bucket.future = comm_hook_->runHook(handed);
    }
    if (timeline_.on() && bucket.future) {
      range.set_value(bucket.flat.numel() * bucket.flat.element_size());
      timeline_.on_completion(bucket.future, bucket_index);
    }
    return;
  }
  std::vector<at::Tensor> tensors{bucket.sparse ? bucket.sparse_grad : bucket.flat};
  bucket.work = process_group_->allreduce(tensors);
  if (timeline_.on()) {
    range.set_value(tensors.front().is_sparse()
        ? tensors.front()._values().nbytes() : tensors.front().nbytes());
    timeline_.on_completion(*bucket.work, bucket_index);
  }
}

c10::intrusive_ptr<c10::ivalue::Future> Reducer::run_comm_hook(
    c10d::GradBucket& bucket) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (comm_hook_ != nullptr) {
      return comm_hook_->runHook(bucket);
    }
  }
  return run_allreduce(bucket);
}

c10::intrusive_ptr<c10::ivalue::Future> Reducer::run_allreduce(
    c10d::GradBucket& bucket) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<at::Tensor> tensors{bucket.getBufferRef()};
  return process_group_->allreduce(tensors)->getFuture();
}

std::vector<c10d::GradBucket> Reducer::zeros_like_grad_buckets() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<c10d::GradBucket> result;
  result.reserve(buckets_.size());
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const Bucket& bucket = buckets_[b];
    const at::Tensor& param = bucket.params.front();
    at::Tensor zeros = bucket.sparse
        ? empty_sparse_like(param)
        : at::zeros_like(bucket.flat);
    result.push_back(grad_bucket(b, std::move(zeros)));
  }
  return result;
}

at::Tensor Reducer::local_used_map() {
  std::lock_guard<std::mutex> lock(mutex_);
  return local_used_.to(used_for_allreduce_.device(), /*non_blocking=*/false,
                        /*copy=*/true);
}

void Reducer::launch_all_buckets() {
  for (size_t b = 0; b < buckets_.size(); ++b) {
    launch(b);
  }
}

void Reducer::launch_used_bitmap_allreduce() {
  if (gradients_stay_local_) {
    return; // See Note [A world of one rank]: the local bitmap is global.
  }
  if (!used_for_allreduce_.is_same(local_used_)) {
    // See Note [CUDA streams], point 5.
    used_for_allreduce_.copy_(
        host_snapshot_for_copy(local_used_, used_for_allreduce_.device()),
        /*non_blocking=*/true);
  }
  std::vector<at::Tensor> tensors{used_for_allreduce_};
  used_work_ = process_group_->allreduce(tensors);
}

void Reducer::wait_for_launched_buckets() {
  for (size_t b = 0; b < next_bucket_; ++b) {
    Bucket& bucket = buckets_[b];
    if (bucket.work) {
      bucket.work->wait();
      timeline_.awaited(b);
      if (bucket.sparse) {
        bucket.sparse_grad = bucket.work->result().front();
      }
      bucket.work.reset();
    }
    if (bucket.future) {
      // See Note [Communication hooks] in comm_hooks/comm_hook.h.
      auto future = std::move(bucket.future);
      bucket.future.reset();
      future->wait();
      const at::Tensor reduced = comm_hook_->parseHookResult(future->value());
      if (!reduced.is_same(bucket.flat)) {
        TORCH_CHECK(
            reduced.numel() == bucket.flat.numel(),
            "the communication hook's future for bucket ", b, " holds ",
            reduced.numel(), " elements, but the bucket has ",
            bucket.flat.numel(), ": return the reduced bucket.buffer()");
        at::NoGradGuard no_grad;
        bucket.flat.copy_(reduced.reshape({-1}));
      }
    }
  }
}

std::vector<bool> Reducer::wait_for_used_bitmap() {
  if (used_work_) {
    used_work_->wait();
    used_work_.reset();
  }
  const at::Tensor used =
      gradients_stay_local_ ? local_used_ : used_for_allreduce_.cpu();
  const int32_t* counts = used.data_ptr<int32_t>();
  std::vector<bool> globally_used(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    globally_used[i] = counts[i] > 0;
  }
  local_used_.zero_();
  return globally_used;
}

void Reducer::finalize_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_INTERNAL_ASSERT(phase_ == Phase::kReducing && !learning_iteration_);
  TORCH_INTERNAL_ASSERT(next_bucket_ == buckets_.size());
  TimelineRange range(timeline_, TimelineEvent::kFinalize);
  if (!options_.overlap_with_backward) {
    launch_all_buckets();
  }
  raise_if_out_of_step();
  {
    TimelineRange wait_range(timeline_, TimelineEvent::kWaitForBuckets);
    wait_for_launched_buckets();
  }
  std::vector<bool> globally_used; // empty: every parameter counts as used
  if (options_.static_graph) {
    globally_used = static_used_globally_;
  } else if (options_.find_unused_parameters) {
    globally_used = wait_for_used_bitmap();
  }
  write_back_gradients(globally_used);
  conclude_gradient_order(/*launched_at_end=*/!options_.overlap_with_backward);
  enter(Phase::kReducing, Phase::kIdle);
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

void Reducer::queue_finish_learning_iteration() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!learning_iteration_) {
      return;
    }
  }
  queue_at_end_of_backward(&Reducer::finish_learning_iteration);
}

void Reducer::finish_learning_iteration() {
  std::lock_guard<std::mutex> lock(mutex_);
  finish_learning_iteration_locked();
}

void Reducer::finish_learning_iteration_locked() {
  if (!learning_iteration_) {
    return; // Another output sink of the same iteration finished it.
  }
  if (phase_ == Phase::kExpectingGradients) {
    start_reducing();
  }
  TORCH_INTERNAL_ASSERT(phase_ == Phase::kReducing);
  TimelineRange range(timeline_, TimelineEvent::kFinalize);
  static_unused_locally_.clear();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (local_used_.data_ptr<int32_t>()[i] == 0) {
      static_unused_locally_.push_back(i);
    }
    if (!ready_[i]) {
      mark_ready(i);
    }
  }
  firings_expected_ = firings_;
  launch_all_buckets();
  launch_used_bitmap_allreduce();
  raise_if_out_of_step();
  {
    TimelineRange wait_range(timeline_, TimelineEvent::kWaitForBuckets);
    wait_for_launched_buckets();
  }
  static_used_globally_ = wait_for_used_bitmap();
  graph_learned_ = true;
  learning_iteration_ = false;
  write_back_gradients(static_used_globally_);
  conclude_gradient_order(/*launched_at_end=*/true);
  enter(Phase::kReducing, Phase::kIdle);
}

void Reducer::update_process_group(
    c10::intrusive_ptr<c10d::ProcessGroup> process_group) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(process_group, "update_process_group needs a process group");
  // Work on the old group is dropped, not awaited: it may never complete.
  abandon_iteration();
  forward_pass_work_.reset();
  order_vote_cast_ = false;
  gradient_order_.restart();
  std::fill(ready_.begin(), ready_.end(), false);
  next_bucket_ = 0;
  drop_plan_.clear();
  phase_ = Phase::kIdle;
  process_group_ = std::move(process_group);
  gradients_stay_local_ = stays_local();
  set_average_factor(process_group_->getSize());
  reset_step_check(); // drops a check in flight on the old group
}

void Reducer::write_back_gradients(const std::vector<bool>& globally_used) {
  if (gradients_stay_local_) {
    return; // See Note [A world of one rank].
  }
  at::NoGradGuard no_grad;
  const auto used_by_no_rank = [&](size_t index) {
    return drop_plan_.dropped(index) ||
        (!globally_used.empty() && !globally_used[index]);
  };
  for (const auto& [index, stash] : stashed_grads_) {
    if (used_by_no_rank(index)) {
      params_[index].mutable_grad().copy_(stash);
      keep_for_current_stream(stash); // See Note [CUDA streams], point 4.
    }
  }
  stashed_grads_.clear();
  for (auto& bucket : buckets_) {
    if (bucket.dropped) {
      continue; // See Note [Layer dropping].
    }
    for (size_t slot = 0; slot < bucket.param_indices.size(); ++slot) {
      const size_t index = bucket.param_indices[slot];
      if (used_by_no_rank(index)) {
        continue; // No rank used it: .grad stays as the user left it.
      }
      if (bucket.sparse) {
        params_[index].mutable_grad() = std::move(bucket.sparse_grad);
        bucket.sparse_grad = at::Tensor();
        continue;
      }
      const at::Tensor& view = bucket.views[slot];
      at::Tensor& grad = params_[index].mutable_grad();
      if (options_.gradient_as_bucket_view) {
        if (!grad.defined() || !is_bucket_view(grad, view)) {
          grad = view;
        }
      } else if (!grad.defined()) {
        grad = at::empty_like(params_[index]);
        grad.copy_(view);
      } else {
        grad.copy_(view);
      }
    }
  }
}

std::string Reducer::names_of_parameters_not_ready() const {
  std::ostringstream names;
  bool first = true;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!ready_[i]) {
      names << (first ? "" : ", ") << param_names_[i];
      first = false;
    }
  }
  return names.str();
}

} // namespace ddp_ext::reducer
