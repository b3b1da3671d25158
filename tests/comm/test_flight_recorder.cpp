// The flight recorder: the ring (wraparound, states, context), its JSON, and the dumps written
// by a real collective timeout and by SIGUSR1, with real processes.
#include "harness/multiprocess.h"

#include <fsdp/distributed.h>
#include <fsdp/flight_recorder.h>
#include <fsdp/process_group.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <unistd.h>

namespace {

using fsdp::FlightRecorder;
using fsdp::FlightState;
using fsdp::testing::run_distributed;

// The global recorder, emptied and sized for one test (the process's groups stay registered).
FlightRecorder& fresh_recorder(int64_t capacity) {
  FlightRecorder& r = FlightRecorder::global();
  r.set_capacity(capacity);
  r.set_context("", "");
  return r;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(FlightRecorder, KeepsTheLastCapacityRecordsOldestFirst) {
  FlightRecorder& r = fresh_recorder(4);
  for (int64_t seq = 0; seq < 10; ++seq) r.enqueued("g", "all_gather", seq, 100 + seq, "Float");
  int64_t total = 0;
  const auto records = r.snapshot(&total);
  EXPECT_EQ(total, 10);
  ASSERT_EQ(records.size(), 4u);
  for (int64_t i = 0; i < 4; ++i) {
    EXPECT_EQ(records[i].id, 6 + i);
    EXPECT_EQ(records[i].seq, 6 + i);
    EXPECT_EQ(records[i].bytes, 106 + i);
    EXPECT_EQ(records[i].state, FlightState::kEnqueued);
  }
  // An op whose record was overwritten finishes without touching the newer records.
  r.finished("g", 2, true);
  for (const auto& rec : r.snapshot()) EXPECT_EQ(rec.state, FlightState::kEnqueued);
}

TEST(FlightRecorder, RecordsEachOpsStatesTimesAndContext) {
  FlightRecorder& r = fresh_recorder(8);
  r.set_context("forward", "blocks.3");
  r.enqueued("dp", "all_gather", 57, 4096, "BFloat16");
  r.set_context("backward", "blocks.2");
  r.enqueued("dp", "reduce_scatter", 58, 8192, "Float");
  r.enqueued("tp", "all_reduce", 58, 4, "Float");  // same seq, another group: told apart
  r.started("dp", 57);
  r.finished("dp", 57, true);
  r.started("dp", 58);
  r.finished("dp", 58, false);
  const auto recs = r.snapshot();
  ASSERT_EQ(recs.size(), 3u);
  EXPECT_EQ(recs[0].op, "all_gather");
  EXPECT_EQ(recs[0].group, "dp");
  EXPECT_EQ(recs[0].dtype, "BFloat16");
  EXPECT_EQ(recs[0].state, FlightState::kCompleted);
  EXPECT_EQ(recs[0].phase, "forward");
  EXPECT_EQ(recs[0].module, "blocks.3");
  EXPECT_GT(recs[0].enqueued_us, 0);
  EXPECT_GE(recs[0].started_us, recs[0].enqueued_us);
  EXPECT_GE(recs[0].finished_us, recs[0].started_us);
  EXPECT_EQ(recs[1].state, FlightState::kFailed);
  EXPECT_EQ(recs[1].phase, "backward");
  EXPECT_EQ(recs[1].module, "blocks.2");
  EXPECT_EQ(recs[2].state, FlightState::kEnqueued);
  EXPECT_EQ(recs[2].started_us, 0);
  EXPECT_EQ(recs[2].finished_us, 0);
}

TEST(FlightRecorder, JsonHasEveryFieldAndEscapesText) {
  FlightRecorder& r = fresh_recorder(3);
  r.register_group("g\"quoted\"", {0, 1});
  r.set_context("backward", "layers.1\nodd");
  for (int64_t seq = 0; seq < 5; ++seq)
    r.enqueued("g\"quoted\"", seq % 2 ? "reduce_scatter" : "all_gather", seq, 64, "Float");
  r.started("g\"quoted\"", 4);
  const auto j = nlohmann::json::parse(r.to_json("a \"test\" reason"));
  EXPECT_EQ(j["version"], 1);
  EXPECT_EQ(j["reason"], "a \"test\" reason");
  EXPECT_EQ(j["pid"], getpid());
  EXPECT_EQ(j["capacity"], 3);
  EXPECT_EQ(j["total_recorded"], 5);
  EXPECT_EQ(j["last_seen"]["phase"], "backward");
  EXPECT_EQ(j["last_seen"]["module"], "layers.1\nodd");
  bool found = false;
  for (const auto& g : j["groups"]) {
    if (g["name"] == "g\"quoted\"") {
      found = true;
      EXPECT_EQ(g["ranks"], nlohmann::json::array({0, 1}));
    }
  }
  EXPECT_TRUE(found);
  ASSERT_EQ(j["entries"].size(), 3u);  // wrapped: seq 2, 3, 4
  const auto& last = j["entries"][2];
  EXPECT_EQ(last["seq"], 4);
  EXPECT_EQ(last["op"], "all_gather");
  EXPECT_EQ(last["state"], "started");
  EXPECT_EQ(last["bytes"], 64);
  EXPECT_EQ(last["dtype"], "Float");
  EXPECT_EQ(last["finished_us"], 0);
  EXPECT_EQ(last["module"], "layers.1\nodd");
  for (const char* key : {"id", "group", "enqueued_us", "started_us", "phase"}) EXPECT_TRUE(last.contains(key)) << key;
  EXPECT_EQ(nlohmann::json::parse(fresh_recorder(2).to_json(""))["entries"].size(), 0u);
}

TEST(FlightRecorder, ADumpWithoutADirectoryWritesNothing) {
  if (FlightRecorder::global().dumps_enabled()) GTEST_SKIP() << "dumps enabled by the environment";
  EXPECT_EQ(FlightRecorder::global().dump("nothing"), "");
}

// Rank 1 skips the all-gather; rank 0 times out, and its dump is on disk at once (written by the
// failure, before the program does anything else), naming the op as failed. Then rank 1 dumps
// on SIGUSR1 and goes on.
TEST(FlightRecorder, ATimeoutAndSigusr1WriteDumpsWithTheCollectives) {
  const std::string dir = fsdp::testing::shared_temp_path("flight_dumps");
  if (!fsdp::testing::is_child()) {
    std::filesystem::remove_all(dir);
  }
  fsdp::testing::DistOptions opts;
  opts.collective_timeout = std::chrono::milliseconds(1500);
  opts.env["FSDP_FLIGHT_RECORDER_DIR"] = dir;
  run_distributed(
      2,
      [dir] {
        auto pg = fsdp::world();
        pg->barrier()->wait();  // #0
        const std::string mine = dir + "/rank_" + std::to_string(pg->rank()) + ".json";
        if (pg->rank() == 1) {
          std::this_thread::sleep_for(std::chrono::milliseconds(3000));  // never joins #1
          EXPECT_EQ(kill(getpid(), SIGUSR1), 0);
          for (int i = 0; i < 500 && !std::filesystem::exists(mine); ++i)
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
          const auto j = nlohmann::json::parse(read_text(mine));
          EXPECT_EQ(j["reason"], "signal SIGUSR1");
          EXPECT_EQ(j["rank"], 1);
          EXPECT_EQ(j["entries"].back()["op"], "barrier");
          EXPECT_EQ(j["entries"].back()["state"], "completed");
          return;  // still running: SIGUSR1 did not stop it
        }
        at::Tensor out = at::empty({8});
        EXPECT_THROW(pg->all_gather_into(out, at::ones({4}))->wait(), fsdp::CollectiveError);
        ASSERT_TRUE(std::filesystem::exists(mine));
        const auto j = nlohmann::json::parse(read_text(mine));
        EXPECT_EQ(j["rank"], 0);
        EXPECT_NE(j["reason"].get<std::string>().find("collective failed: fsdp: all_gather #1"), std::string::npos)
            << j["reason"];
        EXPECT_NE(j["first_failure"].get<std::string>().find("timed out"), std::string::npos);
        const auto& last = j["entries"].back();
        EXPECT_EQ(last["op"], "all_gather");
        EXPECT_EQ(last["group"], "world");
        EXPECT_EQ(last["seq"], 1);
        EXPECT_EQ(last["state"], "failed");
        EXPECT_EQ(last["bytes"], 32);
        std::this_thread::sleep_for(std::chrono::milliseconds(2500));  // let rank 1 finish first
      },
      opts);
  if (!fsdp::testing::is_child()) std::filesystem::remove_all(dir);
}

}  // namespace
