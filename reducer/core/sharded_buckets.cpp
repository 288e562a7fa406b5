// The reducer's side of Note [Sharded buckets]: the reduce-scatter chosen,
// with its end of a backward and separate buckets.
#include <c10/util/Exception.h>

#include <algorithm>
#include <memory>
#include <utility>

#include "reducer/core/reducer.h"
#include "reducer/finish/keep_shards.h"
#include "reducer/transport/reduce_scatter.h"

namespace ddp_ext::reducer {

void Reducer::set_reduce_scatter(BucketStep step, int64_t replicated_below) {
  std::unique_ptr<EndOfBackward> previous; // released after the lock: it may hold Python objects
  const auto lock = lock_state(Access::kChange);
  const int rank = process_group_->getRank();
  TORCH_CHECK(step, "set_reduce_scatter needs a step");
  check_between_iterations("reduce-scatter");
  check_nothing_deferred("reduce-scattering its buckets");
  TORCH_CHECK(
      !transport_->runs_hook(), "DistributedDataParallel on rank ", rank,
      " cannot reduce-scatter its buckets: a communication hook (or the reduce-scatter) is set already");
  TORCH_CHECK(
      !drops_layers_ && !options_.reduce_dtype &&
          std::none_of(sparse_gradients_.begin(), sparse_gradients_.end(), [](bool s) { return s; }),
      "DistributedDataParallel on rank ", rank,
      " reduce-scatters dense buckets of the parameters' dtype only, without layer dropping");
  TORCH_CHECK(replicated_below >= 0, "replicated_below is a number of bytes >= 0, got ", replicated_below);
  // Note [Replicated small buckets]: replicated buckets travel as without sharding.
  transport_ =
      std::make_shared<ReduceScatter>(replicated_below, step_check_->transport_without_hook());
  gradients_stay_local_ = stays_local();
  layout_.separate_buckets();
  previous = std::exchange(end_of_backward_, std::make_unique<KeepShards>(std::move(step)));
}

} // namespace ddp_ext::reducer
