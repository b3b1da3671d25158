// evaluation.h — the model's mean cross-entropy over the start of a token file: `fsdp-train
// eval`, and the `eval loss` of the steps eval.interval names (config.h's EvalConfig says which
// windows). Knows no model: the caller gives the loss of a batch, so any model the trainer
// builds is evaluated the same way.
#pragma once

#include "config/config.h"

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <string>

namespace fsdp {
namespace train {

class Evaluation {
 public:
  // The mean cross-entropy of `inputs` -> `targets` (int64 [B, seq] each) over every position,
  // computed by the model on its mesh (collective inside, as a training forward is).
  using BatchLoss = std::function<at::Tensor(const at::Tensor& inputs, const at::Tensor& targets)>;

  // Reads eval.path (either token-file format) whole. Throws ConfigError naming eval.path when
  // it is unset, eval.batches when the file is shorter than the windows it asks for (saying how
  // many tokens each needs and how many the file has), and the file and the id for a token
  // that a model of `model_vocab` cannot embed; std::runtime_error naming the file when it does
  // not read. `dp_world` x training.micro_batch_size windows make one global batch. Not
  // collective.
  Evaluation(const TrainConfig& cfg, int64_t model_vocab, int64_t seq, int dp_world, int dp_rank);

  // Collective over the world: every rank calls it at the same point. Runs the eval.batches
  // global batches without gradients, this rank its rows of each, with dropout off (the
  // module's training mode is restored after), and returns the mean over every predicted token
  // of every batch, the same on every rank. The loss is summed in double across ranks and
  // batches, so W ranks of B rows give the value of one rank of W x B rows up to fp32 rounding
  // inside each forward.
  double evaluate(torch::nn::Module& model, const BatchLoss& loss, const c10::Device& device) const;

  // "eval.path F: N batches x R windows of S + 1 tokens (T of the file's U tokens)".
  std::string describe() const;

 private:
  std::string path_;
  at::Tensor tokens_;
  int64_t batches_ = 0, seq_ = 0, rows_ = 0, global_rows_ = 0;
  int dp_rank_ = 0;
};

}  // namespace train
}  // namespace fsdp
