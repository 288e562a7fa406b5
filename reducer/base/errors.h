#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ddp_ext::reducer {

// What the reducer tells its user when an iteration goes wrong on this rank
// (`rank`). Formatted only when raised: TORCH_CHECK evaluates its message
// only on failure, so the hot path formats nothing.

// Note [Unprepared backward]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// A gradient that arrives while the reducer is idle belongs to a backward
// pass nobody prepared it for: its outputs did not come through the
// wrapper's forward (the wrapped module called directly, a backward inside
// forward as in manual optimization), or the iteration's gradients were
// already reduced (a second backward over the same graph). torch's reducer
// ignores autograd hooks it does not expect (`expect_autograd_hooks_`), and
// so does ddp_ext's: the gradient accumulates in .grad on this rank alone,
// unaveraged, and nothing is raised, so code written for torch's DDP (a
// local reference backward on the same module, as torch's own tests run)
// behaves the same (a second backward over the same forward is warned of at
// the next forward: Note [Late gradients] in reducer/core/late_gradients.h).
// A framework that wants such a backward synchronised calls
// reducer.prepare_for_backward(outputs) first, as with torch's DDP.
// What torch does raise on, ddp_ext raises on too: a parameter reduced twice
// in one prepared backward (marked_twice_message) and a forward before the
// last prepared backward finished (unfinished_reduction_message).

// See Note [Layer dropping] in reducer/participation/layer_drop.h.
std::string dropped_gradient_message(int rank, const std::string& name);

// A parameter's accumulator ran again after it was reduced in this backward.
std::string marked_twice_message(int rank, const std::string& name);

// A forward started before the previous synchronising backward finished
// reducing (Note [Reducer phases]). `all_arrived`: every bucket was launched;
// `searching`: find_unused_parameters; `ready[i]`: parameter names[i] got
// its gradient.
std::string unfinished_reduction_message(
    int rank,
    int64_t step,
    bool all_arrived,
    bool searching,
    const std::vector<std::string>& names,
    const std::vector<bool>& ready);

} // namespace ddp_ext::reducer
