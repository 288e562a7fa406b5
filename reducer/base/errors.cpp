#include "reducer/base/errors.h"

#include <sstream>

namespace ddp_ext::reducer {

std::string dropped_gradient_message(int rank, const std::string& name) {
  std::ostringstream message;
  message << "DistributedDataParallel on rank " << rank << ": parameter " << name
          << " belongs to a layer that LayerDrop dropped in this iteration, "
             "yet it got a gradient. The buckets of dropped layers are not "
             "communicated, so this gradient would not be averaged across "
             "ranks. A dropped layer's parameters must not be used "
             "elsewhere in the forward: share them through a module outside "
             "the LayerDrop, or do not call the dropped layer.";
  return message.str();
}

std::string marked_twice_message(int rank, const std::string& name) {
  std::ostringstream message;
  message << "Expected to mark a variable ready only once. On rank " << rank
          << ", parameter " << name
          << " received a gradient after it had already been reduced in this "
             "backward pass. This happens when autograd runs a parameter's "
             "accumulator twice in one backward (reentrant activation checkpointing, "
             "torch.utils.checkpoint with use_reentrant=True, or a backward that "
             "runs inside another), or when find_unused_parameters=True did not see "
             "the parameter from the forward's outputs. Use "
             "torch.utils.checkpoint(..., use_reentrant=False) or static_graph=True, "
             "and return from forward every tensor that depends on the parameter.";
  return message.str();
}

std::string unfinished_reduction_message(
    int rank,
    int64_t step,
    bool all_arrived,
    bool searching,
    const std::vector<std::string>& names,
    const std::vector<bool>& ready) {
  std::ostringstream missing;
  bool first = true;
  for (size_t i = 0; i < names.size(); ++i) {
    if (!ready[i]) {
      missing << (first ? "" : ", ") << names[i];
      first = false;
    }
  }
  std::ostringstream message;
  message << "Expected to have finished reduction in the prior iteration "
             "before starting a new one. On rank "
          << rank << " (training step " << step << "), ";
  if (all_arrived) {
    message << "every gradient of the previous backward pass arrived, but "
               "its end was never reached (the backward pass or a collective "
               "raised an error), so .grad holds unreduced values. Look for "
               "that earlier error.";
  } else if (searching) {
    message << "these parameters were reachable from the forward's outputs "
               "yet got no gradient in the previous backward pass, so their "
               "buckets were never reduced: "
            << missing.str()
            << ". find_unused_parameters=True is set: make sure forward "
               "returns every tensor that depends on them.";
  } else {
    message << "the previous backward pass produced no gradient for these "
               "parameters, so their buckets were never reduced: "
            << missing.str()
            << ". If the forward does not always use them (a branch not "
               "taken, a frozen part, an output left out of the loss), pass "
               "find_unused_parameters=True to DistributedDataParallel; "
               "otherwise make sure every parameter takes part in the loss. "
               "Ranks that did produce these gradients wait for their "
               "buckets' allreduce; with hang_timeout_s set (the default) "
               "they raise, naming this rank.";
  }
  return message.str();
}

} // namespace ddp_ext::reducer
