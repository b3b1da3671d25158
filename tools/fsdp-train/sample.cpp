// sample.cpp — sampling text from an unsharded copy of the trained model (see sample.h).
#include "sample.h"

#include "data.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Functions.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <sstream>
#include <vector>

namespace fsdp {
namespace train {
namespace {

// The whole model on this process alone, in eval mode.
models::Transformer unsharded_copy(models::ModelArgs args, const TensorStateDict& full) {
  args.dropout_p = 0;
  models::Transformer local(args);
  at::NoGradGuard no_grad;
  auto params = local->named_parameters();
  for (const auto& item : full) params[item.key()].copy_(item.value());
  local->eval();
  return local;
}

models::Llama unsharded_copy(const models::LlamaArgs& args, const TensorStateDict& full) {
  models::Llama local(args);
  at::NoGradGuard no_grad;
  auto params = local->named_parameters();
  for (const auto& item : full) params[item.key()].copy_(item.value());
  local->eval();
  return local;
}

std::vector<int64_t> prompt_ids(const std::string& prompt_text, bool byte_level) {
  const std::string prompt = prompt_text.empty() ? std::string("\n") : prompt_text;
  if (!byte_level) return {0};
  std::vector<int64_t> ids;
  for (unsigned char c : prompt) ids.push_back(c);
  return ids;
}

// The next token after `ids`, drawn from the model's distribution at the last position.
template <typename Model>
int64_t next_token(Model& model, const std::vector<int64_t>& ids, int64_t max_seq_len, double temperature,
                   at::Generator& gen) {
  at::NoGradGuard no_grad;
  const int64_t n = std::min<int64_t>(static_cast<int64_t>(ids.size()), max_seq_len);
  at::Tensor context = at::tensor(std::vector<int64_t>(ids.end() - n, ids.end()), at::kLong).unsqueeze(0);
  at::Tensor logits = model->forward(context).select(1, n - 1).squeeze(0) / temperature;
  return at::multinomial(at::softmax(logits, -1), 1, false, gen).item<int64_t>();
}

template <typename Model>
std::string sample_from(Model& model, int64_t max_seq_len, const SampleConfig& cfg, bool byte_level) {
  std::vector<int64_t> ids = prompt_ids(cfg.prompt, byte_level);
  const size_t prompt_len = ids.size();
  at::Generator gen = at::detail::createCPUGenerator(static_cast<uint64_t>(cfg.seed));
  for (int64_t i = 0; i < cfg.length; ++i) ids.push_back(next_token(model, ids, max_seq_len, cfg.temperature, gen));

  std::ostringstream out;
  out << "sample (" << cfg.length << " tokens, temperature " << cfg.temperature << "):\n";
  if (byte_level) {
    out << bytes_text(ids);
  } else {
    for (size_t i = prompt_len; i < ids.size(); ++i) out << ids[i] << ' ';
  }
  return out.str();
}

}  // namespace

std::string generate_sample(const models::ModelArgs& args, const TensorStateDict& full, const SampleConfig& cfg,
                            bool byte_level) {
  models::Transformer model = unsharded_copy(args, full);
  return sample_from(model, args.max_seq_len, cfg, byte_level);
}

std::string generate_sample(const models::LlamaArgs& args, const TensorStateDict& full, const SampleConfig& cfg,
                            bool byte_level) {
  models::Llama model = unsharded_copy(args, full);
  return sample_from(model, args.max_position_embeddings, cfg, byte_level);
}

}  // namespace train
}  // namespace fsdp
