// The trainer's per-step decisions (tools/fsdp-train/run/step_control.h), from gathered numbers
// written by hand: what every rank decides, without processes.
#include "run/step_control.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

namespace fsdp {
namespace train {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

std::vector<double> gathered(const std::vector<StepBallot>& ballots) {
  std::vector<double> all;
  for (const StepBallot& b : ballots) {
    const std::vector<double> mine = ballot_numbers(b);
    all.insert(all.end(), mine.begin(), mine.end());
  }
  return all;
}

TEST(StepControl, AllFiniteStepsApplyWithTheMeanLossAndRankZerosNorm) {
  const StepVotes v =
      tally_votes(gathered({{2.0, 0.5, false, false}, {4.0, 0.5, false, false}, {6.0, 0.5, false, false}}), 3);
  EXPECT_DOUBLE_EQ(v.loss, 4.0);
  EXPECT_DOUBLE_EQ(v.grad_norm, 0.5);
  EXPECT_EQ(v.local_losses, (std::vector<double>{2.0, 4.0, 6.0}));
  EXPECT_FALSE(v.non_finite);
  EXPECT_FALSE(v.stop_requested);
  EXPECT_TRUE(v.save_failed.empty());
  EXPECT_EQ(verdict_of(v), StepVerdict::kApply);
}

TEST(StepControl, OneRanksNonFiniteLossOrNormStopsEveryRankBeforeApplying) {
  for (const StepBallot bad : {StepBallot{kNaN, 1.0, false, false}, StepBallot{1.0, kInf, false, false},
                               StepBallot{-kInf, 1.0, false, false}}) {
    const StepVotes v = tally_votes(gathered({{1.0, 1.0, false, false}, bad}), 2);
    EXPECT_TRUE(v.non_finite);
    EXPECT_EQ(verdict_of(v), StepVerdict::kStopNonFinite);
  }
}

// Under loss scaling an overflowing gradient is the scaler's to skip; a non-finite loss is not.
TEST(StepControl, UnderLossScalingOnlyANonFiniteLossStopsTheRun) {
  const StepVotes overflow = tally_votes(gathered({{1.0, kInf, false, false}, {1.0, kInf, false, false}}), 2);
  EXPECT_TRUE(overflow.non_finite);
  EXPECT_FALSE(overflow.loss_non_finite);
  EXPECT_EQ(verdict_of(overflow, /*loss_scaling=*/true), StepVerdict::kApply);
  EXPECT_EQ(verdict_of(overflow, /*loss_scaling=*/false), StepVerdict::kStopNonFinite);
  const StepVotes with_signal = tally_votes(gathered({{1.0, kNaN, true, false}, {1.0, kNaN, false, false}}), 2);
  EXPECT_EQ(verdict_of(with_signal, /*loss_scaling=*/true), StepVerdict::kApplyThenStop);
  const StepVotes bad_loss = tally_votes(gathered({{1.0, kInf, false, false}, {kNaN, kInf, false, false}}), 2);
  EXPECT_TRUE(bad_loss.loss_non_finite);
  EXPECT_EQ(verdict_of(bad_loss, /*loss_scaling=*/true), StepVerdict::kStopNonFinite);
}

TEST(StepControl, NonFiniteWinsOverAFailedSaveAndASignal) {
  const StepVotes v = tally_votes(gathered({{kNaN, 1.0, true, true}, {1.0, 1.0, false, false}}), 2);
  EXPECT_EQ(verdict_of(v), StepVerdict::kStopNonFinite);
}

TEST(StepControl, AFailedSaveNamesItsRanksInOrderAndStopsBeforeApplying) {
  const StepVotes v =
      tally_votes(gathered({{1, 1, false, false}, {1, 1, false, true}, {1, 1, true, false}, {1, 1, false, true}}), 4);
  EXPECT_EQ(v.save_failed, (std::vector<int>{1, 3}));
  EXPECT_TRUE(v.stop_requested);
  EXPECT_EQ(verdict_of(v), StepVerdict::kStopFailedSave);
}

TEST(StepControl, ASignalOnAnyRankAppliesTheStepThenStops) {
  const StepVotes v = tally_votes(gathered({{1, 1, false, false}, {1, 1, true, false}}), 2);
  EXPECT_TRUE(v.stop_requested);
  EXPECT_EQ(verdict_of(v), StepVerdict::kApplyThenStop);
}

TEST(StepControl, TallyRefusesNumbersThatDoNotMatchTheWorld) {
  EXPECT_THROW(tally_votes(std::vector<double>(7, 0.0), 2), std::invalid_argument);
  EXPECT_THROW(tally_votes({}, 0), std::invalid_argument);
}

TEST(StepControl, GradientSyncOnlyOnTheLastMicroBatchExceptHsdpReduceScatters) {
  for (DataParallelKind kind : {DataParallelKind::kReplicated, DataParallelKind::kSharded}) {
    EXPECT_FALSE(gradient_sync_for(kind, 0, 3).requires_gradient_sync);
    EXPECT_FALSE(gradient_sync_for(kind, 1, 3).requires_gradient_sync);
    EXPECT_TRUE(gradient_sync_for(kind, 2, 3).requires_gradient_sync);
    EXPECT_TRUE(gradient_sync_for(kind, 0, 1).requires_gradient_sync);
  }
  // HSDP reduce-scatters every micro-batch and all-reduces across replicas only after the last.
  for (int64_t m = 0; m < 3; ++m) {
    const GradientSync s = gradient_sync_for(DataParallelKind::kHybrid, m, 3);
    EXPECT_TRUE(s.requires_gradient_sync);
    EXPECT_EQ(s.requires_all_reduce, m == 2);
  }
}

TEST(StepControl, BackgroundSavesEveryIntervalButNotAfterTheLastStep) {
  EXPECT_FALSE(background_save_after(5, 0, 10));  // checkpoints off
  EXPECT_TRUE(background_save_after(5, 5, 11));
  EXPECT_FALSE(background_save_after(4, 5, 11));
  EXPECT_FALSE(background_save_after(10, 5, 10));  // the end of the run saves it
  EXPECT_TRUE(final_save_needed(5, 5, 10));
  EXPECT_FALSE(final_save_needed(5, 10, 10));  // saved already (or resumed from it)
  EXPECT_FALSE(final_save_needed(0, -1, 10));
}

TEST(StepControl, StopMessagesSayWhatHappenedAndWhatToDo) {
  StepVotes v;
  v.loss = kNaN;
  v.grad_norm = -kInf;
  const std::string clipping_off = non_finite_stop_message(7, v, 0.0, "none");
  EXPECT_NE(clipping_off.find("stopping at step 7: the loss is NaN and the gradient norm is -inf"), std::string::npos)
      << clipping_off;
  EXPECT_NE(clipping_off.find("The last good checkpoint is none"), std::string::npos);
  EXPECT_NE(clipping_off.find("set training.max_grad_norm (clipping is off)"), std::string::npos);
  EXPECT_NE(non_finite_stop_message(7, v, 1.0, "ck/step_5").find("cannot help a non-finite norm"), std::string::npos);

  v.save_failed = {1, 2};
  const std::string other = failed_save_line(9, v, 8, "", false, "");
  EXPECT_EQ(other, "stopping at step 9: rank(s) 1, 2 failed saving the checkpoint of step 8");
  const std::string own = failed_save_line(9, v, 8, "disk full", true, "ck/step_4");
  EXPECT_EQ(own.rfind("saving the checkpoint of step 8 failed: disk full; stopped at step 9 (not applied); the last "
                      "complete checkpoint is ck/step_4",
                      0),
            0u)
      << own;
  EXPECT_EQ(signal_stop_message(3, 15, "ck/step_3"),
            "fsdp-train: stop requested (signal 15): saved step 3 to ck/step_3; run again with training.resume: auto "
            "to continue");
}

TEST(StepControl, NumbersInMessagesSpellOutNaNAndInfinities) {
  EXPECT_EQ(shown(kNaN), "NaN");
  EXPECT_EQ(shown(-kNaN), "NaN");
  EXPECT_EQ(shown(kInf), "inf");
  EXPECT_EQ(shown(-kInf), "-inf");
  EXPECT_EQ(shown(2.5), "2.5");
}

}  // namespace
}  // namespace train
}  // namespace fsdp
