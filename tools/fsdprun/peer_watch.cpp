#include "peer_watch.h"

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fcntl.h>
#include <stdexcept>
#include <unistd.h>
#include <utility>

namespace fsdprun {

PeerWatch::PeerWatch(AgentStore& store, int attempt, double interval_s)
    : store_(store), attempt_(attempt), interval_s_(interval_s) {
  if (pipe2(pipe_, O_CLOEXEC | O_NONBLOCK) != 0)
    throw std::runtime_error(std::string("pipe2: ") + std::strerror(errno));
  thread_ = std::thread([this] { loop(); });
}

PeerWatch::~PeerWatch() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    quit_ = true;
  }
  wake_.notify_all();
  thread_.join();
  for (int fd : pipe_) close(fd);
}

std::optional<PeerNews> PeerWatch::take_news() {
  std::lock_guard<std::mutex> lock(mu_);
  char byte;
  while (read(pipe_[0], &byte, 1) == 1) {
  }
  return std::exchange(news_, std::nullopt);
}

void PeerWatch::report_failure(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_ || !report_.empty()) return;
    report_ = why;
  }
  wake_.notify_all();
}

void PeerWatch::publish(PeerNews news) {
  done_ = true;
  news_ = std::move(news);
  const char byte = 1;
  ssize_t ignored = write(pipe_[1], &byte, 1);
  (void)ignored;
}

std::optional<PeerNews> PeerWatch::ask_store(const std::string& report) {
  try {
    if (!report.empty()) {
      store_.mark_failed(attempt_, report);
    } else if (auto why = store_.failure(attempt_)) {
      return PeerNews{*why, false};
    }
  } catch (const std::exception& e) {
    return PeerNews{e.what(), true};
  }
  return std::nullopt;
}

// One store request per round, made without holding mu_, so that the agent's thread
// never waits for the store through this class either. A pending report is made even
// when quitting: the other nodes must hear of this node's failure.
void PeerWatch::loop() {
  const auto interval = std::chrono::duration<double>(interval_s_);
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (done_) {  // nothing left to do but wait for the end
      wake_.wait(lock, [this] { return quit_; });
      return;
    }
    wake_.wait_for(lock, interval, [this] { return quit_ || !report_.empty(); });
    const std::string report = std::exchange(report_, "");
    if (quit_ && report.empty()) return;
    lock.unlock();
    std::optional<PeerNews> news = ask_store(report);
    lock.lock();
    if (!report.empty()) done_ = true;
    if (news) publish(std::move(*news));
  }
}

}  // namespace fsdprun
