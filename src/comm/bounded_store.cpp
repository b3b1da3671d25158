// bounded_store.cpp — the request thread behind bounded_store.h, and the waits with a deadline.
#include "src/comm/bounded_store.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

namespace fsdp {
namespace comm {

// Shared by the object and its request thread, so that a thread left behind in a stuck request
// owns everything it may still touch.
struct BoundedStore::Worker {
  std::mutex call_mu;  // one request at a time; guards `thread` too
  std::mutex mu;       // guards the fields below
  std::condition_variable wake;
  std::deque<std::function<void()>> jobs;
  bool quit = false;
  bool abandoned = false;
  std::thread thread;

  static void loop(const std::shared_ptr<Worker>& self) {
    std::unique_lock<std::mutex> lock(self->mu);
    for (;;) {
      self->wake.wait(lock, [&] { return self->quit || !self->jobs.empty(); });
      if (self->quit) return;
      std::function<void()> job = std::move(self->jobs.front());
      self->jobs.pop_front();
      lock.unlock();
      job();  // a packaged_task: its outcome, exception included, goes to the caller's future
      lock.lock();
    }
  }
};

BoundedStore::BoundedStore(c10::intrusive_ptr<c10d::Store> store, std::chrono::milliseconds deadline, std::string where)
    : store_(std::move(store)), deadline_(deadline), where_(std::move(where)), worker_(std::make_shared<Worker>()) {
  // The thread holds its own reference: it may outlive this object in a stuck request.
  worker_->thread = std::thread([worker = worker_] { Worker::loop(worker); });
}

BoundedStore::~BoundedStore() {
  std::lock_guard<std::mutex> call(worker_->call_mu);
  {
    std::lock_guard<std::mutex> lock(worker_->mu);
    worker_->quit = true;
  }
  worker_->wake.notify_all();
  if (worker_->thread.joinable()) worker_->thread.join();  // idle: it returns at once
}

bool BoundedStore::abandoned() const {
  std::lock_guard<std::mutex> lock(worker_->mu);
  return worker_->abandoned;
}

template <typename R, typename F>
R BoundedStore::run(const char* request, F&& request_fn) {
  std::lock_guard<std::mutex> call(worker_->call_mu);
  const std::string ms = std::to_string(deadline_.count()) + " ms";
  if (abandoned()) {
    throw StoreUnreachable(where_ + " is unreachable: an earlier request got no answer within " + ms +
                           " (this host may be cut off from the store's host: a link or that host down)");
  }
  // The task owns its arguments (captured by value): the caller may be gone when it finishes.
  auto task = std::make_shared<std::packaged_task<R()>>(std::forward<F>(request_fn));
  std::future<R> outcome = task->get_future();
  {
    std::lock_guard<std::mutex> lock(worker_->mu);
    worker_->jobs.emplace_back([task] { (*task)(); });
  }
  worker_->wake.notify_one();
  if (outcome.wait_for(deadline_) != std::future_status::ready) {
    {
      std::lock_guard<std::mutex> lock(worker_->mu);
      worker_->abandoned = true;
      worker_->quit = true;  // ends the thread should the request ever return
    }
    worker_->thread.detach();
    throw StoreUnreachable(where_ + " did not answer a request (" + request + ") within " + ms +
                           ": this host may be cut off from the store's host (a link or that host down); "
                           "the connection is abandoned");
  }
  return outcome.get();
}

void BoundedStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  run<void>("set", [store = store_, key, value] { store->set(key, value); });
}

std::vector<uint8_t> BoundedStore::get(const std::string& key) {
  return run<std::vector<uint8_t>>("get", [store = store_, key] { return store->get(key); });
}

int64_t BoundedStore::add(const std::string& key, int64_t delta) {
  return run<int64_t>("add", [store = store_, key, delta] { return store->add(key, delta); });
}

bool BoundedStore::check(const std::vector<std::string>& keys) {
  return run<bool>("check", [store = store_, keys] { return store->check(keys); });
}

std::vector<uint8_t> BoundedStore::compare_set(const std::string& key, const std::vector<uint8_t>& expected,
                                               const std::vector<uint8_t>& desired) {
  return run<std::vector<uint8_t>>(
      "compare-set", [store = store_, key, expected, desired] { return store->compareSet(key, expected, desired); });
}

}  // namespace comm
}  // namespace fsdp
