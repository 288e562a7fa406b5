#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "reducer/base/accumulator_ptr.h"
#include "reducer/observation/stall_watch.h"

namespace ddp_ext::reducer {

// Note [Unused parameters]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A bucket is reduced once every gradient in it has arrived, so a parameter
// that gets no gradient (a branch not taken, a frozen head) would hold its
// bucket back forever. With find_unused_parameters, the end of each
// synchronising forward searches the autograd graph from the outputs; the
// accumulators it does not reach are marked ready by the first hook of the
// backward (their bucket slice gets their current .grad, or zeros).
//
// Outputs that the loss ignores are passed through an identity autograd
// function (ddp_ext/_output_sink.py) so that autograd still runs their
// accumulators, with no gradient; those hooks mark the parameter ready too.
//
// Whether a parameter took part anywhere is global knowledge: each rank keeps
// a per-parameter "used" bitmap (set by hooks that carried a gradient, also
// inside no_sync) and allreduces it once all buckets are launched. Parameters
// used by no rank keep their .grad untouched (None stays None, as in local
// training); parameters used by some rank get the average, where the ranks
// that did not use it contribute zeros (or the .grad they already hold).

// Indices of the gradient accumulators that no path of the autograd graph
// reaches from `outputs`: the parameters the forward did not use.
std::vector<size_t> find_unreached_accumulators(
    const std::vector<at::Tensor>& outputs,
    const std::vector<AccumulatorPtr>&
        accumulators);

// Which parameters are used: the per-parameter "used" bitmap and its
// allreduce, and the parameters this iteration marks ready up front because
// this rank will give them no gradient. See the Note. Not thread-safe: the
// reducer calls it under its lock.
class Usage {
 public:
  // `search`: find_unused_parameters (search the graph after each forward).
  // The bitmap is allreduced on `device` (the parameters').
  Usage(size_t params, c10::Device device, bool search);

  bool searches() const {
    return search_;
  }

  // The hot path: parameter `index` got a gradient on this rank.
  void mark_used(size_t index) {
    used_[index] = 1;
  }
  bool used_locally(size_t index) const {
    return used_[index] != 0;
  }
  // The bitmap, per parameter.
  std::vector<bool> used_locally() const;
  // A copy of the bitmap as it would be allreduced, on the parameters' device.
  at::Tensor bitmap_copy() const;

  // The parameters this rank gives no gradient in the backward being armed.
  // `compare`: a change from the last iteration's makes usage unstable.
  void set_unused(std::vector<size_t> unused, bool compare);
  const std::vector<size_t>& unused() const {
    return unused_;
  }
  bool unused_locally(size_t index) const {
    return !is_unused_.empty() && is_unused_[index];
  }
  // Whether every synchronising iteration so far left the same parameters
  // unused (what static_graph requires).
  bool stable() const {
    return stable_;
  }

  // Starts summing the bitmap over the ranks of `group`.
  void launch_allreduce(c10d::ProcessGroup& group);
  // Per parameter, whether any rank used it (with `local`: this rank, in a
  // world of one); clears the bitmap for the next iteration. With a
  // `watch`, waits through it (Note [Hang attribution]).
  std::vector<bool> wait(bool local, StallWatch* watch = nullptr);
  // Forgets an allreduce in flight without waiting, and the stashed .grad
  // values; `clear`: the bitmap too.
  void drop(bool clear);

  // Keeps a copy of `grad`, parameter `index`'s .grad that is a bucket view
  // and may be used by no rank, so that its .grad can be restored untouched.
  void stash(size_t index, const at::Tensor& grad) {
    stashed_.emplace_back(index, grad.clone());
  }
  bool stashed_any() const {
    return !stashed_.empty();
  }
  // Restores the stashed .grad of each parameter `used_by_no_rank(index)`,
  // and forgets them all.
  void restore_stashed(
      const std::vector<at::Tensor>& params,
      const std::function<bool(size_t)>& used_by_no_rank);

 private:
  const bool search_;
  at::Tensor local_; // int32 on the CPU
  int32_t* used_; // local_'s data
  at::Tensor for_allreduce_; // the same on the parameters' device (local_ on CPU)
  c10::intrusive_ptr<c10d::Work> work_;
  std::vector<size_t> unused_;
  std::vector<bool> is_unused_;
  bool stable_ = true;
  std::vector<std::pair<size_t, at::Tensor>> stashed_;
};

} // namespace ddp_ext::reducer
