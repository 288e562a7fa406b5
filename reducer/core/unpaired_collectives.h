#pragma once

#include <ATen/core/ivalue.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace ddp_ext::reducer {

// Note [Collectives left without a partner]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// When ranks go out of step, or a peer raised or died, the reducer raises
// and drops the collectives of that iteration instead of waiting for
// partners that may never come (Note [Ranks out of step]). A dropped
// collective that never completes still holds a worker thread of a Gloo
// group until the group's timeout (30 minutes by default), and
// ProcessGroupGloo's destructor waits for its queue to drain and joins
// those threads. Whatever drops the last reference to the group would block
// there: the reducer, the Python group object, or a garbage collection that
// frees either in the middle of a later forward, while the peers wait in
// their next collective. A rank that caught the error and went on (a new
// wrapper over a new group, a retry loop, a notebook) would hang.
//
// So the reducer notes every collective it drops unfinished (and the ones
// still in flight when it is destroyed or moved to another group), and
// then keeps that process group alive until the process exits
// (keep_until_exit): its reference goes to a list that is never freed, so
// no destructor of that group ever runs. Its threads and sockets stay until
// exit, which the error already asks for. At exit, ddp_ext's release (Note
// [Exit after training] in ddp_ext/_exit.py) skips a group whose collectives
// do not finish within DDP_EXT_EXIT_TIMEOUT_S.
class UnpairedCollectives {
 public:
  // Notes a collective (or a hook's future) that is being dropped; null
  // and completed ones leave nothing behind.
  void dropping(const c10::intrusive_ptr<c10d::Work>& work);
  void dropping(const c10::intrusive_ptr<c10::ivalue::Future>& future);
  // Notes a collective that an owner reports as `unfinished`.
  void dropping(bool unfinished) {
    any_ = any_ || unfinished;
  }

  // Whether a dropped collective had not completed.
  bool any() const {
    return any_;
  }

  // Keeps `group` alive until the process exits if any() (see the Note),
  // and forgets what was noted.
  void keep_group_if_any(const c10::intrusive_ptr<c10d::ProcessGroup>& group);

 private:
  bool any_ = false;
};

// Holds a reference to `group` until the process exits; never destroyed.
void keep_until_exit(const c10::intrusive_ptr<c10d::ProcessGroup>& group);

} // namespace ddp_ext::reducer
