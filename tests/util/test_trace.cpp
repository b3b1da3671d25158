// fsdp::trace: spans are recorded only while recording, from any thread, and written in the
// Chrome trace event format.
#include <fsdp/trace.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <thread>

namespace {

nlohmann::json written(int pid) {
  const std::string path = testing::TempDir() + "/trace_test.json";
  fsdp::trace::write_chrome_trace(path, pid);
  std::ifstream in(path);
  nlohmann::json j = nlohmann::json::parse(std::string(std::istreambuf_iterator<char>(in), {}));
  std::remove(path.c_str());
  return j;
}

std::map<std::string, nlohmann::json> spans_by_name(const nlohmann::json& doc) {
  std::map<std::string, nlohmann::json> spans;
  for (const auto& e : doc.at("traceEvents"))
    if (e.at("ph") == "X") spans[e.at("name")] = e;
  return spans;
}

TEST(Trace, RecordsSpansOnlyWhileStarted) {
  { fsdp::trace::Span before("compute", "before"); }
  fsdp::trace::start();
  EXPECT_TRUE(fsdp::trace::enabled());
  fsdp::trace::set_thread_name("main");
  { fsdp::trace::Span s("compute", "forward"); }
  std::thread([] {
    fsdp::trace::set_thread_name("worker");
    const auto t = fsdp::trace::Clock::now();
    fsdp::trace::record("comm", "all_gather #0", t, t + std::chrono::microseconds(5), "{\"bytes\": 64}");
    fsdp::trace::record("comm", "odd args", t, t, "not json");
  }).join();
  fsdp::trace::stop();
  { fsdp::trace::Span after("compute", "after"); }

  const auto doc = written(3);
  const auto spans = spans_by_name(doc);
  EXPECT_EQ(spans.size(), 3u);
  EXPECT_FALSE(spans.count("before"));
  EXPECT_FALSE(spans.count("after"));
  ASSERT_TRUE(spans.count("forward"));
  ASSERT_TRUE(spans.count("all_gather #0"));
  EXPECT_EQ(spans.at("forward").at("pid"), 3);
  EXPECT_NE(spans.at("forward").at("tid"), spans.at("all_gather #0").at("tid"));
  EXPECT_NEAR(spans.at("all_gather #0").at("dur").get<double>(), 5.0, 1e-6);
  EXPECT_EQ(spans.at("all_gather #0").at("args").at("bytes"), 64);
  EXPECT_EQ(spans.at("odd args").at("args").at("text"), "not json");
  std::map<std::string, int> thread_names;
  for (const auto& e : doc.at("traceEvents"))
    if (e.at("ph") == "M" && e.at("name") == "thread_name") thread_names[e.at("args").at("name")]++;
  EXPECT_EQ(thread_names["main"], 1);
  EXPECT_EQ(thread_names["worker"], 1);
}

TEST(Trace, DropsEventsPastTheLimitAndSaysSo) {
  fsdp::trace::start(/*max_events=*/2);
  for (int i = 0; i < 5; ++i) fsdp::trace::Span s("compute", "span " + std::to_string(i));
  fsdp::trace::stop();
  const auto doc = written(0);
  EXPECT_EQ(spans_by_name(doc).size(), 2u);
  EXPECT_EQ(doc.at("otherData").at("dropped_events"), 3);
}

}  // namespace
