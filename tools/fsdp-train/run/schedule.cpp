// schedule.cpp — the learning-rate schedule of fsdp-train (see schedule.h for the formula).
#include "run/schedule.h"

#include <algorithm>
#include <cmath>

namespace fsdp {
namespace train {

LrSchedule lr_schedule(const TrainConfig& cfg) {
  LrSchedule s;
  s.lr = cfg.optimizer.lr;
  s.min_lr = cfg.schedule.min_lr;
  s.warmup_steps = cfg.schedule.warmup_steps;
  s.decay_steps = cfg.schedule.decay_steps > 0 ? cfg.schedule.decay_steps : cfg.training.steps - s.warmup_steps;
  return s;
}

double lr_at(const LrSchedule& s, int64_t step) {
  const int64_t warmup = s.warmup_steps;
  if (step <= warmup) return s.lr * static_cast<double>(step) / static_cast<double>(warmup);
  const double t =
      std::min(1.0, static_cast<double>(step - warmup - 1) / static_cast<double>(std::max<int64_t>(s.decay_steps, 1)));
  return s.min_lr + 0.5 * (s.lr - s.min_lr) * (1.0 + std::cos(M_PI * t));
}

}  // namespace train
}  // namespace fsdp
