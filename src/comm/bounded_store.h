// bounded_store.h — store requests that give up after a deadline, for the clients whose caller
// must go on when the store's host can no longer be reached.
//
// c10d's TCPStore client waits for an answer to set, add, check and get in a blocking read
// that its timeout does not bound: when the link to the store's host goes down (a cable, a
// switch, a host gone whole), the request never returns. A rank whose collective timed out
// must still report and exit, and an agent must still stop its workers. So every request of a
// BoundedStore runs on a thread of its own, and the caller waits for it at most `deadline`.
//
// Past the deadline the connection is abandoned: that request and every later one throw
// StoreUnreachable at once (the stuck request still holds the connection, and a TCP stream
// cannot be resumed halfway through a reply). The stuck thread is left behind, detached; it
// owns what it uses, and it ends if the request ever returns.
//
// Thread-safe: requests from several threads run one at a time, in arrival order.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace c10d {
class Store;
}

namespace fsdp {
namespace comm {

// A request got no answer within the deadline, or an earlier one did not: the store's host
// is unreachable from here (or too slow to be waited for).
class StoreUnreachable : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class BoundedStore {
 public:
  // `where` names the store in errors ("the agent store at 10.0.0.1:29500"). `store` must not
  // be used by anyone else while this object lives.
  BoundedStore(c10::intrusive_ptr<c10d::Store> store, std::chrono::milliseconds deadline, std::string where);
  // Returns at once: an idle request thread is stopped and joined, a stuck one left behind.
  ~BoundedStore();
  BoundedStore(const BoundedStore&) = delete;
  BoundedStore& operator=(const BoundedStore&) = delete;

  // c10d::Store's requests, each bounded by the deadline. Each throws StoreUnreachable past
  // it, and what the store throws otherwise (c10::Error, std::runtime_error).
  void set(const std::string& key, const std::vector<uint8_t>& value);
  std::vector<uint8_t> get(const std::string& key);  // the key must exist (check first)
  int64_t add(const std::string& key, int64_t delta);
  bool check(const std::vector<std::string>& keys);
  // Sets `key` to `desired` if it holds `expected` (empty: if it is unset); returns its value.
  std::vector<uint8_t> compare_set(const std::string& key, const std::vector<uint8_t>& expected,
                                   const std::vector<uint8_t>& desired);

  // True once a request went unanswered past the deadline.
  bool abandoned() const;
  std::chrono::milliseconds deadline() const { return deadline_; }

 private:
  struct Worker;
  template <typename R, typename F>
  R run(const char* request, F&& request_fn);

  c10::intrusive_ptr<c10d::Store> store_;
  const std::chrono::milliseconds deadline_;
  const std::string where_;
  std::shared_ptr<Worker> worker_;
};

}  // namespace comm
}  // namespace fsdp
