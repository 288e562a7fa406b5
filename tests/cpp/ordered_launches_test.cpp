// OrderedLaunches (process_groups/ordered_launches.h): launches run in ticket
// order whatever order, and whichever threads, they become ready on.
#include <gtest/gtest.h>

#include <algorithm>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include <c10/util/Exception.h>

#include "process_groups/ordered_launches.h"

namespace ddp_ext {
namespace {

TEST(OrderedLaunches, ALaunchWaitsForEveryEarlierTicket) {
  OrderedLaunches launches;
  std::vector<int> ran;
  const auto first = launches.take();
  const auto second = launches.take();
  const auto third = launches.take();
  launches.ready(third, [&] { ran.push_back(3); });
  launches.ready(second, [&] { ran.push_back(2); });
  EXPECT_TRUE(ran.empty()) << "ran before the first ticket was ready";
  EXPECT_EQ(launches.pending(), 3u);
  launches.ready(first, [&] { ran.push_back(1); });
  EXPECT_EQ(ran, (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(launches.pending(), 0u);
}

TEST(OrderedLaunches, AReadyTicketInOrderRunsAtOnce) {
  OrderedLaunches launches;
  int ran = 0;
  launches.ready(launches.take(), [&] { ++ran; });
  EXPECT_EQ(ran, 1);
  EXPECT_EQ(launches.pending(), 0u);
}

TEST(OrderedLaunches, RefusesATicketThatIsNotWaiting) {
  OrderedLaunches launches;
  const auto ticket = launches.take();
  launches.ready(ticket, [] {});
  EXPECT_THROW(launches.ready(ticket, [] {}), c10::Error) << "a ticket launched twice";
  EXPECT_THROW(launches.ready(ticket + 1, [] {}), c10::Error) << "a ticket never taken";
}

TEST(OrderedLaunches, ShuffledReadiesFromManyThreadsRunInTicketOrder) {
  for (int trial = 0; trial < 20; ++trial) {
    OrderedLaunches launches;
    constexpr size_t kTickets = 64;
    std::vector<OrderedLaunches::Ticket> tickets;
    for (size_t i = 0; i < kTickets; ++i) {
      tickets.push_back(launches.take());
    }
    std::vector<size_t> order(kTickets);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), std::mt19937(trial));
    std::vector<size_t> ran; // appended to only by launches, which run one at a time
    std::vector<std::thread> threads;
    constexpr size_t kThreads = 4;
    for (size_t t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        for (size_t k = t; k < kTickets; k += kThreads) {
          const size_t i = order[k];
          launches.ready(tickets[i], [&ran, i] { ran.push_back(i); });
        }
      });
    }
    for (auto& thread : threads) {
      thread.join();
    }
    std::vector<size_t> expected(kTickets);
    std::iota(expected.begin(), expected.end(), 0);
    EXPECT_EQ(ran, expected) << "trial " << trial;
    EXPECT_EQ(launches.pending(), 0u);
  }
}

} // namespace
} // namespace ddp_ext
