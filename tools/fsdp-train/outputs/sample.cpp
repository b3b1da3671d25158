// sample.cpp — sampling text from an unsharded copy of the trained model (see sample.h).
#include "outputs/sample.h"

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
BuiltModel unsharded_copy(const ModelFamily& family, const TensorStateDict& full) {
  BuiltModel local = family.build(nullptr);
  at::NoGradGuard no_grad;
  auto params = local.module->named_parameters();
  for (const auto& item : full) params[item.key()].copy_(item.value());
  local.module->eval();
  return local;
}

// The prompt's ids; token 0 when there is no tokenizer or the prompt encodes to nothing.
std::vector<int64_t> prompt_ids(const std::string& prompt_text, const Tokenizer* tokenizer) {
  const std::string prompt = prompt_text.empty() ? std::string("\n") : prompt_text;
  if (!tokenizer) return {0};
  const std::vector<uint32_t> encoded = tokenizer->encode(prompt);
  if (encoded.empty()) return {0};
  return std::vector<int64_t>(encoded.begin(), encoded.end());
}

// The next token after `ids`, drawn from the model's distribution at the last position.
int64_t next_token(models::CausalLM& model, const std::vector<int64_t>& ids, int64_t max_seq_len, double temperature,
                   at::Generator& gen) {
  at::NoGradGuard no_grad;
  const int64_t n = std::min<int64_t>(static_cast<int64_t>(ids.size()), max_seq_len);
  at::Tensor context = at::tensor(std::vector<int64_t>(ids.end() - n, ids.end()), at::kLong).unsqueeze(0);
  at::Tensor logits = model.logits(context).select(1, n - 1).squeeze(0) / temperature;
  return at::multinomial(at::softmax(logits, -1), 1, false, gen).item<int64_t>();
}

std::string sample_from(models::CausalLM& model, int64_t max_seq_len, const SampleConfig& cfg,
                        const Tokenizer* tokenizer) {
  std::vector<int64_t> ids = prompt_ids(cfg.prompt, tokenizer);
  const size_t prompt_len = ids.size();
  at::Generator gen = at::detail::createCPUGenerator(static_cast<uint64_t>(cfg.seed));
  for (int64_t i = 0; i < cfg.length; ++i) ids.push_back(next_token(model, ids, max_seq_len, cfg.temperature, gen));

  std::ostringstream out;
  out << "sample (" << cfg.length << " tokens, temperature " << cfg.temperature << "):\n";
  if (tokenizer) {
    out << tokenizer->decode(ids);
  } else {
    for (size_t i = prompt_len; i < ids.size(); ++i) out << ids[i] << ' ';
  }
  return out.str();
}

}  // namespace

std::string generate_sample(const ModelFamily& family, const TensorStateDict& full, const SampleConfig& cfg,
                            const Tokenizer* tokenizer) {
  const BuiltModel model = unsharded_copy(family, full);
  return sample_from(*model.lm, family.shape().max_seq_len, cfg, tokenizer);
}

}  // namespace train
}  // namespace fsdp
