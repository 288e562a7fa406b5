#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "reducer/base/bucket_rebuild.h"
#include "reducer/layout/bucket_assignment.h"

namespace ddp_ext::reducer {

// Note [Gradient order prediction]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Buckets overlap communication with the backward pass only if they fill up
// in the order they are launched (Note [Overlap and bucket order]). At
// construction that order is a guess (reverse registration order); the
// reducer checks it against what happens (paper section 6.2.1).
//
// Observing. Each hook that marks a parameter ready stamps it with a counter
// (one store; no allocation, lock or string on the hot path). In a static
// graph's learning iteration nothing is marked ready until the end, so there
// the stamp is taken at each firing of the accumulator and the last one
// counts. After a synchronising backward the stamps give the order gradients
// became ready; parameters never stamped (unused in a learning iteration)
// come first, where later iterations mark them ready. A parameter of a
// dropped layer (Note [Layer dropping]) is marked ready at the start too,
// but only for this iteration: it keeps the place it has in the current
// layout, right after the parameter that precedes it there, so that drops
// that change every iteration do not read as a changing order.
//
// The measure. For a layout and an observed order, each gradient waits from
// its arrival until its bucket launches: a bucket launches when its last
// gradient has arrived and every bucket before it has launched. The wait is
// counted in gradient bytes that arrive meanwhile, a proxy for backward
// time. The cost of a layout is the byte-weighted mean wait as a fraction of
// all gradient bytes: 0 if every gradient launched on arrival, about 1/2 if
// everything waits for the end of the backward. Bucketing itself costs a
// little (a gradient waits for its bucket's later members), so the cost of
// the current layout is compared with the cost of the layout a rebuild from
// the same order would give; the difference is what a rebuild gains. The
// reducer reports each iteration's cost as its launch delay, and beside it
// the coarser overlap fraction: the fraction of gradient bytes whose bucket
// launched before the last gradient of the backward arrived. The overlap
// fraction misses delays that end before the last gradient (a bucket held
// back by an earlier one that fills late but not last); the launch delay
// counts them.
//
// Hysteresis. One odd iteration must not trigger a rebuild, which costs a
// broadcast and re-slicing the buckets. A rebuild from this iteration's
// order becomes the candidate when it gains at least `min_gain`; the
// candidate stays as long as it keeps gaining that much on each new
// iteration's order, else the watch starts over. A rank votes for a rebuild
// once its candidate has gained in `patience` consecutive iterations. Orders
// that alternate faster than that never win a vote: a candidate built from
// one loses on the other.
//
// Consensus. Every rank must build the same buckets at the same point: for
// a continuous rebuild each rank votes, the vote rides on the step check, a rebuild needs every rank's
// vote and follows rank 0's order. Note [Agreeing on the bucket layout] in
// reducer/layout/bucket_layout.h argues how, and how it orders with the other
// collectives.
//
// The first rebuild (once, and continuous) follows torch's DDP, at torch's
// point and without a vote: the first synchronising backward records its
// order (a rank that joined under Join and shadowed that backward records
// that it happened, and no order). With a static graph it is the second
// one: the first, the learning iteration, records none in torch's DDP
// (its hooks only count firings there), so torch rebuilds a forward
// later. At the start of the next forward with gradients enabled, after
// Join's notification and before the buffer broadcast (or in the Join hook
// of a rank that joined, at the same point), rank 0 broadcasts its first
// order and every rank rebuilds from it. From that forward on has_rebuilt()
// holds (torch's _has_rebuilt_buckets), so the second iteration's backward
// (the third's with a static graph) already runs with the rebuilt buckets,
// as torch's does. Rank 0 is the root and must send an order: a rank 0 that
// joined before any backward has none and sends its current layout's order.
// In torch's first layout (one bucket per kind, parameters in registration
// order) that is, within each kind, registration order, the order torch's
// joined rank 0 sends, so the rebuild gives torch's buckets; in ddp_ext's
// own first layout (reducer/layout/bucket_layout.h) it keeps the buckets as
// they are and the first rebuild is spent. There is no first rebuild
// when find_unused_parameters is set without static_graph (orders then
// depend on which parameters each iteration used). Continuous watching
// starts after the first rebuild; its rebuilds are voted on as above, at
// the end of a backward. A communication hook other than the stateless
// built-in ones stops it after the first rebuild, since hooks may keep
// state per bucket index (PowerSGD's error feedback).
//
// Why a rebuild is safe. It runs at the end of finalizing a backward (or a
// learning iteration), or at the start of a forward (the first rebuild),
// after every bucket's reduction was awaited and its result written to
// .grad, so no gradient is in flight and the buckets hold
// nothing that is needed again, except with gradient_as_bucket_view, where
// each .grad that is a view into its bucket is copied to its new view and
// re-pointed there. Every rank re-lays the same buckets at the same point,
// so ranks stay bitwise equal. Reduction is elementwise: with two ranks a
// gradient's sum is the same bits in any bucket; with more, where it lies in
// a bucket may change the order a collective adds the ranks' values, and so
// the rounding, as any bucket cap does, never the equality of the ranks.

struct RebuildPolicy {
  int patience = 3; // consecutive iterations a candidate must gain
  double min_gain = 0.05; // in the cost's units (fraction of gradient bytes)
};

// How one layout fares against one observed order; see the Note.
struct OrderCost {
  double wait = 0; // byte-weighted mean wait / gradient bytes
  double overlap_fraction = 0; // bytes launched before the last arrival / all
};

// `bucket_of[i]`: launch position of parameter i's bucket among `buckets`;
// `order`: parameter indices, first-ready first; `bytes[i]`: parameter i's
// bytes in its bucket. Pure.
OrderCost order_cost(
    const std::vector<size_t>& bucket_of,
    size_t buckets,
    const std::vector<size_t>& order,
    const std::vector<int64_t>& bytes);

// bucket_of for buckets given as parameter indices per bucket.
std::vector<size_t> bucket_of_params(
    const std::vector<std::vector<size_t>>& buckets, size_t params);

// One iteration of the watch (pure). `streak`: consecutive iterations the
// candidate has gained so far; `current`, `candidate`, `fresh`: this
// iteration's cost under the current layout, the candidate's layout, and the
// layout this iteration's own order would give.
struct WatchStep {
  int streak = 0;
  bool adopt_fresh = false; // the fresh layout becomes the candidate
  bool vote = false; // this rank asks for a rebuild to the candidate
};
WatchStep watch_step(
    int streak,
    double current,
    double candidate,
    double fresh,
    const RebuildPolicy& policy);

// Whether the summed votes of `ranks` ranks agree on a rebuild.
bool rebuild_agreed(int64_t summed_votes, int64_t ranks);

// The order gradients arrived in, the watch over it, and this rank's vote.
// Not thread-safe: the reducer calls it under its lock.
class GradientOrder {
 public:
  GradientOrder(
      std::vector<TensorSpec> specs,
      std::vector<int64_t> caps,
      BucketRebuild mode,
      RebuildPolicy policy = {});

  // Whether a first rebuild follows the first iteration (torch's rule: not
  // with find_unused_parameters, unless the graph is static), and how many
  // synchronising backwards to come it skips (a static graph's learning
  // iteration, see the Note).
  void set_first_rebuild(bool due, int skipped_backwards = 0);
  // false: no continuous watching after the first rebuild (a stateful
  // communication hook was registered).
  void allow_continuous(bool allowed);

  // Called when a synchronising backward is armed.
  void begin_iteration();
  // The hot path: parameter `index` is ready now.
  void record(size_t index) {
    stamps_[index] = clock_++;
  }
  // Parameter `index` gets no gradient in this backward: its layer was
  // dropped (it keeps its place; see the Note).
  void record_dropped(size_t index);
  // The current layout, as parameter indices per bucket in launch order:
  // where dropped parameters keep their place.
  void set_layout(const std::vector<std::vector<size_t>>& buckets);
  // After a finished synchronising backward: derives its order and costs it
  // under the layout it ran with. `launched_at_end`: nothing was launched
  // before the backward ended (a learning iteration, no overlap).
  void observe(
      const std::vector<size_t>& bucket_of, size_t buckets, bool launched_at_end);
  // Then updates the watch and this rank's vote against the layout the next
  // iteration will use.
  void update_vote(const std::vector<size_t>& bucket_of, size_t buckets);

  // The first rebuild (see the Note): a rank that joined shadowed a
  // synchronising backward, so its peers observed one.
  void shadowed_backward();
  // Whether the first rebuild is due at this forward: the same on every rank.
  bool first_rebuild_due() const {
    return first_pending() && first_ready_;
  }
  // The first observed order (empty on a rank that shadowed the backward).
  const std::vector<size_t>& first_order() const {
    return voted_order_;
  }

  // Whether the next synchronising backward carries a vote. The same on
  // every rank: it changes only when a rebuild is agreed.
  bool consulting() const;
  // This rank's vote for the next consensus: 0 or 1.
  int64_t vote() const;
  // The order behind the vote (what rank 0 broadcasts for a continuous
  // rebuild).
  const std::vector<size_t>& voted_order() const {
    return voted_order_;
  }
  // Buckets for `order`, as every rank builds them (with the current caps,
  // or with `caps`).
  std::vector<std::vector<size_t>> layout_for(const std::vector<size_t>& order) const;
  std::vector<std::vector<size_t>> layout_for(
      const std::vector<size_t>& order, const std::vector<int64_t>& caps) const;
  // Rebuilds from now on use `caps` (Note [Auto-tuned bucket caps] in
  // ddp_ext/_auto_buckets.py). The watch starts over: its candidate was laid
  // out with the old caps. A first rebuild still due stays due.
  void set_caps(std::vector<int64_t> caps);
  const std::vector<int64_t>& caps() const {
    return caps_;
  }
  // What bucket assignment knows about each parameter.
  const std::vector<TensorSpec>& specs() const {
    return specs_;
  }
  // An agreed rebuild happened; `changed`: the layout differs from before.
  void rebuilt(bool changed);
  // Forgets the watch and makes the first rebuild due again (a new process
  // group: torch's DDP rebuilds again too).
  void restart();

  bool has_rebuilt() const {
    return first_done_;
  }
  int64_t rebuilds() const {
    return rebuilds_;
  }
  int64_t observed_iterations() const {
    return observed_;
  }
  // The last observed order (empty before the first).
  const std::vector<size_t>& last_order() const {
    return order_;
  }
  // The last observed iteration's cost under the layout it ran with: its
  // overlap fraction and its mean wait (see the Note).
  double overlap_fraction() const {
    return last_cost_.overlap_fraction;
  }
  double launch_delay() const {
    return last_cost_.wait;
  }
  BucketRebuild mode() const {
    return mode_;
  }

 private:
  bool watching() const;
  bool first_pending() const;
  void forget_candidate();
  void derive_order();
  void place_dropped();

  const std::vector<TensorSpec> specs_;
  std::vector<int64_t> caps_; // see set_caps
  std::vector<int64_t> bytes_;
  BucketRebuild mode_;
  RebuildPolicy policy_;
  bool first_due_ = true;
  bool continuous_allowed_ = true;
  bool first_done_ = false;
  bool first_ready_ = false; // a synchronising backward happened since
  int first_skips_ = 0; // backwards still to skip before that

  std::vector<int64_t> stamps_; // per parameter; -1: not ready yet
  int64_t clock_ = 0;
  std::vector<bool> dropped_; // per parameter, this iteration
  std::vector<size_t> dropped_indices_;
  std::vector<size_t> layout_order_; // parameters in the current layout
  std::vector<size_t> order_;
  int64_t observed_ = 0;
  OrderCost last_cost_;

  // The layout a fresh rebuild would give the last order costed, and its
  // wait: an order that repeats (the steady state) is laid out once, not on
  // every iteration's critical path. Cleared with the caps.
  struct FreshLayout {
    std::vector<size_t> order;
    std::vector<size_t> bucket_of;
    size_t buckets = 0;
    double wait = 0;
  };
  const FreshLayout& fresh_layout();
  FreshLayout fresh_;

  int streak_ = 0;
  std::vector<size_t> candidate_order_;
  std::vector<size_t> candidate_bucket_of_;
  size_t candidate_buckets_ = 0;
  bool vote_ = false;
  std::vector<size_t> voted_order_;
  int64_t rebuilds_ = 0;
};

} // namespace ddp_ext::reducer
