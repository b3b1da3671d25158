// bench_flight_recorder — what the always-on flight recorder costs per collective: the three
// records the process-group layer writes for each one (enqueued, started, finished), on one
// thread and with a second thread recording at the same time (a training thread and a group's
// communication thread share the recorder's lock), and what an FSDP hook's set_context costs.
//
//   bench_flight_recorder [--ops N]
//
// Multiply by a step's collectives (bench_fsdp overlap prints them) and divide by its time for
// the recorder's share of a step.
#include <fsdp/flight_recorder.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

// Records `ops` collectives on `group`; returns nanoseconds per collective.
double record_ops(const std::string& group, int64_t ops, int64_t first_seq) {
  fsdp::FlightRecorder& r = fsdp::FlightRecorder::global();
  const auto start = Clock::now();
  for (int64_t i = 0; i < ops; ++i) {
    r.enqueued(group, "all_gather", first_seq + i, 1 << 20, "Float");
    r.started(group, first_seq + i);
    r.finished(group, first_seq + i, true);
  }
  return std::chrono::duration<double, std::nano>(Clock::now() - start).count() / static_cast<double>(ops);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int64_t ops = 200000;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--ops")) ops = std::atoll(argv[i + 1]);
  }
  fsdp::FlightRecorder::global().set_context("forward", "blocks.3");
  std::vector<double> alone, contended;
  for (int round = 0; round < 5; ++round) {
    alone.push_back(record_ops("g0[0,1]", ops, round * ops));
    double other = 0;
    std::thread t([&] { other = record_ops("g1[0,1]", ops, round * ops); });
    contended.push_back(record_ops("g0[0,1]", ops, (round + 5) * ops));
    t.join();
    contended.push_back(other);
  }
  std::vector<double> context;
  const std::string module = "blocks.3";
  for (int round = 0; round < 5; ++round) {
    const auto start = Clock::now();
    for (int64_t i = 0; i < ops; ++i)
      fsdp::FlightRecorder::global().set_context(i % 2 ? "forward" : "backward", module);
    context.push_back(std::chrono::duration<double, std::nano>(Clock::now() - start).count() /
                      static_cast<double>(ops));
  }
  std::printf("bench_flight_recorder: %lld collectives per round, capacity %lld, 5 rounds\n",
              static_cast<long long>(ops), static_cast<long long>(fsdp::FlightRecorder::global().capacity()));
  std::printf("  one thread recording:   median %.0f ns per collective (enqueued + started + finished)\n",
              median(alone));
  std::printf("  two threads recording:  median %.0f ns per collective\n", median(contended));
  std::printf("  set_context (an FSDP hook's label): median %.0f ns\n", median(context));
  return 0;
}
