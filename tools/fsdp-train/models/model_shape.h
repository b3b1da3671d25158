// model_shape.h — the sizes every model family has, as the trainer's checks, reports and
// checkpoints read them, and a family's sizes as the planner takes them. No torch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp {
namespace train {

struct ModelShape {
  int64_t n_layers = 0;     // decoder layers
  int64_t vocab_size = 0;   // rows of the embedding, outputs of the head
  int64_t max_seq_len = 0;  // the longest sequence the model takes
  int64_t dim = 0;          // the model's width
  int64_t n_heads = 0;      // attention (query) heads
  double dropout_p = 0;     // dropout's probability in training (0 for a family without dropout)
};

// One size of a family as the planner takes it: its name ("n_layers", "dim", "vocab_size",
// "max_seq_len", or the family's own, such as "intermediate_size"), the key a user sets it by
// ("model.dim", "hidden_size (config.json)"), and its value.
struct PlanSize {
  std::string name;
  std::string key;
  int64_t value = 0;
};

// The value of the size `name`; throws std::logic_error when `sizes` has none (a family's bug).
int64_t size_named(const std::vector<PlanSize>& sizes, const std::string& name);
// `sizes` with the size `name` set to `value`.
std::vector<PlanSize> with_size(std::vector<PlanSize> sizes, const std::string& name, int64_t value);

}  // namespace train
}  // namespace fsdp
