#include "reducer/core/unpaired_collectives.h"

#include <mutex>
#include <vector>

namespace ddp_ext::reducer {

void UnpairedCollectives::dropping(const c10::intrusive_ptr<c10d::Work>& work) {
  if (work && !work->isCompleted()) {
    any_ = true;
  }
}

void UnpairedCollectives::dropping(const c10::intrusive_ptr<c10::ivalue::Future>& future) {
  if (future && !future->completed()) {
    any_ = true;
  }
}

void UnpairedCollectives::keep_group_if_any(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  if (any_ && group) {
    keep_until_exit(group);
  }
  any_ = false;
}

void keep_until_exit(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  // Leaked on purpose (Note [Collectives left without a partner]): no
  // destructor of these groups may run, not even at exit.
  static auto* mutex = new std::mutex();
  static auto* kept = new std::vector<c10::intrusive_ptr<c10d::ProcessGroup>>();
  const std::lock_guard<std::mutex> guard(*mutex);
  for (const auto& held : *kept) {
    if (held == group) {
      return;
    }
  }
  kept->push_back(group);
}

} // namespace ddp_ext::reducer
