#include "reducer/reducer.h"

#include <ATen/ATen.h>
#include <ATen/ScalarOps.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/variable.h>

#include <limits>
#include <sstream>
#include <utility>

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
// which parameters got a gradient but launch nothing, and the forward routes
// its outputs through the output sink, whose backward (the first node of the
// outer backward pass) queues finish_learning_iteration() on the engine. That
// runs after the whole backward, nested reentrant passes included: it marks
// the parameters that got nothing ready, reduces every bucket and the used
// bitmap, and remembers both. Later iterations mark the locally unused
// parameters ready at their first hook, overlap as usual, and leave the
// .grad of globally unused parameters alone, with no graph search and no
// bitmap allreduce. Because nothing is searched from the outputs, gradients
// produced by reentrant activation checkpointing are fine.
//
// Note [A world of one rank]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// With a single rank the average of each gradient is the gradient itself,
// so, unless .grad must be a bucket view, the reducer leaves gradients where
// autograd put them: hooks keep their bookkeeping (so every error is raised
// as with more ranks) but copy nothing, no collective is launched, and
// nothing is written back. Parameters that got no gradient keep their .grad,
// which is what "used by no rank" means in a world of one.
//
// Note [Gradient averaging]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// Each gradient is multiplied by 1/world_size while it is copied into its
// bucket (one pass instead of a copy and a scale), and the buckets are then
// summed. Scaling before summing, as torch's DDP does, keeps low-precision
// sums in range and gives the same rounding as torch's DDP.

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

// The slice of `flat` starting at `offset` elements, strided like `param`
// when that is possible, so that a .grad pointing at it keeps the parameter's
// memory layout.
at::Tensor view_for(const at::Tensor& flat, int64_t offset, const at::Tensor& param) {
  if (param.is_non_overlapping_and_dense()) {
    return flat.as_strided(
        param.sizes(), param.strides(), flat.storage_offset() + offset);
  }
  return flat.narrow(0, offset, param.numel()).view(param.sizes());
}

constexpr size_t kUnassigned = std::numeric_limits<size_t>::max();

} // namespace

const char* phase_name(Phase phase) {
  switch (phase) {
    case Phase::kIdle:
      return "idle";
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
    ReducerOptions options)
    : params_(std::move(params)),
      param_names_(std::move(param_names)),
      process_group_(std::move(process_group)),
      options_(options),
      gradients_stay_local_(
          process_group_ && process_group_->getSize() == 1 &&
          !options.gradient_as_bucket_view) {
  const size_t n = params_.size();
  TORCH_CHECK(n > 0, "Reducer needs at least one parameter");
  TORCH_CHECK(
      param_names_.size() == n, "Reducer got ", n, " parameters but ",
      param_names_.size(), " names");
  TORCH_CHECK(process_group_, "Reducer needs a process group");

  average_factor_ =
      c10::scalar_to_tensor(at::Scalar(1.0 / process_group_->getSize()));
  average_factor_.unsafeGetTensorImpl()->set_wrapped_number(true);

  at::NoGradGuard no_grad;
  bucket_of_param_.assign(n, kUnassigned);
  slot_of_param_.assign(n, kUnassigned);
  buckets_.reserve(buckets.size());
  for (const auto& indices : buckets) {
    TORCH_CHECK(!indices.empty(), "Reducer got an empty bucket");
    const at::Tensor& first = params_.at(indices.front());
    Bucket bucket;
    int64_t numel = 0;
    for (size_t index : indices) {
      TORCH_CHECK(index < n, "bucket holds parameter index ", index,
                  " but there are only ", n, " parameters");
      TORCH_CHECK(bucket_of_param_[index] == kUnassigned, "parameter ",
                  param_names_[index], " is in two buckets");
      const at::Tensor& param = params_[index];
      TORCH_CHECK(param.is_leaf() && param.requires_grad(), "parameter ",
                  param_names_[index], " must be a leaf that requires grad");
      TORCH_CHECK(
          param.scalar_type() == first.scalar_type() &&
              param.device() == first.device(),
          "bucket mixes ", first.scalar_type(), " on ", first.device(),
          " with parameter ", param_names_[index], " (",
          param.scalar_type(), " on ", param.device(), ")");
      bucket_of_param_[index] = buckets_.size();
      slot_of_param_[index] = bucket.param_indices.size();
      bucket.param_indices.push_back(index);
      numel += param.numel();
    }
    bucket.flat = at::zeros({numel}, first.options());
    int64_t offset = 0;
    for (size_t index : indices) {
      const at::Tensor& param = params_[index];
      at::Tensor view = view_for(bucket.flat, offset, param);
      offset += param.numel();
      at::Tensor& grad = param.mutable_grad();
      if (options_.gradient_as_bucket_view && grad.defined()) {
        view.copy_(grad);
        grad = view;
      }
      bucket.views.push_back(std::move(view));
    }
    buckets_.push_back(std::move(bucket));
  }
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(bucket_of_param_[i] != kUnassigned, "parameter ",
                param_names_[i], " is in no bucket");
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

Reducer::~Reducer() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (size_t i = 0; i < accumulators_.size(); ++i) {
    accumulators_[i]->del_post_hook(hook_keys_[i]);
  }
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

void Reducer::set_overlap_with_backward(bool overlap) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(
      phase_ != Phase::kReducing,
      "overlap_with_backward cannot change while gradients are being reduced");
  options_.overlap_with_backward = overlap;
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
  if (options_.static_graph && graph_learned_) {
    return !static_used_globally_[index];
  }
  return tracks_usage() && local_used_.data_ptr<int32_t>()[index] == 0;
}

std::vector<std::vector<size_t>> Reducer::bucket_indices() const {
  std::vector<std::vector<size_t>> result;
  for (const auto& bucket : buckets_) {
    result.push_back(bucket.param_indices);
  }
  return result;
}

void Reducer::prepare_for_forward() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (phase_ != Phase::kReducing) {
    return;
  }
  const std::string missing = names_of_parameters_not_ready();
  const bool all_arrived = next_bucket_ == buckets_.size();
  // Raise without waiting for the buckets already launched: when ranks
  // skipped different parameters, some of those allreduces have no partner
  // and waiting would hang this rank instead of telling its user. A caller
  // that catches this and goes on waits for them in prepare_for_backward.
  enter(Phase::kReducing, Phase::kIdle);
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
  TORCH_CHECK(false, message.str());
}

void Reducer::prepare_for_backward(const std::vector<at::Tensor>& outputs) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_INTERNAL_ASSERT(
      phase_ != Phase::kReducing,
      "prepare_for_forward must run before prepare_for_backward");
  enter(phase_, Phase::kExpectingGradients);
  wait_for_launched_buckets(); // left over from an unfinished iteration
  std::fill(ready_.begin(), ready_.end(), false);
  next_bucket_ = 0;
  for (auto& bucket : buckets_) {
    bucket.pending = bucket.param_indices.size();
  }
  used_work_.reset();
  stashed_grads_.clear();
  unused_.clear();
  learning_iteration_ = options_.static_graph && !graph_learned_;
  if (options_.static_graph) {
    unused_ = static_unused_locally_;
  } else if (options_.find_unused_parameters) {
    unused_ = find_unreached_accumulators(outputs, accumulators_);
  }
}

void Reducer::prepare_for_local_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_INTERNAL_ASSERT(
      phase_ != Phase::kReducing,
      "prepare_for_forward must run before prepare_for_local_backward");
  enter(phase_, Phase::kIdle);
}

void Reducer::on_gradient_ready(size_t index, bool gradient_arrived) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (gradient_arrived && tracks_usage()) {
    local_used_.data_ptr<int32_t>()[index] = 1;
  }
  if (phase_ == Phase::kIdle) {
    return; // See Note [Reducer phases]: no_sync or no synchronising forward.
  }
  if (phase_ == Phase::kExpectingGradients) {
    enter(Phase::kExpectingGradients, Phase::kReducing);
    for (size_t unused : unused_) {
      mark_ready(unused);
    }
  }
  mark_ready(index);
}

void Reducer::mark_ready(size_t index) {
  TORCH_CHECK(
      !ready_[index],
      "Expected to mark a variable ready only once. On rank ",
      process_group_->getRank(), ", parameter ", param_names_[index],
      " received a gradient after it had already been reduced in this "
      "backward pass. This happens when autograd runs a parameter's "
      "accumulator twice in one backward (reentrant activation checkpointing, "
      "torch.utils.checkpoint with use_reentrant=True, or a backward that "
      "runs inside another), or when find_unused_parameters=True did not see "
      "the parameter from the forward's outputs, or when static_graph=True "
      "and the set of parameters used changed after the first iteration. Use "
      "torch.utils.checkpoint(..., use_reentrant=False) or static_graph=True, "
      "and return from forward every tensor that depends on the parameter.");
  ready_[index] = true;
  Bucket& bucket = buckets_[bucket_of_param_[index]];
  const at::Tensor& view = bucket.views[slot_of_param_[index]];
  const at::Tensor& grad = params_[index].grad();
  at::NoGradGuard no_grad;
  if (gradients_stay_local_) {
    // See Note [A world of one rank].
  } else if (!grad.defined()) {
    view.zero_();
  } else {
    TORCH_CHECK(!grad.is_sparse(), "parameter ", param_names_[index],
                " has a sparse gradient; ddp_ext reduces dense gradients only");
    if (grad.is_alias_of(view)) {
      if (may_be_globally_unused(index)) {
        stashed_grads_.emplace_back(index, grad.clone());
      }
      view.mul_(average_factor_);
    } else {
      at::Tensor out = view;
      at::mul_out(out, grad, average_factor_);
    }
  }
  if (--bucket.pending == 0) {
    launch_ready_buckets();
  }
}

void Reducer::launch_ready_buckets() {
  while (next_bucket_ < buckets_.size() &&
         buckets_[next_bucket_].pending == 0) {
    if (options_.overlap_with_backward && !learning_iteration_) {
      launch(buckets_[next_bucket_]);
    }
    ++next_bucket_;
  }
  if (next_bucket_ < buckets_.size() || learning_iteration_) {
    return; // See Note [Static graph] for who finishes a learning iteration.
  }
  if (options_.find_unused_parameters && !options_.static_graph) {
    launch_used_bitmap_allreduce();
  }
  torch::autograd::Engine::get_default_engine().queue_callback(
      [this] { finalize_backward(); });
}

void Reducer::launch(Bucket& bucket) {
  if (gradients_stay_local_) {
    return; // See Note [A world of one rank].
  }
  std::vector<at::Tensor> tensors{bucket.flat};
  bucket.work = process_group_->allreduce(tensors);
}

void Reducer::launch_all_buckets() {
  for (auto& bucket : buckets_) {
    launch(bucket);
  }
}

void Reducer::launch_used_bitmap_allreduce() {
  if (gradients_stay_local_) {
    return; // See Note [A world of one rank]: the local bitmap is global.
  }
  if (!used_for_allreduce_.is_same(local_used_)) {
    used_for_allreduce_.copy_(local_used_, /*non_blocking=*/true);
  }
  std::vector<at::Tensor> tensors{used_for_allreduce_};
  used_work_ = process_group_->allreduce(tensors);
}

void Reducer::wait_for_launched_buckets() {
  for (size_t b = 0; b < next_bucket_; ++b) {
    if (buckets_[b].work) {
      buckets_[b].work->wait();
      buckets_[b].work.reset();
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
  if (!options_.overlap_with_backward) {
    launch_all_buckets();
  }
  wait_for_launched_buckets();
  std::vector<bool> globally_used; // empty: every parameter counts as used
  if (options_.static_graph) {
    globally_used = static_used_globally_;
  } else if (options_.find_unused_parameters) {
    globally_used = wait_for_used_bitmap();
  }
  write_back_gradients(globally_used);
  enter(Phase::kReducing, Phase::kIdle);
}

void Reducer::queue_finish_learning_iteration() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!learning_iteration_) {
      return;
    }
  }
  torch::autograd::Engine::get_default_engine().queue_callback(
      [this] { finish_learning_iteration(); });
}

void Reducer::finish_learning_iteration() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!learning_iteration_) {
    return; // Another output sink of the same iteration finished it.
  }
  if (phase_ == Phase::kExpectingGradients) {
    enter(Phase::kExpectingGradients, Phase::kReducing);
  }
  TORCH_INTERNAL_ASSERT(phase_ == Phase::kReducing);
  static_unused_locally_.clear();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (local_used_.data_ptr<int32_t>()[i] == 0) {
      static_unused_locally_.push_back(i);
    }
    if (!ready_[i]) {
      mark_ready(i);
    }
  }
  launch_all_buckets();
  launch_used_bitmap_allreduce();
  wait_for_launched_buckets();
  static_used_globally_ = wait_for_used_bitmap();
  graph_learned_ = true;
  learning_iteration_ = false;
  write_back_gradients(static_used_globally_);
  enter(Phase::kReducing, Phase::kIdle);
}

void Reducer::write_back_gradients(const std::vector<bool>& globally_used) {
  if (gradients_stay_local_) {
    return; // See Note [A world of one rank].
  }
  at::NoGradGuard no_grad;
  for (const auto& [index, stash] : stashed_grads_) {
    if (!globally_used[index]) {
      params_[index].mutable_grad().copy_(stash);
    }
  }
  stashed_grads_.clear();
  for (const auto& bucket : buckets_) {
    for (size_t slot = 0; slot < bucket.param_indices.size(); ++slot) {
      const size_t index = bucket.param_indices[slot];
      if (!globally_used.empty() && !globally_used[index]) {
        continue; // No rank used it: .grad stays as the user left it.
      }
      const at::Tensor& view = bucket.views[slot];
      at::Tensor& grad = params_[index].mutable_grad();
      if (options_.gradient_as_bucket_view) {
        if (!grad.defined() || !grad.is_alias_of(view)) {
          grad = view;
        }
      } else if (!grad.defined()) {
        grad = view.clone();
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
