#include "reducer/participation/static_graph.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>

namespace ddp_ext::reducer {

StaticGraph::StaticGraph(size_t params, bool drops_layers)
    : drops_layers_(drops_layers), firings_(params, 0) {}

void StaticGraph::enable(int64_t iterations) {
  TORCH_CHECK(
      iterations == 0,
      "set_static_graph() should be called before training loop starts and "
      "after DistributedDataParallel is constructed.");
  // The one check of this refusal; see the Note.
  TORCH_CHECK_VALUE(
      !drops_layers_,
      "static_graph=True needs the same parameters used in every iteration, "
      "and this module has a ddp_ext.LayerDrop, which changes them: leave "
      "static_graph off (dropped layers need no find_unused_parameters either).");
  on_ = true;
}

void StaticGraph::arm() {
  learning_ = on_ && !learned_;
  if (learning_) {
    std::fill(firings_.begin(), firings_.end(), 0);
  } else if (on_) {
    firings_ = firings_expected_; // same size: no allocation
  }
}

bool StaticGraph::ready_after_firing(
    size_t index,
    bool unused_locally,
    bool gradient_arrived,
    int rank,
    const std::string& name) {
  if (unused_locally) {
    TORCH_CHECK(
        !gradient_arrived, "static_graph=True, but parameter ", name,
        " got a gradient on rank ", rank, " although it got none in the first "
        "iteration: the set of parameters used must not change. Use "
        "find_unused_parameters=True instead of static_graph for such models.");
    return false;
  }
  TORCH_CHECK(
      firings_[index] > 0,
      "Expected to mark a variable ready only once. On rank ", rank,
      ", parameter ", name,
      " received more gradients in this backward pass than in the first "
      "iteration, which static_graph=True requires to be the same in "
      "every iteration.");
  return --firings_[index] == 0;
}

void StaticGraph::learned_from(
    const std::vector<bool>& used_locally, std::vector<bool> used_globally) {
  unused_locally_.clear();
  for (size_t i = 0; i < used_locally.size(); ++i) {
    if (!used_locally[i]) {
      unused_locally_.push_back(i);
    }
  }
  used_globally_ = std::move(used_globally);
  firings_expected_ = firings_;
  learned_ = true;
  learning_ = false;
}

} // namespace ddp_ext::reducer
