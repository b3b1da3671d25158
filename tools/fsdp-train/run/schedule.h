// schedule.h — the learning rate of each optimizer step: linear warm-up, then cosine decay.
// Plain numbers, no torch, so that it builds and is tested on its own.
#pragma once

#include "config/config.h"

#include <cstdint>

namespace fsdp {
namespace train {

// The schedule's numbers, resolved from a TrainConfig.
struct LrSchedule {
  double lr = 0;             // the peak: optimizer.lr
  double min_lr = 0;         // schedule.min_lr, reached at the end of the decay
  int64_t warmup_steps = 0;  // schedule.warmup_steps
  int64_t decay_steps = 0;   // schedule.decay_steps, or when that is 0 training.steps - warmup_steps
};

LrSchedule lr_schedule(const TrainConfig& cfg);

// The learning rate of optimizer step `step` (1-based):
//   step <= warmup:  lr * step / warmup                                   (linear warm-up)
//   after it:        min_lr + (lr - min_lr) * (1 + cos(pi * t)) / 2,      (cosine decay)
//                    t = min(1, (step - warmup - 1) / max(decay_steps, 1))
// As in PyTorch's CosineAnnealingLR, the first step after the warm-up runs at the full lr, the
// decay reaches min_lr after its last step, and every later step stays at min_lr.
double lr_at(const LrSchedule& s, int64_t step);

}  // namespace train
}  // namespace fsdp
