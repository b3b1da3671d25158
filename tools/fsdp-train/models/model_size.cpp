// model_size.cpp — the memory estimate of model_size.h and the check against the machine.
#include "models/model_size.h"

#include "config/config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace fsdp {
namespace train {
namespace {

// One part of the estimate: its bytes per rank, the keys whose product it is, and what it is.
struct Part {
  double bytes;
  std::vector<std::pair<std::string, double>> keys;
  std::string what;
};

int64_t shard_ranks(const StepSizes& s) { return std::max<int64_t>(1, s.shard_world > 0 ? s.shard_world : s.world); }

double llama_layer_parameters(const ModelSizes& m) {
  const double D = m.dim, Q = static_cast<double>(m.n_heads * m.head_dim),
               K = static_cast<double>(m.n_kv_heads * m.head_dim), I = m.intermediate_size;
  return 2 * D + D * (2 * Q + 2 * K) + 3 * D * I + (m.attention_bias ? Q + 2 * K : 0);
}

std::vector<Part> llama_parts(const ModelSizes& m, const StepSizes& s) {
  const double per_param = 16.0 / static_cast<double>(shard_ranks(s));
  const double V = m.vocab_size, D = m.dim, L = m.n_layers, I = m.intermediate_size;
  const double W = s.world, k = s.accumulation, B = s.micro_batch, T = s.seq;
  return {
      {per_param * (m.tie_word_embeddings ? 1 : 2) * V * D + per_param * D,
       {{"vocab_size (config.json)", V}, {"hidden_size (config.json)", D}},
       m.tie_word_embeddings ? "the tied embedding and head" : "the embedding and the head"},
      {per_param * L * llama_layer_parameters(m),
       {{"num_hidden_layers (config.json)", L},
        {"hidden_size (config.json)", D},
        {"intermediate_size (config.json)", I}},
       "the decoder layers"},
      {8 * W * k * B * (T + 1),
       {{"training.micro_batch_size", B}, {"training.gradient_accumulation_steps", k}, {"training.seq_len", T}},
       "the step's global batch of tokens (drawn whole on every rank)"},
      {2 * 4 * B * T * V,
       {{"training.micro_batch_size", B}, {"training.seq_len", T}, {"vocab_size (config.json)", V}},
       "a micro-batch's logits and their gradient"},
  };
}

std::vector<Part> parts_of(const ModelSizes& m, const StepSizes& s) {
  if (m.llama) return llama_parts(m, s);
  const double per_param = 16.0 / static_cast<double>(shard_ranks(s));
  const double V = m.vocab_size, D = m.dim, S = m.max_seq_len, L = m.n_layers, H = m.n_heads;
  const double W = s.world, k = s.accumulation, B = s.micro_batch, T = s.seq;
  return {
      {per_param * 2 * V * D, {{"model.vocab_size", V}, {"model.dim", D}}, "the embeddings and the output layer"},
      {per_param * S * D, {{"model.max_seq_len", S}, {"model.dim", D}}, "the position embeddings"},
      {per_param * (L * (12 * D * D + 9 * D) + 2 * D),
       {{"model.n_layers", L}, {"model.dim", D}},
       "the Transformer blocks"},
      {8 * W * k * B * (T + 1),
       {{"training.micro_batch_size", B}, {"training.gradient_accumulation_steps", k}, {"training.seq_len", T}},
       "the step's global batch of tokens (drawn whole on every rank)"},
      {2 * 4 * B * T * V,
       {{"training.micro_batch_size", B}, {"training.seq_len", T}, {"model.vocab_size", V}},
       "a micro-batch's logits and their gradient"},
      {4 * L * B * H * T * T,
       {{"model.n_layers", L}, {"training.micro_batch_size", B}, {"model.n_heads", H}, {"training.seq_len", T}},
       "every layer's attention probabilities of a micro-batch"},
  };
}

std::string human_bytes(double bytes) {
  static const char* kUnits[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  std::ostringstream s;
  size_t u = 0;
  while (bytes >= 1024 && u + 1 < sizeof(kUnits) / sizeof(kUnits[0])) bytes /= 1024, ++u;
  s.precision(bytes < 10 ? 2 : 1);
  s << std::fixed << bytes << " " << kUnits[u];
  return s.str();
}

std::string number(double v) {
  std::ostringstream s;
  if (v < 1e15) s << static_cast<int64_t>(v);
  else s << v;
  return s.str();
}

// The part that makes up most of the estimate, and in it the key with the largest value.
std::pair<const Part*, std::string> largest(const std::vector<Part>& parts) {
  const Part* p =
      &*std::max_element(parts.begin(), parts.end(), [](const Part& a, const Part& b) { return a.bytes < b.bytes; });
  const auto key = std::max_element(p->keys.begin(), p->keys.end(),
                                    [](const auto& a, const auto& b) { return a.second < b.second; });
  return {p, key->first};
}

std::string factors(const Part& p) {
  std::string s;
  for (const auto& [key, value] : p.keys) s += (s.empty() ? "" : " x ") + key + " " + number(value);
  return s;
}

}  // namespace

double transformer_parameters(const ModelSizes& m) {
  const double V = m.vocab_size, D = m.dim, S = m.max_seq_len, L = m.n_layers;
  return 2 * V * D + S * D + L * (12 * D * D + 9 * D) + 2 * D;
}

double llama_parameters(const ModelSizes& m) {
  return (m.tie_word_embeddings ? 1.0 : 2.0) * m.vocab_size * m.dim + m.dim +
         static_cast<double>(m.n_layers) * llama_layer_parameters(m);
}

double bytes_per_rank(const ModelSizes& m, const StepSizes& s) {
  double total = 0;
  for (const Part& p : parts_of(m, s)) total += p.bytes;
  return total;
}

void check_fits_in_memory(const ModelSizes& m, const StepSizes& s, double mem_total_bytes) {
  const double per_rank = bytes_per_rank(m, s);
  const double machine = per_rank * static_cast<double>(std::max<int64_t>(1, s.local_world));
  const double limit = mem_total_bytes > 0 ? mem_total_bytes : std::ldexp(1.0, 63);
  if (machine <= limit) return;
  const std::vector<Part> parts = parts_of(m, s);
  const auto [part, key] = largest(parts);
  std::ostringstream msg;
  msg << key << ": this run needs at least " << human_bytes(per_rank) << " per rank, " << s.local_world
      << " rank(s) on this machine need " << human_bytes(machine) << ", more than its memory ("
      << (mem_total_bytes > 0 ? human_bytes(mem_total_bytes) + ", MemTotal in /proc/meminfo" : "unknown; 2^63 bytes")
      << "). Most of it is " << part->what << ": " << factors(*part) << " = " << human_bytes(part->bytes)
      << ". The model has " << number(m.llama ? llama_parameters(m) : transformer_parameters(m))
      << " parameters at 16 bytes each (parameter, "
      << "gradient, AdamW's two moments) sharded over " << shard_ranks(s)
      << " rank(s). Rule: the estimate per rank times the ranks "
      << "on this machine (LOCAL_WORLD_SIZE) must not exceed MemTotal. Lower " << key << ".";
  throw ConfigError(msg.str());
}

double machine_memory_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string name, unit;
    double value = 0;
    if (fields >> name >> value >> unit && name == "MemTotal:") return unit == "kB" ? value * 1024 : value;
  }
  return 0;
}

}  // namespace train
}  // namespace fsdp
