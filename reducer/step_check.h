#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>
#include <string>

namespace ddp_ext::reducer {

// Note [Ranks out of step]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Collectives pair up by their order on each rank, not by iteration. A rank
// that skips a synchronising forward or backward its peers ran (it caught an
// exception raised inside its forward and went on, or skipped a backward)
// pairs its gradient allreduces with another iteration's on the other ranks,
// and the replicas train on with gradients of different steps averaged.
//
// So each rank counts its training steps: the synchronising forwards it has
// begun with the module in training mode (an evaluation forward that only
// some ranks run is not a step). Every synchronising backward starts, as its
// first gradient arrives, with one small allreduce of an int64 per rank: each
// rank writes 1 + its step count into its own slot, zeros elsewhere; a rank
// that joined (Join's shadow loop) writes nothing. The allreduce runs while
// autograd computes the rest of the backward and is awaited at its end,
// before the buckets; then every rank sees every rank's step. If the ranks
// with data disagree, each of them raises from backward with the same
// message, naming the steps, before any averaged gradient reaches .grad.
//
// A forward that broadcasts buffers issues a collective of its own, so a
// rank that dropped out of an iteration after that broadcast would pair its
// next broadcast with its peers' backward. Such forwards therefore run the
// same check, and wait for it, just before the broadcast: its partner is then
// a peer's backward check, both are the same allreduce, and both ranks see
// the mismatch. A backward that finds the ranks out of step drops its bucket
// allreduces instead of waiting for partners that may never come.
//
// The check costs one latency-bound collective of world_size * 8 bytes per
// iteration, overlapped with the backward, and with buffer broadcasting one
// more, awaited, before the broadcast.
class StepCheck {
 public:
  StepCheck(int rank, int world_size, c10::Device device);

  // Starts the allreduce for a rank at training step `step`.
  void launch(c10d::ProcessGroup& group, int64_t step);

  // Takes part in the allreduce without a step: for a rank that joined.
  void launch_as_joined(c10d::ProcessGroup& group);

  bool launched() const;

  // Waits for the allreduce. Returns an empty string when every rank with
  // data is at `step`, else the error message (the same on every rank).
  std::string wait(int64_t step);

  // Forgets an allreduce in flight without waiting for it.
  void drop();

 private:
  void start(c10d::ProcessGroup& group, int64_t slot_value);

  int rank_;
  at::Tensor host_; // world_size int64 slots, on the CPU
  at::Tensor slots_; // the same on the parameters' device (host_ on CPU)
  c10::intrusive_ptr<c10d::Work> work_;
};

} // namespace ddp_ext::reducer
