#pragma once

namespace ddp_ext::reducer {

// Note [Reducer phases]
// ~~~~~~~~~~~~~~~~~~~~~
// Within one training iteration the reducer moves through explicit phases:
//
//   kIdle ──prepare_for_backward──▶ kExpectingGradients ──first gradient──▶
//   kReducing ──last bucket launched, end of backward: finalize──▶ kIdle
//
//   any phase but kReducing ──prepare_for_local_backward──▶ kAccumulating
//   kAccumulating ──prepare_for_backward──▶ kExpectingGradients
//
// kIdle: no backward is expected (before the first forward, after a
//   finished reduction, under torch.no_grad). A gradient that arrives now
//   came from a backward the reducer was never told about (a backward over
//   the wrapped module outside the wrapper, a second backward over the same
//   graph): as torch's DDP does, it stays in .grad, unaveraged. See Note
//   [Unprepared backward].
// kAccumulating: the last forward ran inside no_sync (or no_sync was entered
//   with nothing armed): backward passes only accumulate into .grad.
// kExpectingGradients: a synchronising forward ran. A forward may start again
//   from here (a forward without backward is legal) and simply re-arms.
// kReducing: gradients are being copied into buckets and allreduced. A
//   forward that starts in this phase means the previous backward never gave
//   some parameters a gradient: prepare_for_forward raises "Expected to have
//   finished reduction in the prior iteration", naming them. Every rank that
//   skipped a parameter raises there. A rank that skipped nothing, while
//   another rank did, cannot know: it waits in its backward for an allreduce
//   its peer never starts, until the process group's timeout (torch's DDP
//   behaves the same). find_unused_parameters=True avoids both.
//
// Every transition goes through Reducer::enter(), which asserts where it
// comes from.
enum class Phase { kIdle, kAccumulating, kExpectingGradients, kReducing };

const char* phase_name(Phase phase);

} // namespace ddp_ext::reducer
