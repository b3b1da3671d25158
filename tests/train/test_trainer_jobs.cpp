// End-to-end tests of fsdp-train when two jobs meet in one fsdp_config.checkpoint_dir: a second
// live job is refused naming the first, a lock left by a killed job blocks nothing, and
// training.resume: auto refuses a checkpoint written under another model, seed or data, while a
// checkpoint that records no identity (an older fsdp-train's) still resumes. Real processes.
#include "process_harness.h"
#include "trainer_runs.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <string>
#include <vector>

#include <signal.h>
#include <unistd.h>

using namespace process_test;
using namespace trainer_test;
namespace fs = std::filesystem;

namespace {

std::string hostname() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  return host;
}

// The defect: both jobs trained, each named the other's checkpoints as its own and pruned them.
TEST(TrainerJobs, ASecondLiveJobInTheSameCheckpointDirIsRefusedAndAKilledJobsLockBlocksNothing) {
  TempDir dir;
  Process first = fsdprun.start(under_fsdprun(2, base_args(dir.path(), 100000)));
  // By step 12 the step-5 checkpoint is complete (the step-10 save waited for it).
  ASSERT_TRUE(wait_for_step(dir / "m0.jsonl", 12));
  const std::vector<pid_t> ranks = children_of(first.pid());
  ASSERT_EQ(ranks.size(), 2u);

  RunResult second = trainer.run(with(base_args(dir.path(), 10), {"--logging.jsonl=" + dir / "second.jsonl"}), {}, 60);
  EXPECT_EQ(second.exit_code, 2) << describe(second);
  EXPECT_TRUE(contains(second, "fsdp_config.checkpoint_dir: " + dir / "ckpt" + " is in use by another fsdp-train job"))
      << describe(second);
  EXPECT_TRUE(contains(second, "host " + hostname() + ", pid " + std::to_string(ranks[0])) ||
              contains(second, "host " + hostname() + ", pid " + std::to_string(ranks[1])))
      << describe(second);
  EXPECT_TRUE(contains(second, "Give this job its own fsdp_config.checkpoint_dir")) << describe(second);
  EXPECT_FALSE(fs::exists(dir / "second.jsonl")) << "the refused job trained";

  for (pid_t p : ranks) kill(p, SIGKILL);  // no chance to release anything
  first.wait(60);
  ASSERT_TRUE(fs::exists(dir / "ckpt/.fsdp-train.lock"));
  const int64_t reached = last_step_in(dir / "m0.jsonl");
  RunResult third = trainer.run(with(base_args(dir.path(), static_cast<int>(reached) + 2), {}), {}, 120);
  ASSERT_EQ(third.exit_code, 0) << describe(third);
  EXPECT_TRUE(contains(third, "resumed from " + dir / "ckpt/step_")) << describe(third);
}

// Five steps with seed 0 and a checkpoint at step 5, in dir/ckpt.
void five_steps(const TempDir& dir) {
  RunResult r = trainer.run(base_args(dir.path(), 5), {}, 120);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  ASSERT_TRUE(fs::exists(dir / "ckpt/step_5/metadata.json"));
}

TEST(TrainerJobs, ResumeAutoUnderAnotherSeedOrModelIsRefusedNamingWhatDiffers) {
  TempDir dir;
  five_steps(dir);
  RunResult seed = trainer.run(with(base_args(dir.path(), 8), {"--training.seed=2"}), {}, 60);
  EXPECT_EQ(seed.exit_code, 2) << describe(seed);
  EXPECT_TRUE(contains(seed, "checkpoint step_5 was written with training.seed 0, this config has training.seed 2"))
      << describe(seed);
  EXPECT_TRUE(contains(seed, "training.allow_resume_mismatch: true")) << describe(seed);
  EXPECT_EQ(last_step_in(dir / "m0.jsonl"), 5) << "the refused run trained";

  RunResult data = trainer.run(with(base_args(dir.path(), 8), {"--data.data_seed=7"}), {}, 60);
  EXPECT_EQ(data.exit_code, 2) << describe(data);
  EXPECT_TRUE(contains(data, "with data.data_seed 1234, this config has data.data_seed 7")) << describe(data);

  RunResult anyway = trainer.run(
      with(base_args(dir.path(), 8), {"--training.seed=2", "--training.allow_resume_mismatch=true"}), {}, 120);
  ASSERT_EQ(anyway.exit_code, 0) << describe(anyway);
  EXPECT_TRUE(contains(anyway, "resumed from " + dir / "ckpt/step_5 at step 5")) << describe(anyway);
}

// Checkpoints written before the identity was recorded have no "attributes" in metadata.json.
TEST(TrainerJobs, ACheckpointWithoutARecordedIdentityStillResumes) {
  TempDir dir;
  five_steps(dir);
  const std::string meta_path = dir / "ckpt/step_5/metadata.json";
  nlohmann::json meta = nlohmann::json::parse(read_file(meta_path));
  ASSERT_TRUE(meta.contains("attributes"));
  meta.erase("attributes");
  write_text(meta_path, meta.dump(1));
  RunResult r = trainer.run(with(base_args(dir.path(), 7), {"--training.seed=2"}), {}, 120);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_TRUE(contains(r, "resumed from " + dir / "ckpt/step_5 at step 5")) << describe(r);
}

}  // namespace
