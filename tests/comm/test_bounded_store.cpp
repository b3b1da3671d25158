// Store requests with a deadline (src/comm/bounded_store.h): answered requests pass through,
// the store's own errors come back as they are, and a request that never returns (a store host
// cut off) fails after the deadline, as does every request after it, without the caller or the
// destructor waiting for it. The multi-host tests (tests/multihost) cut a real link.
#include "src/comm/bounded_store.h"

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

// An in-process store whose requests can be held, as a store host that stopped answering.
class StallingStore : public c10d::HashStore {
 public:
  void stall() {
    std::lock_guard<std::mutex> lock(mu_);
    stalled_ = true;
  }
  void release() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stalled_ = false;
    }
    wake_.notify_all();
  }
  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    wait_while_stalled();
    HashStore::set(key, value);
  }
  int64_t add(const std::string& key, int64_t delta) override {
    wait_while_stalled();
    return HashStore::add(key, delta);
  }

 private:
  void wait_while_stalled() {
    std::unique_lock<std::mutex> lock(mu_);
    wake_.wait(lock, [this] { return !stalled_; });
  }
  std::mutex mu_;
  std::condition_variable wake_;
  bool stalled_ = false;
};

TEST(BoundedStore, AnsweredRequestsPassThrough) {
  auto store = c10::make_intrusive<StallingStore>();
  fsdp::comm::BoundedStore bounded(store, milliseconds(5000), "the test store");
  bounded.set("a", bytes("1"));
  EXPECT_TRUE(bounded.check({"a"}));
  EXPECT_FALSE(bounded.check({"b"}));
  EXPECT_EQ(bounded.get("a"), bytes("1"));
  EXPECT_EQ(bounded.add("n", 2), 2);
  EXPECT_EQ(bounded.add("n", 3), 5);
  EXPECT_EQ(bounded.compare_set("c", {}, bytes("x")), bytes("x"));
  EXPECT_EQ(bounded.compare_set("c", {}, bytes("y")), bytes("x"));  // set already: unchanged
  EXPECT_FALSE(bounded.abandoned());
}

TEST(BoundedStore, TheStoresOwnErrorsComeBackAsTheyAre) {
  auto store = c10::make_intrusive<StallingStore>();
  store->setTimeout(milliseconds(50));  // a get of a missing key waits this long, then throws
  fsdp::comm::BoundedStore bounded(store, milliseconds(5000), "the test store");
  try {
    bounded.get("missing");
    FAIL() << "get of a missing key returned";
  } catch (const fsdp::comm::StoreUnreachable& e) {
    FAIL() << "the store's own error was taken for an unreachable store: " << e.what();
  } catch (const std::exception&) {
  }
  EXPECT_FALSE(bounded.abandoned());
  bounded.set("after", bytes("1"));  // the connection is still used
}

TEST(BoundedStore, ARequestThatNeverReturnsFailsAtTheDeadlineAndSoDoEveryLaterOne) {
  auto store = c10::make_intrusive<StallingStore>();
  const milliseconds deadline(300);
  {
    fsdp::comm::BoundedStore bounded(store, deadline, "the agent store at 10.0.0.1:29500");
    bounded.add("n", 1);
    store->stall();
    const auto start = Clock::now();
    try {
      bounded.add("n", 1);
      FAIL() << "a stalled request returned";
    } catch (const fsdp::comm::StoreUnreachable& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("the agent store at 10.0.0.1:29500 did not answer a request (add) within 300 ms"),
                std::string::npos)
          << what;
      EXPECT_NE(what.find("cut off"), std::string::npos) << what;
    }
    const auto waited = Clock::now() - start;
    EXPECT_GE(waited, deadline);
    EXPECT_LT(waited, deadline + milliseconds(5000));
    EXPECT_TRUE(bounded.abandoned());
    // Later requests do not wait again: the connection is abandoned.
    const auto later = Clock::now();
    EXPECT_THROW(bounded.check({"n"}), fsdp::comm::StoreUnreachable);
    EXPECT_LT(Clock::now() - later, milliseconds(100));
  }                  // the destructor returns with the request still stuck
  store->release();  // the thread left behind finishes its request and ends
}

}  // namespace
