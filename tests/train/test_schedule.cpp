// Unit tests of fsdp-train's learning-rate schedule (tools/fsdp-train/run/schedule.h): linear
// warm-up to lr over warmup_steps, then cosine decay from lr to min_lr over decay_steps, then
// min_lr. The expected values are worked out by hand from that definition:
//   warm-up step s:  lr * s / warmup
//   decay step s:    min_lr + (lr - min_lr) * (1 + cos(pi * t)) / 2, t = (s - warmup - 1) / decay
#include "run/schedule.h"

#include <gtest/gtest.h>

#include <cmath>

namespace fsdp {
namespace train {
namespace {

constexpr double kLr = 1e-3;
constexpr double kMinLr = 1e-4;
constexpr double kTol = 1e-15;  // about 1e-12 of the learning rates here

LrSchedule schedule(int64_t warmup, int64_t decay, double lr = kLr, double min_lr = kMinLr) {
  LrSchedule s;
  s.lr = lr;
  s.min_lr = min_lr;
  s.warmup_steps = warmup;
  s.decay_steps = decay;
  return s;
}

TEST(Schedule, WarmupRisesLinearlyFromTheFirstStep) {
  const LrSchedule s = schedule(4, 10);
  EXPECT_NEAR(lr_at(s, 1), 0.25e-3, kTol);  // a quarter of the way up, not 0
  EXPECT_NEAR(lr_at(s, 2), 0.5e-3, kTol);
  EXPECT_NEAR(lr_at(s, 3), 0.75e-3, kTol);
}

TEST(Schedule, LastWarmupStepIsTheFullLr) { EXPECT_NEAR(lr_at(schedule(4, 10), 4), kLr, kTol); }

TEST(Schedule, FirstStepAfterWarmupIsTheFullLr) {
  EXPECT_NEAR(lr_at(schedule(4, 10), 5), kLr, kTol);  // t = 0
}

TEST(Schedule, CosineMidpointIsHalfwayBetweenLrAndMinLr) {
  // t = (10 - 4 - 1) / 10 = 1/2, cos(pi / 2) = 0.
  EXPECT_NEAR(lr_at(schedule(4, 10), 10), (kLr + kMinLr) / 2, kTol);
}

TEST(Schedule, CosineAtOneThirdAndOneFifth) {
  // t = (7 - 4 - 1) / 6 = 1/3, cos(pi / 3) = 1/2: min_lr + 3/4 (lr - min_lr).
  EXPECT_NEAR(lr_at(schedule(4, 6), 7), kMinLr + 0.75 * (kLr - kMinLr), kTol);
  // t = (7 - 4 - 1) / 10 = 1/5, cos(pi / 5) = (1 + sqrt 5) / 4.
  const double cos_pi_5 = (1 + std::sqrt(5.0)) / 4;
  EXPECT_NEAR(lr_at(schedule(4, 10), 7), kMinLr + (kLr - kMinLr) * (1 + cos_pi_5) / 2, kTol);
}

TEST(Schedule, DecayReachesMinLrAfterItsLastStep) {
  const LrSchedule s = schedule(4, 10);
  // The decay's last step (t = 9/10) is still above min_lr; the step after it (t = 1) is min_lr.
  EXPECT_GT(lr_at(s, 14), kMinLr + 1e-7);
  EXPECT_NEAR(lr_at(s, 15), kMinLr, kTol);
}

TEST(Schedule, StepsPastTheEndStayAtMinLr) {
  const LrSchedule s = schedule(4, 10);
  for (int64_t step : {16, 20, 100, 1000000}) EXPECT_NEAR(lr_at(s, step), kMinLr, kTol) << "step " << step;
}

TEST(Schedule, DecayNeverRises) {
  const LrSchedule s = schedule(3, 17);
  for (int64_t step = 4; step < 30; ++step) EXPECT_LE(lr_at(s, step + 1), lr_at(s, step)) << "step " << step;
}

TEST(Schedule, NoWarmupStartsAtTheFullLr) {
  const LrSchedule s = schedule(0, 8);
  EXPECT_NEAR(lr_at(s, 1), kLr, kTol);                 // t = 0
  EXPECT_NEAR(lr_at(s, 5), (kLr + kMinLr) / 2, kTol);  // t = 4/8
  EXPECT_NEAR(lr_at(s, 9), kMinLr, kTol);              // t = 1
}

TEST(Schedule, MinLrZeroDecaysToZero) {
  const LrSchedule s = schedule(2, 4, kLr, 0.0);
  EXPECT_NEAR(lr_at(s, 5), kLr / 2, kTol);  // t = 2/4
  EXPECT_EQ(lr_at(s, 7), 0.0);              // t = 1: cos(pi) = -1 exactly cancels
}

TEST(Schedule, MinLrEqualToLrIsConstantAfterWarmup) {
  const LrSchedule s = schedule(2, 5, kLr, kLr);
  EXPECT_NEAR(lr_at(s, 1), kLr / 2, kTol);
  for (int64_t step = 2; step < 12; ++step) EXPECT_NEAR(lr_at(s, step), kLr, kTol) << "step " << step;
}

TEST(Schedule, OneDecayStepGoesStraightToMinLr) {
  const LrSchedule s = schedule(3, 1);
  EXPECT_NEAR(lr_at(s, 4), kLr, kTol);     // t = 0
  EXPECT_NEAR(lr_at(s, 5), kMinLr, kTol);  // t = 1
}

TEST(Schedule, ZeroOrNegativeDecayStepsCountAsOne) {
  for (int64_t decay : {0, -10}) {
    const LrSchedule s = schedule(3, decay);
    EXPECT_NEAR(lr_at(s, 4), kLr, kTol) << "decay " << decay;
    EXPECT_NEAR(lr_at(s, 5), kMinLr, kTol) << "decay " << decay;
  }
}

TrainConfig config(int64_t steps, int64_t warmup, int64_t decay) {
  TrainConfig cfg;
  cfg.optimizer.lr = kLr;
  cfg.schedule.min_lr = kMinLr;
  cfg.training.steps = steps;
  cfg.schedule.warmup_steps = warmup;
  cfg.schedule.decay_steps = decay;
  return cfg;
}

TEST(Schedule, FromConfigTakesLrMinLrWarmupAndDecay) {
  const LrSchedule s = lr_schedule(config(100, 5, 20));
  EXPECT_EQ(s.lr, kLr);
  EXPECT_EQ(s.min_lr, kMinLr);
  EXPECT_EQ(s.warmup_steps, 5);
  EXPECT_EQ(s.decay_steps, 20);
}

TEST(Schedule, DecayStepsZeroMeansTheStepsAfterWarmup) {
  const LrSchedule s = lr_schedule(config(20, 4, 0));
  EXPECT_EQ(s.decay_steps, 16);
  // t = (13 - 4 - 1) / 16 = 1/2; the run's last step (20) has t = 15/16, min_lr would be step 21.
  EXPECT_NEAR(lr_at(s, 13), (kLr + kMinLr) / 2, kTol);
  EXPECT_GT(lr_at(s, 20), kMinLr);
  EXPECT_NEAR(lr_at(s, 21), kMinLr, kTol);
}

TEST(Schedule, WarmupLongerThanTheRunNeverLeavesWarmup) {
  const LrSchedule s = lr_schedule(config(10, 40, 0));
  for (int64_t step = 1; step <= 10; ++step)
    EXPECT_NEAR(lr_at(s, step), kLr * static_cast<double>(step) / 40, kTol) << "step " << step;
}

TEST(Schedule, DefaultConfigDecaysOverTheWholeRun) {
  // Defaults: optimizer.lr 1e-3, min_lr 0, warmup 0, decay over training.steps (100).
  const LrSchedule s = lr_schedule(TrainConfig{});
  EXPECT_EQ(s.warmup_steps, 0);
  EXPECT_EQ(s.decay_steps, 100);
  EXPECT_NEAR(lr_at(s, 1), 1e-3, kTol);
  EXPECT_NEAR(lr_at(s, 51), 0.5e-3, kTol);  // t = 50/100
}

}  // namespace
}  // namespace train
}  // namespace fsdp
