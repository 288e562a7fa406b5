#pragma once

#include <ATen/core/ivalue.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <exception>
#include <memory>
#include <utility>

#include "process_groups/ordered_launches.h"

namespace ddp_ext::hierarchical {

// Once `work` is done, runs `launch` (the next step of a multi-step
// collective) in `ticket`'s turn of `launches`, so every rank issues it in
// call order (Note [Hierarchical allreduce], Ordering). Every ticket takes
// its turn: after a failure of `work`, `fail` gets the error and the turn
// passes with nothing launched; an error `launch` throws goes to `fail`.
template <typename Fail, typename Launch>
void launch_in_turn(const c10::intrusive_ptr<c10d::Work>& work, std::shared_ptr<OrderedLaunches> launches,
                    OrderedLaunches::Ticket ticket, Fail fail, Launch launch) {
  work->getFuture()->addCallback(
      [launches = std::move(launches), ticket, fail, launch](c10::ivalue::Future& done) {
        const bool failed = done.hasError();
        if (failed) {
          fail(done.exception_ptr());
        }
        launches->ready(ticket, [fail, launch, failed]() {
          if (failed) {
            return;
          }
          try {
            launch();
          } catch (...) {
            fail(std::current_exception());
          }
        });
      });
}

} // namespace ddp_ext::hierarchical
