#include "reducer/unused_parameters.h"

#include <torch/csrc/autograd/variable.h>

#include <unordered_set>

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

std::vector<size_t> find_unreached_accumulators(
    const std::vector<at::Tensor>& outputs,
    const std::vector<AccumulatorPtr>& accumulators) {
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<const torch::autograd::Node*> stack;
  for (const auto& output : outputs) {
    if (!output.defined() || !output.requires_grad()) {
      continue;
    }
    const auto* node = torch::autograd::impl::gradient_edge(output).function.get();
    if (node != nullptr && seen.insert(node).second) {
      stack.push_back(node);
    }
  }
  while (!stack.empty()) {
    const auto* node = stack.back();
    stack.pop_back();
    for (const auto& edge : node->next_edges()) {
      const auto* next = edge.function.get();
      if (next != nullptr && seen.insert(next).second) {
        stack.push_back(next);
      }
    }
  }
  std::vector<size_t> unreached;
  for (size_t i = 0; i < accumulators.size(); ++i) {
    if (seen.count(accumulators[i].get()) == 0) {
      unreached.push_back(i);
    }
  }
  return unreached;
}

} // namespace ddp_ext::reducer
