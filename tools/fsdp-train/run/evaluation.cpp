// evaluation.cpp — the eval loss over the start of a token file (evaluation.h).
#include "run/evaluation.h"

#include "common/agreement.h"
#include "data/data.h"

#include <ATen/core/grad_mode.h>

#include <numeric>
#include <vector>

namespace fsdp {
namespace train {
namespace {

// Puts a module back in the mode it had, whatever happens in between.
class TrainingModeRestorer {
 public:
  explicit TrainingModeRestorer(torch::nn::Module& m) : module_(m), was_training_(m.is_training()) { m.eval(); }
  ~TrainingModeRestorer() { module_.train(was_training_); }
  TrainingModeRestorer(const TrainingModeRestorer&) = delete;
  TrainingModeRestorer& operator=(const TrainingModeRestorer&) = delete;

 private:
  torch::nn::Module& module_;
  bool was_training_;
};

}  // namespace

Evaluation::Evaluation(const TrainConfig& cfg, int64_t model_vocab, int64_t seq, int dp_world, int dp_rank)
    : path_(cfg.eval.path),
      batches_(cfg.eval.batches),
      seq_(seq),
      rows_(cfg.training.micro_batch_size),
      global_rows_(dp_world * cfg.training.micro_batch_size),
      dp_rank_(dp_rank) {
  if (path_.empty())
    throw ConfigError(
        "eval.path: required to evaluate (a token file made by `fsdp-train tokenize`, "
        "tools/pretokenize.py or llm.c); e.g. --eval.path=build/gpl3.tokens");
  tokens_ = read_token_file(path_, "eval.path").second;
  const int64_t needed = batches_ * global_rows_ * (seq_ + 1);
  if (needed > tokens_.numel()) {
    throw ConfigError("eval.batches: " + std::to_string(batches_) + " global batches of " +
                      std::to_string(global_rows_) + " windows (" + std::to_string(dp_world) +
                      " data-parallel ranks x training.micro_batch_size " + std::to_string(rows_) + ") of " +
                      std::to_string(seq_ + 1) + " tokens (training.seq_len + 1) need " + std::to_string(needed) +
                      " tokens, but eval.path " + path_ + " has " + std::to_string(tokens_.numel()) +
                      "; lower eval.batches or give a longer file");
  }
  check_ids_below(path_, tokens_.narrow(0, 0, needed), model_vocab);
}

double Evaluation::evaluate(torch::nn::Module& model, const BatchLoss& loss, const c10::Device& device) const {
  const TrainingModeRestorer eval_mode(model);
  at::NoGradGuard no_grad;
  double sum = 0;
  for (int64_t b = 0; b < batches_; ++b) {
    const at::Tensor batch = eval_batch(tokens_, b, global_rows_, seq_);
    auto [inputs, targets] = micro_batch(batch, dp_rank_, /*accumulation=*/1, /*micro=*/0, rows_);
    sum += loss(inputs.to(device), targets.to(device)).item<double>();
  }
  // Every rank's mean over the same number of tokens: their plain mean is the mean over every
  // token (tensor-parallel ranks of one row count alike, each with its row's value).
  const std::vector<double> all = all_gather_numbers({sum});
  return std::accumulate(all.begin(), all.end(), 0.0) / static_cast<double>(all.size() * batches_);
}

std::string Evaluation::describe() const {
  return "eval.path " + path_ + ": " + std::to_string(batches_) + " batch(es) x " + std::to_string(global_rows_) +
         " windows of " + std::to_string(seq_ + 1) + " tokens (" +
         std::to_string(batches_ * global_rows_ * (seq_ + 1)) + " of the file's " + std::to_string(tokens_.numel()) +
         " tokens)";
}

}  // namespace train
}  // namespace fsdp
