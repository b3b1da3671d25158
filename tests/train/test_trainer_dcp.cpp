// fsdp-train with fsdp_config.checkpoint_format: dcp: checkpoints in PyTorch's DCP layout
// (fsdp/dcp.h) that resume at another world size with the losses of an uninterrupted run, and
// training.resume: auto choosing the newest complete one. Real ranks on loopback.
#include "process_harness.h"
#include "trainer_runs.h"

#include "../python_path.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>

using namespace process_test;
using namespace trainer_test;

namespace {

constexpr int kSteps = 20;

std::vector<std::string> dcp_args(const std::string& dir, int steps) {
  return with(base_args(dir, steps), {"--fsdp_config.checkpoint_format=dcp"});
}

}  // namespace

// Saved at W=2 (B=4 per rank), resumed at W=1 (B=8): the same global batch, so the continued
// losses match the W=2 run up to the order of floating-point sums.
TEST(TrainerDcp, SavedAtTwoRanksResumesAtOneWithTheLossesOfAnUninterruptedRun) {
  TempDir dir;
  const RunResult whole = fsdprun.run(under_fsdprun(2, dcp_args(dir / "whole", kSteps)), {}, 180);
  ASSERT_EQ(whole.exit_code, 0) << describe(whole);
  const std::string ckpt = dir / "whole/ckpt/step_10";
  EXPECT_TRUE(std::filesystem::exists(ckpt + "/.metadata"));
  EXPECT_TRUE(std::filesystem::exists(ckpt + "/__0_0.distcp") && std::filesystem::exists(ckpt + "/__1_0.distcp"));
  EXPECT_FALSE(std::filesystem::exists(ckpt + "/metadata.json"));  // the other format's
  const auto want = read_metrics(dir / "whole/m0.jsonl");

  const RunResult resumed = fsdprun.run(
      under_fsdprun(
          1, with(dcp_args(dir / "resumed", kSteps), {"--training.micro_batch_size=8", "--training.resume=" + ckpt})),
      {}, 180);
  ASSERT_EQ(resumed.exit_code, 0) << describe(resumed);
  EXPECT_NE(resumed.out.find("resumed from " + ckpt + " at step 10"), std::string::npos) << resumed.out;
  const auto got = read_metrics(dir / "resumed/m0.jsonl");
  ASSERT_EQ(got.size(), static_cast<size_t>(kSteps - 10));
  for (const auto& [step, m] : got) {
    EXPECT_NEAR(m.loss, want.at(step).loss, 1e-5 * std::abs(want.at(step).loss)) << "step " << step;
  }
}

// training.resume: auto (tiny.yaml's) takes the newest complete DCP checkpoint; one whose
// .metadata is gone (an interrupted save) is passed over.
TEST(TrainerDcp, ResumeAutoTakesTheNewestCompleteDcpCheckpoint) {
  TempDir dir;
  const RunResult first = fsdprun.run(under_fsdprun(2, dcp_args(dir.path(), 15)), {}, 180);
  ASSERT_EQ(first.exit_code, 0) << describe(first);
  std::filesystem::remove(dir / "ckpt/step_15/.metadata");
  const RunResult again = fsdprun.run(under_fsdprun(2, dcp_args(dir.path(), kSteps)), {}, 180);
  ASSERT_EQ(again.exit_code, 0) << describe(again);
  EXPECT_NE(again.out.find("resumed from " + dir / "ckpt/step_10" + " at step 10"), std::string::npos) << again.out;
  EXPECT_NE(again.out.find("resume: found " + dir / "ckpt/step_15" +
                           ", which holds neither .metadata nor metadata.json (an interrupted save): passed over"),
            std::string::npos)
      << again.out;
}

// A DCP checkpoint written by Python: fsdp-train's step_10, read back by Python's own DCP reader
// (no model needed: dcp_to_torch_save rebuilds the nesting) and saved again with a plain
// dcp.save (its pickle, its torch.save items), resumes with the losses of the uninterrupted run.
TEST(TrainerDcp, ResumesFromACheckpointPythonSaved) {
  FSDP_SKIP_WITHOUT_PYTHON();
  TempDir dir;
  const RunResult whole = fsdprun.run(under_fsdprun(2, dcp_args(dir / "whole", kSteps)), {}, 180);
  ASSERT_EQ(whole.exit_code, 0) << describe(whole);
  write_text(dir / "resave.py",
             "import sys, torch, torch.distributed.checkpoint as dcp\n"
             "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
             "dcp_to_torch_save(sys.argv[1], sys.argv[2] + '.pt')\n"
             "sd = torch.load(sys.argv[2] + '.pt', weights_only=False)\n"
             "assert set(sd) == {'model', 'optimizer', 'train_state'}, sorted(sd)\n"
             "assert int(sd['train_state']['step']) == 10\n"
             "dcp.save(sd, checkpoint_id=sys.argv[2])\n");
  ASSERT_EQ(run_python(dir / "resave.py", {dir / "whole/ckpt/step_10", dir / "py_ckpt"}), 0);
  const std::string py_ckpt = dir / "py_ckpt";
  const RunResult resumed =
      fsdprun.run(under_fsdprun(1, with(base_args(dir / "resumed", kSteps),
                                        {"--training.micro_batch_size=8", "--training.resume=" + py_ckpt})),
                  {}, 180);
  ASSERT_EQ(resumed.exit_code, 0) << describe(resumed);
  EXPECT_NE(resumed.out.find("resumed from " + py_ckpt + " at step 10"), std::string::npos) << resumed.out;
  const auto want = read_metrics(dir / "whole/m0.jsonl");
  const auto got = read_metrics(dir / "resumed/m0.jsonl");
  ASSERT_EQ(got.size(), static_cast<size_t>(kSteps - 10));
  for (const auto& [step, m] : got) {
    EXPECT_NEAR(m.loss, want.at(step).loss, 1e-5 * std::abs(want.at(step).loss)) << "step " << step;
  }
}
