// CheckpointManager across real processes: what scan() and is_complete() report for every state
// a root can be left in, pruning that counts only complete checkpoints, a failure to write
// `latest` that every rank learns of at once, and failed saves that leave no temporaries behind
// and are reported one line per rank (by poll() without waiting, for a background save).
#include "harness/multiprocess.h"
#include "file_size_limit.h"

#include <fsdp/checkpoint.h>
#include <fsdp/device_mesh.h>
#include <fsdp/distributed.h>
#include <fsdp/dtensor.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <thread>

namespace fs = std::filesystem;
using fsdp::testing::run_distributed;

namespace {

// A small state dict over the world: a sharded matrix (`rows` rows) and a replicated vector.
fsdp::ShardedStateDict state(int64_t rows = 64) {
  auto mesh = fsdp::init_device_mesh("cpu", {fsdp::get_world_size()});
  fsdp::ShardedStateDict sd;
  sd.insert("w",
            fsdp::distribute_tensor(at::arange(rows * 16, at::kFloat).reshape({rows, 16}), mesh, {fsdp::Shard(0)}));
  sd.insert("v", fsdp::distribute_tensor(at::ones({8}), mesh, {fsdp::Replicate()}));
  return sd;
}

// The test process as a world of one, for the tests that need no other process.
struct WorldOfOne {
  explicit WorldOfOne(const std::string& name) : root(fsdp::testing::shared_temp_path(name)) {
    fs::remove_all(root);
    fsdp::init_process_group();
  }
  ~WorldOfOne() {
    fsdp::destroy_process_group();
    fs::remove_all(root);
  }
  std::string root;
};

void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

bool has_finding(const fsdp::CheckpointManager::Scan& s, const std::string& line) {
  return std::find(s.findings.begin(), s.findings.end(), line) != s.findings.end();
}
std::string all_findings(const fsdp::CheckpointManager::Scan& s) {
  std::string out;
  for (const auto& f : s.findings) out += "\n  " + f;
  return out;
}

// The names of what `dir` holds.
std::set<std::string> names_in(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

}  // namespace

TEST(CheckpointManager, ScanAndIsCompleteReportEveryStateOfTheRoot) {
  WorldOfOne w("mgr_scan");
  const std::string& root = w.root;
  fsdp::CheckpointManager manager(root);
  auto scan = manager.scan();  // no root yet: nothing to report
  EXPECT_FALSE(scan.has_latest_file);
  EXPECT_FALSE(scan.newest_complete.has_value());
  EXPECT_TRUE(scan.findings.empty()) << all_findings(scan);
  for (int64_t step : {10, 20, 30}) manager.save(step, state());
  scan = manager.scan();
  EXPECT_TRUE(scan.has_latest_file);
  EXPECT_EQ(scan.latest_target, "step_30");
  EXPECT_EQ(scan.latest_complete, root + "/step_30");
  EXPECT_EQ(scan.newest_complete, root + "/step_30");
  EXPECT_TRUE(scan.findings.empty()) << all_findings(scan);
  EXPECT_TRUE(fsdp::CheckpointManager::is_complete(root + "/step_30"));

  // The newest save lost its metadata; the one before lost half a data file.
  fs::remove(root + "/step_30/metadata.json");
  fs::resize_file(root + "/step_20/rank_0.data", 12);
  const auto recorded = std::to_string(fs::file_size(root + "/step_10/rank_0.data"));
  scan = manager.scan();
  EXPECT_FALSE(scan.latest_complete.has_value());
  EXPECT_EQ(scan.newest_complete, root + "/step_10");
  EXPECT_TRUE(has_finding(scan, root + "/latest names 'step_30', which has no metadata.json (an incomplete save)"))
      << all_findings(scan);
  EXPECT_TRUE(has_finding(scan, root + "/step_20 is incomplete: " + root +
                                    "/step_20/rank_0.data is 12 bytes, "
                                    "metadata.json says " +
                                    recorded))
      << all_findings(scan);
  EXPECT_EQ(scan.findings.size(), 2u) << all_findings(scan);
  std::string why;
  EXPECT_FALSE(fsdp::CheckpointManager::is_complete(root + "/step_30", &why));
  EXPECT_EQ(why, root + "/step_30 has no metadata.json (an incomplete save)");
  EXPECT_FALSE(fsdp::CheckpointManager::is_complete(root + "/step_20", &why));
  EXPECT_NE(why.find("rank_0.data is 12 bytes"), std::string::npos) << why;
  EXPECT_FALSE(fsdp::CheckpointManager::is_complete(root + "/nowhere", &why));
  EXPECT_EQ(why, root + "/nowhere does not exist");
  write_text(root + "/step_20/metadata.json", "{\"format\": ");
  EXPECT_FALSE(fsdp::CheckpointManager::is_complete(root + "/step_20", &why));
  EXPECT_NE(why.find(root + "/step_20/metadata.json' is not valid JSON"), std::string::npos) << why;
  EXPECT_FALSE(fsdp::CheckpointManager::is_complete(root + "/latest", &why));  // a file, not a directory
  EXPECT_EQ(why, root + "/latest is not a directory");

  // Whatever `latest` holds is a finding, never an exception.
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", root + "/latest is empty"},
      {" \n\t", root + "/latest is empty"},
      // Anything but a step_<N> name may be another file's content: never quoted.
      {"x/../y", root + "/latest does not hold a step_<N> name (6 bytes, not shown)"},
      {"../step_10", root + "/latest does not hold a step_<N> name (10 bytes, not shown)"},
      {std::string("\x01\x02garbage\n", 10), root + "/latest does not hold a step_<N> name (9 bytes, not shown)"},
      {"step_99\n", root + "/latest names 'step_99', which does not exist"},
      {std::string(5000, 's'), root + "/latest cannot be read or is longer than 4096 bytes: it does not name a step "
                                      "directory"},
      // A path to a complete checkpoint, but not a step directory's name.
      {"step_10/../step_10", root + "/latest does not hold a step_<N> name (18 bytes, not shown)"},
      {"step_30", root + "/latest names 'step_30', which has no metadata.json (an incomplete save)"},
      {" step_10\n", ""},
      {"step_10", ""}};
  for (const auto& [content, finding] : cases) {
    write_text(root + "/latest", content);
    scan = manager.scan();
    EXPECT_TRUE(scan.has_latest_file);
    // latest() reads `latest` as scan() does: it names a complete checkpoint exactly when the
    // scan finds `latest_complete`.
    if (finding.empty()) {
      EXPECT_EQ(scan.latest_complete, root + "/step_10");
      EXPECT_EQ(manager.latest(), root + "/step_10") << "latest = '" << content << "'";
    } else {
      EXPECT_FALSE(scan.latest_complete.has_value());
      EXPECT_TRUE(has_finding(scan, finding)) << "latest = '" << content << "':" << all_findings(scan);
      EXPECT_FALSE(manager.latest().has_value()) << "latest = '" << content << "'";
    }
  }
  // `latest` behind the newest complete checkpoint, missing, or not a file.
  manager.save(40, state());
  write_text(root + "/latest", "step_10");
  EXPECT_TRUE(has_finding(manager.scan(), root + "/latest names 'step_10', but " + root +
                                              "/step_40 is newer and "
                                              "complete (saved after `latest` was last written)"))
      << all_findings(manager.scan());
  fs::remove(root + "/latest");
  scan = manager.scan();
  EXPECT_FALSE(scan.has_latest_file);
  EXPECT_EQ(scan.newest_complete, root + "/step_40");
  EXPECT_TRUE(has_finding(scan, root + "/latest is missing; the newest complete checkpoint is " + root + "/step_40"));
  EXPECT_FALSE(manager.latest().has_value());
  // A link is not read, whether it leads to a checkpoint or to a file that is not ours.
  for (const char* target : {"/etc/passwd", "step_40"}) {
    fs::create_symlink(target, root + "/latest");
    scan = manager.scan();
    EXPECT_TRUE(has_finding(scan, root + "/latest is a symbolic link, not the file a save writes; it is not read"))
        << all_findings(scan);
    EXPECT_FALSE(scan.latest_complete.has_value());
    EXPECT_FALSE(manager.latest().has_value());
    EXPECT_EQ(all_findings(scan).find("root:"), std::string::npos) << all_findings(scan);
    fs::remove(root + "/latest");
  }
  fs::create_directory(root + "/latest");
  EXPECT_TRUE(has_finding(manager.scan(), root + "/latest is not a regular file")) << all_findings(manager.scan());
  EXPECT_FALSE(manager.latest().has_value());
  fs::remove(root + "/latest");
  const std::string file_root = root + "/step_40/rank_0.data";
  EXPECT_TRUE(has_finding(fsdp::CheckpointManager(file_root).scan(), file_root + " is not a directory"));
}

TEST(CheckpointManager, PruningCountsOnlyCompleteCheckpoints) {
  WorldOfOne w("mgr_prune");
  const std::string& root = w.root;
  fsdp::CheckpointManager manager(root, /*keep=*/2);
  manager.save(1, state());
  manager.save(2, state());
  fs::remove(root + "/step_2/metadata.json");  // incomplete: not one of the kept
  // Not the manager's: never touched.
  for (const char* other : {"step_x", "step_05", "notes"}) fs::create_directories(root + "/" + other);
  write_text(root + "/step_7", "a file");
  manager.save(3, state());
  EXPECT_EQ(names_in(root),
            (std::set<std::string>{"latest", "notes", "step_05", "step_1", "step_2", "step_3", "step_7", "step_x"}));
  manager.save(4, state());  // keeps 4 and 3; removes 1, and the incomplete 2, older than both
  EXPECT_EQ(names_in(root),
            (std::set<std::string>{"latest", "notes", "step_05", "step_3", "step_4", "step_7", "step_x"}));
  // A save numbered below the newest complete one keeps both: `latest` names the new one.
  fsdp::CheckpointManager one(root, /*keep=*/1);
  one.save(0, state());
  EXPECT_TRUE(fsdp::CheckpointManager::is_complete(root + "/step_4"));
  EXPECT_TRUE(fsdp::CheckpointManager::is_complete(root + "/step_0"));
  EXPECT_FALSE(fs::exists(root + "/step_3"));
  EXPECT_EQ(one.latest(), root + "/step_0");
}

// A DCP checkpoint (fsdp/dcp.h) under the same root looks like an incomplete save of this
// format (no metadata.json) but is another format's: pruning leaves it.
TEST(CheckpointManager, PruningLeavesDcpCheckpointsAlone) {
  WorldOfOne w("mgr_prune_dcp");
  const std::string& root = w.root;
  fs::create_directories(root + "/step_1");
  write_text(root + "/step_1/.metadata", "a DCP checkpoint's metadata");
  fsdp::CheckpointManager manager(root, /*keep=*/1);
  manager.save(2, state());
  manager.save(3, state());  // removes step_2; step_1 is older than every kept one, but DCP's
  EXPECT_EQ(names_in(root), (std::set<std::string>{"latest", "step_1", "step_3"}));
}

// The attributes travel inside metadata.json, with the checkpoint or not at all; a checkpoint
// saved without any (as by builds before them) reads as none.
TEST(CheckpointManager, AttributesAreRecordedInEveryCheckpointSavedAfterThem) {
  WorldOfOne w("mgr_attributes");
  const std::string& root = w.root;
  fsdp::CheckpointManager manager(root);
  manager.save(1, state());
  EXPECT_TRUE(fsdp::CheckpointManager::attributes(root + "/step_1").empty());
  const std::map<std::string, std::string> attrs = {{"app.seed", "1"}, {"app.data", "a \x01 b"}};
  manager.set_attributes(attrs);
  manager.save(2, state());
  manager.save_async(3, state());
  manager.wait();
  EXPECT_EQ(fsdp::CheckpointManager::attributes(root + "/step_2"), attrs);
  EXPECT_EQ(fsdp::CheckpointManager::attributes(root + "/step_3"), attrs);
  EXPECT_TRUE(fsdp::CheckpointManager::is_complete(root + "/step_3"));
  write_text(root + "/step_3/metadata.json", "{\"format\": 1}");
  EXPECT_THROW(fsdp::CheckpointManager::attributes(root + "/step_3"), c10::Error);
}

TEST(CheckpointManager, AFailureToPointLatestFailsEveryRankAtOnce) {
  const std::string root = fsdp::testing::shared_temp_path("mgr_commit");
  if (!fsdp::testing::is_child()) fs::remove_all(root);
  fsdp::testing::DistOptions options;
  options.collective_timeout = std::chrono::milliseconds(30000);
  run_distributed(
      2,
      [root] {
        // `latest` is a directory that is not empty: renaming the new pointer onto it fails.
        if (fsdp::get_rank() == 0) fs::create_directories(root + "/latest/keep");
        fsdp::world()->barrier()->wait();
        fsdp::CheckpointManager manager(root);
        auto expect_fails_fast = [&root](const std::function<void()>& save) {
          const auto start = std::chrono::steady_clock::now();
          try {
            save();
            ADD_FAILURE() << "expected the save to fail";
          } catch (const c10::Error& e) {
            const std::string what = e.what_without_backtrace();
            EXPECT_NE(what.find("while pointing 'latest' at it"), std::string::npos) << what;
            EXPECT_NE(what.find("\n  rank 0: renaming '" + root + "/latest.tmp'"), std::string::npos) << what;
          }
          EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));  // not the 30 s timeout
        };
        expect_fails_fast([&] { manager.save(1, state()); });
        expect_fails_fast([&] {
          manager.save_async(2, state());
          manager.wait();
        });
        EXPECT_FALSE(fs::exists(root + "/latest.tmp"));
        EXPECT_TRUE(fsdp::CheckpointManager::is_complete(root + "/step_2"));  // the checkpoint itself is whole
      },
      options);
  if (!fsdp::testing::is_child()) fs::remove_all(root);
}

namespace {

// The error is a first line naming the phase, then one line per failed rank: no backtrace.
void expect_one_line_per_rank(const std::string& what, const std::string& phase, const std::vector<int>& ranks) {
  std::istringstream lines(what);
  std::string line;
  std::getline(lines, line);
  EXPECT_NE(line.find("fsdp::save_checkpoint failed while " + phase + ":"), std::string::npos) << what;
  for (int r : ranks) {
    ASSERT_TRUE(std::getline(lines, line)) << what;
    EXPECT_EQ(line.rfind("  rank " + std::to_string(r) + ": ", 0), 0u) << what;
    EXPECT_NE(line.find("File too large"), std::string::npos) << what;
  }
  EXPECT_FALSE(std::getline(lines, line)) << "more lines than failed ranks: " << what;
}

// Saves `sd` to `dir` with this rank's files limited to `limit` bytes, expecting `ranks` to fail.
void expect_save_fails(const std::string& dir, const fsdp::ShardedStateDict& sd, rlim_t limit, const std::string& phase,
                       const std::vector<int>& ranks) {
  try {
    fsdp_test::FileSizeLimit full(limit);
    fsdp::save_checkpoint(dir, sd);
    ADD_FAILURE() << "expected the save to fail";
  } catch (const c10::Error& e) {
    expect_one_line_per_rank(e.what_without_backtrace(), phase, ranks);
  }
}

std::vector<std::string> temporaries_in(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& name : names_in(dir)) {
    if (name.size() > 4 && name.substr(name.size() - 4) == ".tmp") out.push_back(name);
  }
  return out;
}

}  // namespace

TEST(CheckpointManager, AFailedSaveLeavesNoTemporariesAndReportsOneLinePerRank) {
  const std::string root = fsdp::testing::shared_temp_path("mgr_failed");
  if (!fsdp::testing::is_child()) fs::remove_all(root);
  run_distributed(2, [root] {
    const int rank = fsdp::get_rank();
    auto sd = state(/*rows=*/256);  // 8 KiB of data per rank
    // Rank 1's disk is full while it writes its data file; rank 0's when it writes the
    // metadata (its data file, the one row and the replicated vector, is smaller than that).
    expect_save_fails(root + "/data", sd, rank == 1 ? 1000 : RLIM_INFINITY, "writing the data files", {1});
    expect_save_fails(root + "/meta", state(/*rows=*/1), rank == 0 ? 200 : RLIM_INFINITY, "writing the metadata", {0});
    fsdp::world()->barrier()->wait();
    EXPECT_EQ(temporaries_in(root + "/data"), std::vector<std::string>());
    EXPECT_EQ(temporaries_in(root + "/meta"), std::vector<std::string>());
    EXPECT_FALSE(fsdp::CheckpointManager::is_complete(root + "/meta"));

    // In the background: poll() reports the failure without waiting, once.
    fsdp::CheckpointManager manager(root + "/async");
    EXPECT_FALSE(manager.poll());  // nothing started
    {
      fsdp_test::FileSizeLimit full(1000);  // every rank
      manager.save_async(1, sd);
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      bool reported = false, running = true;
      while (running && std::chrono::steady_clock::now() < deadline) {
        try {
          running = manager.poll();
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
        } catch (const c10::Error& e) {
          expect_one_line_per_rank(e.what_without_backtrace(), "writing the data files", {0, 1});
          reported = true;
          running = false;
        }
      }
      EXPECT_TRUE(reported);
    }
    EXPECT_FALSE(manager.poll());  // reported once
    EXPECT_NO_THROW(manager.wait());
    fsdp::world()->barrier()->wait();
    EXPECT_EQ(temporaries_in(root + "/async/step_1"), std::vector<std::string>());
    // A good background save after it: poll() says running, then done.
    manager.save_async(2, sd);
    while (manager.poll()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    EXPECT_EQ(manager.latest(), root + "/async/step_2");
  });
  if (!fsdp::testing::is_child()) fs::remove_all(root);
}

TEST(CheckpointManager, ASaveRemovesTheTemporariesAKilledSaveLeft) {
  WorldOfOne w("mgr_stale");
  const std::string dir = w.root + "/ckpt";
  fs::create_directories(dir);
  // Ours: a killed save's data files (of any rank) and metadata. The save itself writes (and
  // renames) rank_0's and the metadata's temporaries, so rank_1's, of a rank this world of one
  // does not have, is what shows that they are removed. Not ours: left alone.
  const std::set<std::string> ours = {"rank_0.data.tmp", "rank_1.data.tmp", "metadata.json.tmp"};
  const std::set<std::string> not_ours = {"notes.tmp", "rank_x.data.tmp", "rank_01.data.tmp", "rank_0.data.tmp.tmp",
                                          ".tmp"};
  for (const auto& name : ours) write_text(dir + "/" + name, "left by a killed save");
  for (const auto& name : not_ours) write_text(dir + "/" + name, "someone else's");
  fsdp::save_checkpoint(dir, state());
  std::set<std::string> expected = {"metadata.json", "rank_0.data"};
  expected.insert(not_ours.begin(), not_ours.end());
  EXPECT_EQ(names_in(dir), expected);
  EXPECT_TRUE(fsdp::CheckpointManager::is_complete(dir));
}
