#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace ddp_ext::reducer {

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
// A LayerDrop changes the parameters used from one iteration to the next, so
// a module with droppable layers (Note [Layer dropping]) refuses it.

// What the reducer knows about a static graph: whether the graph is static,
// the learning iteration, and what it learned. Not thread-safe: the reducer
// calls it under its lock.
class StaticGraph {
 public:
  // `params`: how many parameters; `drops_layers`: some belong to a
  // droppable layer.
  StaticGraph(size_t params, bool drops_layers);

  // Makes the graph static; only before the first synchronising backward
  // (`iterations` begun so far) and without droppable layers.
  void enable(int64_t iterations);
  bool on() const {
    return on_;
  }

  // A synchronising backward is armed: the first one learns, later ones
  // expect the firings learned.
  void arm();
  // Between the first synchronising forward and the end of its backward.
  bool learning() const {
    return learning_;
  }
  // Parameters still report their use: the graph is not static, or not
  // learned yet.
  bool learned() const {
    return learned_;
  }

  // The hot path while learning: parameter `index`'s accumulator ran.
  void count_firing(size_t index) {
    ++firings_[index];
  }
  // The hot path after learning: parameter `index` (named `name`) had its
  // accumulator run; `unused_locally`: it got no gradient while learning.
  // Returns whether it is ready now (its last expected firing). Raises on
  // `rank` if the graph changed.
  bool ready_after_firing(
      size_t index,
      bool unused_locally,
      bool gradient_arrived,
      int rank,
      const std::string& name);

  // Ends the learning iteration: `used_locally[i]` whether parameter i got a
  // gradient on this rank, `used_globally[i]` on any rank.
  void learned_from(
      const std::vector<bool>& used_locally, std::vector<bool> used_globally);
  // Forgets a learning iteration under way (its collectives were dropped).
  void abandon() {
    learning_ = false;
  }

  // After learning: the parameters this rank never uses, and per parameter
  // whether any rank uses it.
  const std::vector<size_t>& unused_locally() const {
    return unused_locally_;
  }
  const std::vector<bool>& used_globally() const {
    return used_globally_;
  }

 private:
  const bool drops_layers_;
  bool on_ = false;
  bool learning_ = false;
  bool learned_ = false;
  std::vector<size_t> unused_locally_;
  std::vector<bool> used_globally_;
  // Hook firings per parameter: counted while learning, then expected.
  std::vector<int> firings_;
  std::vector<int> firings_expected_;
};

} // namespace ddp_ext::reducer
