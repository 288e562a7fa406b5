#include "process_groups/exit_release.h"

#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

namespace ddp_ext {

namespace {

struct Release {
  std::mutex mutex;
  std::condition_variable done_cv;
  bool done = false;
};

} // namespace

bool release_process_groups(
    std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups,
    std::chrono::milliseconds timeout) {
  auto release = std::make_shared<Release>();
  std::thread releaser([release, groups = std::move(groups)]() mutable {
    for (auto& group : groups) {
      group->release_resources();
    }
    groups.clear();
    {
      std::lock_guard<std::mutex> lock(release->mutex);
      release->done = true;
    }
    release->done_cv.notify_all();
  });
  bool finished;
  {
    std::unique_lock<std::mutex> lock(release->mutex);
    finished = release->done_cv.wait_for(lock, timeout, [&] { return release->done; });
  }
  if (finished) {
    releaser.join();
  } else {
    releaser.detach(); // it owns what it touches (the groups, `release`)
  }
  return finished;
}

} // namespace ddp_ext
