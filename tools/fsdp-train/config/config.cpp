// config.cpp — YAML + command-line loading and validation of a TrainConfig.
//
// Every key is one entry of a table (section, key, setter). The YAML file and the command line
// go through the same table, so a key that can be written in the file can be overridden, and
// both get the same type and range checks. Setters throw Invalid with a bare message; the
// caller prefixes where the value came from and the key's full name.
#include "config/config.h"

#include "config/read_file.h"

#include <yaml-cpp/depthguard.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <sstream>

namespace fsdp {
namespace train {

const char* to_string(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::FULL_SHARD: return "FULL_SHARD";
    case ShardingStrategy::SHARD_GRAD_OP: return "SHARD_GRAD_OP";
    case ShardingStrategy::NO_SHARD: return "NO_SHARD";
    case ShardingStrategy::HYBRID_SHARD: return "HYBRID_SHARD";
    case ShardingStrategy::HYBRID_SHARD_ZERO2: return "HYBRID_SHARD_ZERO2";
  }
  return "?";
}

const char* to_string(Dtype d) {
  switch (d) {
    case Dtype::kFloat32: return "float32";
    case Dtype::kBFloat16: return "bfloat16";
    case Dtype::kFloat16: return "float16";
  }
  return "?";
}

const char* short_name(Dtype d) {
  switch (d) {
    case Dtype::kFloat32: return "fp32";
    case Dtype::kBFloat16: return "bf16";
    case Dtype::kFloat16: return "fp16";
  }
  return "?";
}

std::string Precision::describe() const {
  const std::string scaled = loss_scaling ? " with loss scaling" : "";
  if (!is_mixed()) return "fp32" + scaled;
  return std::string("param ") + short_name(param) + ", reduce " + short_name(reduce) + scaled;
}

Precision precision_of(const FsdpConfig& f) {
  Precision p;
  if (f.mixed_precision) p = Precision{Dtype::kBFloat16, Dtype::kFloat32};
  // fp16 with loss scaling: fp16 compute, fp32 reductions (what torch.amp's fp16 recipe keeps in
  // fp32). It wins over mixed_precision's bf16; an explicit dtype key still wins over both.
  if (f.fp16) p = Precision{Dtype::kFloat16, Dtype::kFloat32};
  p.loss_scaling = f.fp16;
  if (f.param_dtype) p.param = *f.param_dtype;
  if (f.reduce_dtype) p.reduce = *f.reduce_dtype;
  return p;
}

namespace {

struct Invalid {
  std::string msg;
};

void require(bool ok, const std::string& msg) {
  if (!ok) throw Invalid{msg};
}

std::string shown(const YAML::Node& n) {
  if (n.IsScalar()) return "'" + n.Scalar() + "'";
  if (n.IsSequence()) return "a list";
  if (n.IsMap()) return "a mapping";
  return "nothing";
}

// yaml-cpp's as<T> only succeeds when the whole scalar converts, so "abc" or "1.5" is no
// integer and "yes"/"no"/"true"/"false" are the booleans.
template <class T>
T scalar(const YAML::Node& n, const char* what) {
  try {
    if (n.IsScalar()) return n.as<T>();
  } catch (const YAML::Exception&) {
  }
  throw Invalid{std::string("expected ") + what + ", got " + shown(n)};
}

int64_t to_int(const YAML::Node& n) { return scalar<int64_t>(n, "an integer"); }
bool to_bool(const YAML::Node& n) { return scalar<bool>(n, "true or false"); }
double to_double(const YAML::Node& n) {
  double v = scalar<double>(n, "a number");
  require(std::isfinite(v), "expected a finite number, got " + shown(n));
  return v;
}
// A null value (`key:` or `--key=`) is the empty string, e.g. to switch off logging.jsonl.
std::string to_string_value(const YAML::Node& n) {
  if (n.IsNull()) return "";
  return scalar<std::string>(n, "a string");
}
std::string one_of(const YAML::Node& n, const std::vector<std::string>& choices) {
  std::string v = to_string_value(n);
  if (std::find(choices.begin(), choices.end(), v) != choices.end()) return v;
  std::string list;
  for (const auto& c : choices) list += (list.empty() ? "" : " | ") + c;
  throw Invalid{"expected one of " + list + ", got " + shown(n)};
}

int to_int32(const YAML::Node& n) {
  int64_t v = to_int(n);
  require(v >= std::numeric_limits<int>::min() && v <= std::numeric_limits<int>::max(), "value out of range");
  return static_cast<int>(v);
}
double to_beta(const YAML::Node& n) {
  double v = to_double(n);
  require(v >= 0.0 && v < 1.0, "must be in [0, 1), got " + n.Scalar());
  return v;
}

using Setter = std::function<void(const YAML::Node&)>;
struct Field {
  std::string section, key;
  Setter set;
};

// Setter factories for the common shapes: an integer / number at least (or above) a bound.
Setter int_at_least(int64_t& dst, int64_t lo) {
  return [&dst, lo](const YAML::Node& n) {
    int64_t v = to_int(n);
    require(v >= lo, "must be >= " + std::to_string(lo) + ", got " + std::to_string(v));
    dst = v;
  };
}
// The same for a key the library takes as an int (a count of ranks or buffers).
Setter int32_at_least(int& dst, int lo) {
  return [&dst, lo](const YAML::Node& n) {
    const int v = to_int32(n);
    require(v >= lo, "must be >= " + std::to_string(lo) + ", got " + std::to_string(v));
    dst = v;
  };
}
Setter opt_positive_int(std::optional<int64_t>& dst) {
  return [&dst](const YAML::Node& n) {
    int64_t v = to_int(n);
    require(v > 0, "must be > 0, got " + std::to_string(v));
    dst = v;
  };
}
Setter number(double& dst, double lo, bool lo_inclusive) {
  return [&dst, lo, lo_inclusive](const YAML::Node& n) {
    double v = to_double(n);
    std::ostringstream rule;
    rule << "must be " << (lo_inclusive ? ">= " : "> ") << lo << ", got " << v;
    require(lo_inclusive ? v >= lo : v > lo, rule.str());
    dst = v;
  };
}
Setter boolean(bool& dst) {
  return [&dst](const YAML::Node& n) { dst = to_bool(n); };
}
Setter string(std::string& dst) {
  return [&dst](const YAML::Node& n) { dst = to_string_value(n); };
}
Setter choice(std::string& dst, std::vector<std::string> choices) {
  return [&dst, choices](const YAML::Node& n) { dst = one_of(n, choices); };
}
// A null value (`key:` or `--key=`) unsets it: fsdp_config.mixed_precision decides again.
Setter optional_dtype(std::optional<Dtype>& dst) {
  return [&dst](const YAML::Node& n) {
    if (n.IsNull()) return dst.reset();
    const std::string v = one_of(n, {"float32", "bfloat16", "float16"});
    for (Dtype d : {Dtype::kFloat32, Dtype::kBFloat16, Dtype::kFloat16})
      if (v == to_string(d)) dst = d;
  };
}

// A quantized collective's format; a null value (`key:` or `--key=`) turns it off.
Setter optional_quantized_dtype(std::optional<std::string>& dst) {
  return [&dst](const YAML::Node& n) {
    if (n.IsNull()) return dst.reset();
    dst = one_of(n, {"int8", "float8_e4m3", "bfloat16"});
  };
}

std::vector<Field> fields_of(TrainConfig& c) {
  auto& f = c.fsdp_config;
  auto& m = c.model;
  auto& o = c.optimizer;
  auto& t = c.training;
  return {
      {"fsdp_config", "world_size",
       [&f](const YAML::Node& n) {
         int v = to_int32(n);
         require(v == -1 || v >= 1, "must be >= 1 (or -1 for the launcher's), got " + std::to_string(v));
         f.world_size = v;
       }},
      {"fsdp_config", "local_rank",
       [&f](const YAML::Node& n) {
         int v = to_int32(n);
         require(v >= -1, "must be >= 0 (or -1 for the launcher's), got " + std::to_string(v));
         f.local_rank = v;
       }},
      {"fsdp_config", "shard_optimizer_state", boolean(f.shard_optimizer_state)},
      {"fsdp_config", "mixed_precision", boolean(f.mixed_precision)},
      {"fsdp_config", "param_dtype", optional_dtype(f.param_dtype)},
      {"fsdp_config", "reduce_dtype", optional_dtype(f.reduce_dtype)},
      {"fsdp_config", "fp16", boolean(f.fp16)},
      {"fsdp_config", "activation_checkpointing", boolean(f.activation_checkpointing)},
      {"fsdp_config", "activation_checkpointing_every", int_at_least(f.activation_checkpointing_every, 1)},
      {"fsdp_config", "output_head_group", boolean(f.output_head_group)},
      {"fsdp_config", "prefetch_depth", int_at_least(f.prefetch_depth, 1)},
      {"fsdp_config", "reduce_scatter_max_input_buffers", int32_at_least(f.reduce_scatter_max_input_buffers, 1)},
      {"fsdp_config", "device", choice(f.device, {"cpu", "cuda"})},
      {"fsdp_config", "offload_params", boolean(f.offload_params)},
      {"fsdp_config", "offload_optimizer_state", boolean(f.offload_optimizer_state)},
      {"fsdp_config", "use_reentrant", boolean(f.use_reentrant)},
      {"fsdp_config", "model_parallel_size", int32_at_least(f.model_parallel_size, 1)},
      {"fsdp_config", "vocab_parallel", boolean(f.vocab_parallel)},
      {"fsdp_config", "checkpoint_interval", int_at_least(f.checkpoint_interval, 0)},
      {"fsdp_config", "checkpoint_dir", string(f.checkpoint_dir)},
      {"fsdp_config", "checkpoint_format", choice(f.checkpoint_format, {"fsdp", "dcp"})},
      {"fsdp_config", "collective_timeout_s",
       [&f](const YAML::Node& n) {
         if (n.IsNull()) return f.collective_timeout_s.reset();  // `key:` = the library's default
         const double v = to_double(n);
         std::ostringstream rule;
         rule << "must be in [0.001, " << kMaxCollectiveTimeoutS << "] seconds, got " << v;
         require(v >= 0.001 && v <= kMaxCollectiveTimeoutS, rule.str());
         f.collective_timeout_s = v;
       }},
      {"fsdp_config", "backend", choice(f.backend, {"auto", "gloo", "mpi"})},
      {"fsdp_config", "sharding_strategy",
       [&f](const YAML::Node& n) {
         std::string v = one_of(n, {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"});
         for (auto s : {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP, ShardingStrategy::NO_SHARD,
                        ShardingStrategy::HYBRID_SHARD, ShardingStrategy::HYBRID_SHARD_ZERO2})
           if (v == to_string(s)) f.sharding_strategy = s;
       }},
      {"fsdp_config", "replicate_degree",
       [&f](const YAML::Node& n) {
         if (n.IsNull()) return f.replicate_degree.reset();  // `key:` = the strategy's default
         int v = to_int32(n);
         require(v >= 1, "must be >= 1, got " + std::to_string(v));
         f.replicate_degree = v;
       }},
      {"fsdp_config", "reshard_after_forward",
       [&f](const YAML::Node& n) {
         if (n.IsNull()) return f.reshard_after_forward.reset();  // `key:` = the strategy's
         int v = to_int32(n);
         require(v >= 1, "must be a group size >= 1 (the strategy decides true or false), got " + std::to_string(v));
         f.reshard_after_forward = v;
       }},
      {"fsdp_config", "quantized_weights", optional_quantized_dtype(f.quantized_weights)},
      {"fsdp_config", "quantized_gradients", optional_quantized_dtype(f.quantized_gradients)},
      {"fsdp_config", "quantization_block_size",
       [&f](const YAML::Node& n) {
         const int v = to_int32(n);
         require(v >= 16 && v <= 4096, "must be 16 to 4096 elements per scale, got " + std::to_string(v));
         f.quantization_block_size = v;
       }},
      {"fsdp_config", "quantized_gradients_skip_zero_blocks", boolean(f.quantized_gradients_skip_zero_blocks)},
      {"fsdp_config", "diloco_inner_steps", int_at_least(f.diloco_inner_steps, 0)},
      {"fsdp_config", "diloco_outer_lr", number(f.diloco_outer_lr, 0.0, false)},
      {"fsdp_config", "diloco_outer_momentum",
       [&f](const YAML::Node& n) {
         const double v = to_double(n);
         require(v >= 0 && v < 1, "must be in [0, 1), got " + std::to_string(v));
         f.diloco_outer_momentum = v;
       }},
      {"fsdp_config", "diloco_fragments", int_at_least(f.diloco_fragments, 1)},
      {"fsdp_config", "diloco_quantized", optional_quantized_dtype(f.diloco_quantized)},

      {"model", "architecture", string(m.architecture)},  // a family of models/registry.cpp
      {"model", "hf_config", string(m.hf_config)},
      {"model", "preset", choice(m.preset, {"tiny", "small", "medium"})},
      {"model", "n_layers", opt_positive_int(m.n_layers)},
      {"model", "vocab_size", opt_positive_int(m.vocab_size)},
      {"model", "max_seq_len", opt_positive_int(m.max_seq_len)},
      {"model", "dim", opt_positive_int(m.dim)},
      {"model", "n_heads", opt_positive_int(m.n_heads)},
      {"model", "dropout_p", [&m](const YAML::Node& n) { m.dropout_p = to_beta(n); }},
      {"model", "init_from", string(m.init_from)},
      {"model", "freeze",
       [&m](const YAML::Node& n) {
         require(n.IsSequence() || n.IsNull(), "expected a list of parameter or module names, got " + shown(n));
         m.freeze.clear();
         for (const auto& entry : n) {
           std::string name = to_string_value(entry);
           require(!name.empty(), "expected a parameter or module name, got an empty one");
           m.freeze.push_back(name);
         }
       }},

      {"data", "source", choice(c.data.source, {"synthetic", "tokens"})},
      {"data", "path", string(c.data.path)},
      {"data", "data_seed", [&c](const YAML::Node& n) { c.data.data_seed = to_int(n); }},
      {"data", "tokenizer", string(c.data.tokenizer)},

      {"eval", "path", string(c.eval.path)},
      {"eval", "batches", int_at_least(c.eval.batches, 1)},
      {"eval", "interval", int_at_least(c.eval.interval, 0)},

      {"optimizer", "lr", number(o.lr, 0.0, false)},
      {"optimizer", "beta1", [&o](const YAML::Node& n) { o.beta1 = to_beta(n); }},
      {"optimizer", "beta2", [&o](const YAML::Node& n) { o.beta2 = to_beta(n); }},
      {"optimizer", "betas",
       [&o](const YAML::Node& n) {
         require(n.IsSequence(), "expected a list [beta1, beta2], got " + shown(n));
         require(n.size() == 2, "expected two values [beta1, beta2], got a list of " + std::to_string(n.size()) +
                                    (n.size() == 1 ? " value" : " values"));
         o.beta1 = to_beta(n[0]);
         o.beta2 = to_beta(n[1]);
       }},
      {"optimizer", "weight_decay", number(o.weight_decay, 0.0, true)},
      {"optimizer", "eps", number(o.eps, 0.0, false)},
      {"optimizer", "fused", boolean(c.optimizer.fused)},

      {"schedule", "warmup_steps", int_at_least(c.schedule.warmup_steps, 0)},
      {"schedule", "min_lr", number(c.schedule.min_lr, 0.0, true)},
      {"schedule", "decay_steps", int_at_least(c.schedule.decay_steps, 0)},

      {"training", "steps", int_at_least(t.steps, 1)},
      {"training", "micro_batch_size", int_at_least(t.micro_batch_size, 1)},
      {"training", "gradient_accumulation_steps", int_at_least(t.gradient_accumulation_steps, 1)},
      {"training", "seq_len", int_at_least(t.seq_len, 0)},
      {"training", "loss_chunks", int_at_least(t.loss_chunks, 1)},
      {"training", "max_grad_norm", number(t.max_grad_norm, 0.0, true)},
      {"training", "seed", [&t](const YAML::Node& n) { t.seed = to_int(n); }},
      {"training", "resume",
       [&t](const YAML::Node& n) {
         std::string v = to_string_value(n);
         require(!v.empty(), "expected auto, never or a checkpoint path, got nothing");
         t.resume = v;
       }},
      {"training", "allow_resume_mismatch", boolean(t.allow_resume_mismatch)},
      {"training", "keep_checkpoints", int_at_least(t.keep_checkpoints, 0)},
      {"training", "export",
       [&t](const YAML::Node& n) {
         std::string v = to_string_value(n);
         require(!v.empty(), "expected auto, none, hf, hf:<dir> or a path, got nothing");
         t.export_path = v;
       }},
      {"training", "export_dtype", choice(t.export_dtype, {"float32", "bfloat16", "float16"})},

      {"logging", "log_interval", int_at_least(c.logging.log_interval, 1)},
      {"logging", "jsonl", string(c.logging.jsonl)},
      {"logging", "trace", boolean(c.logging.trace)},
      {"logging", "progress", choice(c.logging.progress, {"auto", "on", "off"})},
      {"logging", "trace_dir", string(c.logging.trace_dir)},
      {"logging", "summary_json", string(c.logging.summary_json)},
      {"logging", "summary_warmup", int_at_least(c.logging.summary_warmup, 0)},
      {"logging", "tensorboard_dir", string(c.logging.tensorboard_dir)},

      {"sample", "length", int_at_least(c.sample.length, 0)},
      {"sample", "prompt", string(c.sample.prompt)},
      {"sample", "temperature", number(c.sample.temperature, 0.0, false)},
      {"sample", "seed", [&c](const YAML::Node& n) { c.sample.seed = to_int(n); }},
  };
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// " (did you mean 'x'?)" when some candidate is a plausible typo of name, else "".
std::string suggest(const std::string& name, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_d = std::max<size_t>(2, name.size() / 3) + 1;
  for (const auto& c : candidates) {
    size_t d = edit_distance(name, c);
    if (d < best_d) best_d = d, best = c;
  }
  return best.empty() ? "" : " (did you mean '" + best + "'?)";
}

// Loads and validates; `where` says where a value came from, for error messages.
class Loader {
 public:
  explicit Loader(TrainConfig& cfg) : fields_(fields_of(cfg)), origins_(&cfg.origins) {}

  // The keys of a section; throws when there is no such section.
  std::vector<std::string> keys_of(const std::string& section, const std::string& where) const {
    std::vector<std::string> sections, keys;
    for (const auto& f : fields_) {
      if (std::find(sections.begin(), sections.end(), f.section) == sections.end()) sections.push_back(f.section);
      if (f.section == section) keys.push_back(f.key);
    }
    if (keys.empty()) throw ConfigError(where + ": unknown section '" + section + "'" + suggest(section, sections));
    return keys;
  }

  void set(const std::string& section, const std::string& key, const YAML::Node& value, const std::string& where) {
    const auto keys = keys_of(section, where);
    for (const auto& f : fields_) {
      if (f.section != section || f.key != key) continue;
      try {
        f.set(value);
      } catch (const Invalid& e) {
        throw ConfigError(where + ": " + section + "." + key + ": " + e.msg);
      }
      (*origins_)[section + "." + key] = where;  // the last one set wins, as the value does
      return;
    }
    throw ConfigError(where + ": unknown key '" + section + "." + key + "'" + suggest_key(section, key, keys));
  }

  // " (did you mean ...?)": the key of that name in other sections (logging.log_interval for
  // training.log_interval), else a near miss in the section, else one in any section.
  std::string suggest_key(const std::string& section, const std::string& key,
                          const std::vector<std::string>& keys) const {
    std::vector<std::string> same_name, everywhere;
    for (const auto& f : fields_) {
      if (f.key == key && f.section != section) same_name.push_back("'" + f.section + "." + f.key + "'");
      everywhere.push_back(f.section + "." + f.key);
    }
    if (!same_name.empty()) {
      std::string list;
      for (const auto& n : same_name) list += (list.empty() ? "" : " or ") + n;
      return " (did you mean " + list + "? it is in another section)";
    }
    const std::string near = suggest(key, keys);
    return near.empty() ? suggest(section + "." + key, everywhere) : near;
  }

 private:
  std::vector<Field> fields_;
  std::map<std::string, std::string>* origins_;
};

std::string at(const std::string& file, const YAML::Node& n) { return file + ":" + std::to_string(n.Mark().line + 1); }

// A config is a few kilobytes; the cap stops `fsdp-train /dev/zero` or a wrong path to a data
// file from reading until memory runs out.
constexpr size_t kMaxConfigBytes = size_t{1} << 20;

// The whole file, or ConfigError naming it (missing, a directory, not a file, too large, unreadable).
std::string read_config_text(const std::string& path) {
  try {
    ReadFileLimits limits;
    limits.max_bytes = kMaxConfigBytes;
    limits.too_large = path + ": the config file is larger than " + std::to_string(kMaxConfigBytes >> 20) +
                       " MiB; a config is a few kilobytes of YAML: is it the file you meant?";
    limits.not_regular = path + ": is not a regular file (a device, socket or the like); give a YAML config file";
    return read_file(path,
                     {path + ": is a directory, not a config file", path + ": cannot open config file",
                      path + ": reading the config file failed"},
                     limits);
  } catch (const std::runtime_error& e) {
    throw ConfigError(e.what());
  }
}

// Quoted values that do not end on their line. yaml-cpp accepts a quoted scalar running over
// several lines, so a forgotten closing quote silently swallows the keys below it (or fails
// far below). This scanner knows just enough YAML to find where a quoted scalar starts:
// comments, flow collections and block scalars (| and >, whose text is not YAML syntax).
class QuoteScanner {
 public:
  // The 1-based line of the first quote left open at the end of its line; 0 when none is.
  static size_t unclosed_quote_line(const std::string& text) {
    QuoteScanner s;
    std::istringstream in(text);
    std::string line;
    for (size_t number = 1; std::getline(in, line); ++number)
      if (s.line_leaves_quote_open(line)) return number;
    return 0;
  }

 private:
  static bool blank(char c) { return c == ' ' || c == '\t' || c == '\r'; }
  static bool ends_token(const std::string& line, size_t i) { return i + 1 >= line.size() || blank(line[i + 1]); }

  bool line_leaves_quote_open(const std::string& line) {
    const size_t indent = line.find_first_not_of(" \t\r");                                   // npos: a blank line
    if (in_block_ && (indent == std::string::npos || indent > block_indent_)) return false;  // block text
    in_block_ = false;
    bool at_value_start = true;
    for (size_t i = 0; i < line.size(); ++i) {
      const char c = line[i];
      if (blank(c)) continue;
      if (c == '#' && (i == 0 || blank(line[i - 1]))) break;  // a comment
      if (at_value_start && (c == '"' || c == '\'')) {
        i = closing_quote(line, i);
        if (i == std::string::npos) return true;
        at_value_start = false;
      } else if (at_value_start && (c == '|' || c == '>')) {
        in_block_ = true, block_indent_ = indent;
        return false;  // the indicator's options and comment: nothing quoted
      } else {
        at_value_start = value_may_follow(line, i, at_value_start);
      }
    }
    return false;
  }

  // Whether a value may start after line[i]: after a flow bracket or comma, a key's ': ', a
  // sequence's '- ' or a complex key's '? '. Inside a plain scalar, quotes are ordinary characters.
  bool value_may_follow(const std::string& line, size_t i, bool at_value_start) {
    const char c = line[i];
    if ((c == '[' || c == '{') && (at_value_start || flow_depth_ > 0)) return ++flow_depth_, true;
    if (flow_depth_ > 0 && (c == ']' || c == '}')) return --flow_depth_, false;
    if (flow_depth_ > 0 && c == ',') return true;
    return (c == ':' || ((c == '-' || c == '?') && at_value_start)) && ends_token(line, i);
  }

  // The index of the quote closing the one at `open`, or npos when the line ends first.
  static size_t closing_quote(const std::string& line, size_t open) {
    const char q = line[open];
    for (size_t i = open + 1; i < line.size(); ++i) {
      if (q == '"' && line[i] == '\\') ++i;  // an escape: skip the next character
      else if (q == '\'' && line[i] == q && i + 1 < line.size() && line[i + 1] == q) ++i;  // ''
      else if (line[i] == q) return i;
    }
    return std::string::npos;
  }

  int flow_depth_ = 0;
  bool in_block_ = false;
  size_t block_indent_ = 0;
};

YAML::Node parse_yaml(const std::string& path, const std::string& text) {
  if (const size_t line = QuoteScanner::unclosed_quote_line(text))
    throw ConfigError(path + ":" + std::to_string(line) +
                      ": invalid YAML: a quoted value starts on this line and is not closed on it "
                      "(close the quote; write \\n for a newline inside a value)");
  try {
    return YAML::Load(text);
  } catch (const YAML::DeepRecursion& e) {
    throw ConfigError(path + ":" + std::to_string(e.mark.line + 1) + ": invalid YAML: nested deeper than " +
                      std::to_string(e.depth()) + " levels");
  } catch (const YAML::Exception& e) {
    throw ConfigError(path + ":" + std::to_string(e.mark.line + 1) + ": invalid YAML: " + e.msg);
  }
}

// A mapping's key as text; ConfigError when it is a list or mapping (YAML's complex keys).
std::string key_name(const std::string& path, const YAML::Node& key, const std::string& what) {
  if (!key.IsScalar() && !key.IsNull())
    throw ConfigError(at(path, key) + ": expected a " + what + " name, got " + shown(key));
  return key.IsNull() ? std::string() : key.Scalar();
}

// Names already seen in one mapping, with their lines: a second one is an error naming both.
class SeenNames {
 public:
  void add(const std::string& path, const YAML::Node& key, const std::string& name, const std::string& what) {
    const int line = key.Mark().line + 1;
    const auto [it, inserted] = lines_.emplace(name, line);
    if (!inserted)
      throw ConfigError(path + ":" + std::to_string(line) + ": " + what + " '" + name + "' is given twice (lines " +
                        std::to_string(it->second) + " and " + std::to_string(line) + "); keep one");
  }

 private:
  std::map<std::string, int> lines_;
};

void load_section(Loader& loader, const std::string& path, const std::string& section, const YAML::Node& keys) {
  SeenNames seen;
  for (const auto& kv : keys) {
    const std::string key = key_name(path, kv.first, "key");
    seen.add(path, kv.first, section + "." + key, "key");
    loader.set(section, key, kv.second, at(path, kv.first));
  }
}

// Returns the file's text (a pipe can be read once only).
std::string load_file(Loader& loader, const std::string& path) {
  std::string text = read_config_text(path);
  const YAML::Node root = parse_yaml(path, text);
  // An empty file (or only comments) is more often a wrong or truncated file than a wish for
  // the defaults, which running without a config file gives.
  if (root.IsNull())
    throw ConfigError(path +
                      ": the config file is empty (no sections); is it the file you meant? To train on the "
                      "built-in defaults, give no config file (fsdp-train --section.key=value ...)");
  if (!root.IsMap()) throw ConfigError(path + ": expected a mapping of sections at the top level");
  SeenNames seen;
  for (const auto& sec : root) {
    const std::string section = key_name(path, sec.first, "section");
    loader.keys_of(section, at(path, sec.first));  // an unknown section, whatever its shape
    seen.add(path, sec.first, section, "section");
    if (sec.second.IsNull()) continue;  // `section:` with nothing under it
    if (!sec.second.IsMap()) {
      throw ConfigError(at(path, sec.first) + ": " + section + ": expected a mapping of keys");
    }
    load_section(loader, path, section, sec.second);
  }
  return text;
}

void apply_override(Loader& loader, const std::string& arg) {
  const std::string where = "command line (" + arg + ")";
  const auto eq = arg.find('=');
  const auto dot = arg.find('.');
  if (arg.rfind("--", 0) != 0 || eq == std::string::npos || dot == std::string::npos || dot > eq)
    throw ConfigError(where + ": expected --section.key=value");
  const std::string section = arg.substr(2, dot - 2), key = arg.substr(dot + 1, eq - dot - 1);
  YAML::Node value;
  try {
    value = YAML::Load(arg.substr(eq + 1));
  } catch (const YAML::Exception& e) {
    throw ConfigError(where + ": " + section + "." + key + ": invalid value: " + e.msg);
  }
  loader.set(section, key, value, where);
}

}  // namespace

std::string origin_of(const TrainConfig& cfg, const std::string& key) {
  const auto it = cfg.origins.find(key);
  return it == cfg.origins.end() ? std::string() : it->second;
}

bool built_with_sentencepiece() { return FSDP_WITH_SENTENCEPIECE != 0; }

std::string without_sentencepiece(const std::string& key, const std::string& model) {
  std::string msg = key + ": " + model +
                    " needs SentencePiece, which this fsdp-train was built without (FSDP_WITH_SENTENCEPIECE=OFF, "
                    "or AUTO without the package): install libsentencepiece-dev (scripts/install-deps.sh) and "
                    "reconfigure with -DFSDP_WITH_SENTENCEPIECE=ON";
  if (key == "data.tokenizer") msg += ", or leave data.tokenizer unset (the sample is then printed as token ids)";
  return msg;
}

TrainConfig load_config(const std::string& yaml_path, const std::vector<std::string>& overrides) {
  TrainConfig cfg;
  Loader loader(cfg);
  if (!yaml_path.empty()) cfg.source.text = load_file(loader, yaml_path);
  for (const auto& o : overrides) apply_override(loader, o);
  cfg.source.path = yaml_path;
  cfg.source.overrides = overrides;
  // The rules across keys that need no model knowledge.
  const std::string where = yaml_path.empty() ? std::string("command line") : yaml_path;
  if (cfg.data.source == "tokens" && cfg.data.path.empty())
    throw ConfigError(where + ": data.path: required when data.source is tokens");
  if (cfg.eval.interval > 0 && cfg.eval.path.empty())
    throw ConfigError(where + ": eval.path: required when eval.interval is set (" + std::to_string(cfg.eval.interval) +
                      "): the token file to evaluate on");
  if (!cfg.data.tokenizer.empty() && !built_with_sentencepiece())
    throw ConfigError(where + ": " + without_sentencepiece("data.tokenizer", cfg.data.tokenizer));
  if (cfg.schedule.min_lr > cfg.optimizer.lr) {
    std::ostringstream msg;
    msg << where << ": schedule.min_lr (" << cfg.schedule.min_lr << ") must not exceed optimizer.lr ("
        << cfg.optimizer.lr << ")";
    throw ConfigError(msg.str());
  }
  return cfg;
}

namespace {

// Why the run cannot compute in fp16 (empty when it can). fp16 parameters alone
// (param_dtype: float16) run anywhere: LibTorch 2.x has fp16 matmuls on CPU. fp16: true is the GPU
// recipe, fp16 compute with a gradient scaler (fsdp::GradScaler), and runs on device: cuda only.
std::vector<std::string> fp16_compute_problems(const FsdpConfig& f) {
  std::vector<std::string> bad;
  if (f.fp16 && f.device != "cuda")
    bad.push_back(
        "fsdp_config.fp16: true (fp16 compute with a gradient scaler) is not supported on device: " + f.device +
        ": loss scaling exists for the GPU's fp16 tensor cores, while a CPU computes fp16 no faster than bf16, "
        "whose fp32 range needs no scaler; use fsdp_config.mixed_precision: true (bf16 parameters, fp32 "
        "reductions) or fsdp_config.param_dtype: float16 without a scaler, or device: cuda on a GPU");
  return bad;
}

}  // namespace

bool steps_with_device_state_adamw(const TrainConfig& cfg) {
  const FsdpConfig& f = cfg.fsdp_config;
  return f.device == "cuda" && f.offload_params && !f.offload_optimizer_state;
}

void check_supported(const TrainConfig& cfg, const DeviceSupport& devices) {
  const auto& f = cfg.fsdp_config;
  std::vector<std::string> bad = fp16_compute_problems(f);
  auto no = [&](bool unsupported, const std::string& what) {
    if (unsupported) bad.push_back(what + " is not supported yet");
  };
  no(!f.shard_optimizer_state, "fsdp_config.shard_optimizer_state: false (FSDP2 always shards it)");
  if (f.activation_checkpointing && !f.use_reentrant) {
    bad.push_back(
        "fsdp_config.use_reentrant: false with fsdp_config.activation_checkpointing: true is not "
        "supported: non-reentrant checkpointing needs saved-tensor hooks, which LibTorch's C++ API does "
        "not have; set fsdp_config.use_reentrant: true");
  }
  if (f.output_head_group && f.sharding_strategy == ShardingStrategy::NO_SHARD) {
    bad.push_back(
        "fsdp_config.output_head_group: true with fsdp_config.sharding_strategy: NO_SHARD is not "
        "supported: NO_SHARD replicates the whole model (fsdp::replicate) and has no FSDP groups; "
        "use a sharded strategy or output_head_group: false");
  }
  if (f.prefetch_depth > 1 && f.sharding_strategy == ShardingStrategy::NO_SHARD) {
    bad.push_back("fsdp_config.prefetch_depth: " + std::to_string(f.prefetch_depth) +
                  " with fsdp_config.sharding_strategy: NO_SHARD is not supported: NO_SHARD has no FSDP groups to "
                  "all-gather ahead; use a sharded strategy or prefetch_depth: 1");
  }
  if (f.reduce_scatter_max_input_buffers > 1 && f.sharding_strategy == ShardingStrategy::NO_SHARD) {
    bad.push_back(
        "fsdp_config.reduce_scatter_max_input_buffers: " + std::to_string(f.reduce_scatter_max_input_buffers) +
        " with fsdp_config.sharding_strategy: NO_SHARD is not supported: NO_SHARD all-reduces buckets "
        "and has no reduce-scatters; use a sharded strategy or reduce_scatter_max_input_buffers: 1");
  }
  if (f.output_head_group && f.model_parallel_size > 1) {
    bad.push_back("fsdp_config.output_head_group: true with fsdp_config.model_parallel_size: " +
                  std::to_string(f.model_parallel_size) +
                  " is not supported yet: the tensor-parallel model shards its head with the root; "
                  "set output_head_group: false or model_parallel_size: 1");
  }
  // On cpu device memory is host memory, so every pair of offload keys means the same placement
  // (the trainer says so once). On cuda, parameters offloaded with the optimizer state kept on
  // the GPU is DeviceStateAdamW; the optimizer state offloaded without the parameters is not built.
  if (f.device == "cuda" && f.offload_optimizer_state && !f.offload_params) {
    bad.push_back(
        "fsdp_config.offload_optimizer_state: true with fsdp_config.offload_params: false is not supported yet "
        "on device: cuda: the optimizer steps where the sharded parameters live; offload both, or the "
        "parameters alone (offload_params: true, offload_optimizer_state: false keeps the state on the GPU)");
  }
  if (steps_with_device_state_adamw(cfg) && cfg.optimizer.fused) {
    bad.push_back(
        "optimizer.fused: true with fsdp_config.offload_params: true and offload_optimizer_state: false is not "
        "supported on device: cuda: AdamW steps on the GPU there (DeviceStateAdamW), and FusedAdamW's pass is "
        "a CPU pass; set optimizer.fused: false, or offload_optimizer_state: true to step on the host");
  }
  if (f.model_parallel_size > 1 && f.sharding_strategy != ShardingStrategy::FULL_SHARD &&
      f.sharding_strategy != ShardingStrategy::SHARD_GRAD_OP) {
    bad.push_back("fsdp_config.model_parallel_size: " + std::to_string(f.model_parallel_size) +
                  " (> 1) with fsdp_config.sharding_strategy: " + to_string(f.sharding_strategy) +
                  " is not supported yet; tensor parallelism combines with FULL_SHARD or SHARD_GRAD_OP");
  }
  if (f.device == "cuda" && !devices.cuda)
    bad.push_back("fsdp_config.device: cuda needs a GPU, and " + devices.why_no_cuda + "; use device: cpu");
  if (f.device == "cuda" && f.sharding_strategy == ShardingStrategy::NO_SHARD)
    bad.push_back(
        "fsdp_config.device: cuda with fsdp_config.sharding_strategy: NO_SHARD is not supported yet "
        "(replicate's buckets are host memory); use FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD on a GPU");
  if (f.reshard_after_forward && f.sharding_strategy != ShardingStrategy::FULL_SHARD &&
      f.sharding_strategy != ShardingStrategy::HYBRID_SHARD) {
    bad.push_back("fsdp_config.reshard_after_forward: " + std::to_string(*f.reshard_after_forward) +
                  " with fsdp_config.sharding_strategy: " + to_string(f.sharding_strategy) +
                  " is not supported: only a strategy that reshards after forward (FULL_SHARD, HYBRID_SHARD) takes a "
                  "group size; unset the key");
  }
  const bool hybrid = f.sharding_strategy == ShardingStrategy::HYBRID_SHARD ||
                      f.sharding_strategy == ShardingStrategy::HYBRID_SHARD_ZERO2;
  if (f.quantized_gradients && !hybrid)
    bad.push_back("fsdp_config.quantized_gradients: " + *f.quantized_gradients +
                  " with fsdp_config.sharding_strategy: " + to_string(f.sharding_strategy) +
                  " is not supported: it quantizes the all-reduce between replicas, which only HYBRID_SHARD and "
                  "HYBRID_SHARD_ZERO2 have; for the reduce-scatter use fsdp_config.reduce_dtype: bfloat16");
  if (f.quantized_gradients_skip_zero_blocks && (!f.quantized_gradients || *f.quantized_gradients == "bfloat16"))
    bad.push_back(
        "fsdp_config.quantized_gradients_skip_zero_blocks: true needs fsdp_config.quantized_gradients: "
        "int8 or float8_e4m3 (blocks with scales), but it is " +
        f.quantized_gradients.value_or("unset") + "; set one, or unset the key");
  if (f.quantized_weights && f.sharding_strategy == ShardingStrategy::NO_SHARD)
    bad.push_back("fsdp_config.quantized_weights with sharding_strategy: NO_SHARD: nothing is all-gathered; unset it");
  if (f.diloco_inner_steps > 0) {
    const std::string key = "fsdp_config.diloco_inner_steps: " + std::to_string(f.diloco_inner_steps);
    if (!hybrid)
      bad.push_back(key +
                    " needs sharding_strategy: HYBRID_SHARD or HYBRID_SHARD_ZERO2 (the replicas are the "
                    "replicate dim), not " +
                    to_string(f.sharding_strategy));
    if (f.quantized_gradients)
      bad.push_back(key +
                    " with fsdp_config.quantized_gradients: DiLoCo replicas reduce no gradients between "
                    "them; use fsdp_config.diloco_quantized for the outer step");
    if (f.checkpoint_interval > 0 || cfg.training.export_path != "none")
      bad.push_back(key +
                    " with checkpoints or an export is not supported yet: the outer state (the parameters "
                    "at the last outer step and the outer momentum) is not saved; set "
                    "fsdp_config.checkpoint_interval: 0 and training.export: none");
    if (f.model_parallel_size > 1) bad.push_back(key + " with model_parallel_size > 1 is not supported yet");
    if (f.diloco_fragments > f.diloco_inner_steps)
      bad.push_back("fsdp_config.diloco_fragments: " + std::to_string(f.diloco_fragments) +
                    " must be at most diloco_inner_steps (" + std::to_string(f.diloco_inner_steps) + ")");
  }
  if (f.sharding_strategy == ShardingStrategy::NO_SHARD) {
    // fsdp::replicate keeps whole fp32 parameters on the device and has no policies.
    if (f.mixed_precision || f.param_dtype || f.reduce_dtype)
      bad.push_back(
          "fsdp_config.mixed_precision / param_dtype / reduce_dtype with fsdp_config.sharding_strategy: "
          "NO_SHARD is not supported yet (replicate has no mixed-precision policy); use FULL_SHARD or "
          "HYBRID_SHARD for mixed precision, or train NO_SHARD in fp32");
    if (f.offload_params)
      bad.push_back(
          "fsdp_config.offload_params: true with fsdp_config.sharding_strategy: NO_SHARD is not "
          "supported (replicate keeps whole parameters on the device); use FULL_SHARD or HYBRID_SHARD");
  }
  if (bad.empty()) return;
  std::string msg = "unsupported configuration:";
  for (const auto& b : bad) msg += "\n  " + b;
  throw ConfigError(msg);
}

void check_against_launcher(const TrainConfig& cfg, int env_world_size, int env_local_rank) {
  const auto& f = cfg.fsdp_config;
  if (f.world_size > 0 && f.world_size != env_world_size)
    throw ConfigError("fsdp_config.world_size is " + std::to_string(f.world_size) + " but the launcher started " +
                      std::to_string(env_world_size) + " processes (WORLD_SIZE)");
  if (f.local_rank > 0 && f.local_rank != env_local_rank)
    throw ConfigError("fsdp_config.local_rank is " + std::to_string(f.local_rank) +
                      " but the launcher gave this process LOCAL_RANK " + std::to_string(env_local_rank));
}

bool reshard_after_forward(const TrainConfig& cfg) {
  switch (cfg.fsdp_config.sharding_strategy) {
    case ShardingStrategy::FULL_SHARD:
    case ShardingStrategy::HYBRID_SHARD: return true;
    case ShardingStrategy::SHARD_GRAD_OP:
    case ShardingStrategy::HYBRID_SHARD_ZERO2: return false;
    case ShardingStrategy::NO_SHARD: break;
  }
  throw ConfigError(std::string("fsdp_config.sharding_strategy: ") + to_string(cfg.fsdp_config.sharding_strategy) +
                    " does not shard, so it has no reshard_after_forward");
}

void check_model_parallel(const TrainConfig& cfg, int world, int64_t n_heads, int64_t dim, int64_t vocab_size) {
  const int k = cfg.fsdp_config.model_parallel_size;
  if (k == 1) return;
  const std::string key = "fsdp_config.model_parallel_size: " + std::to_string(k);
  if (world % k != 0)
    throw ConfigError(key + " does not divide the world of " + std::to_string(world) +
                      " rank(s); the ranks form a "
                      "(world / model_parallel_size, model_parallel_size) mesh");
  if (n_heads % k != 0)
    throw ConfigError(key + " does not divide model.n_heads: " + std::to_string(n_heads) +
                      "; each tensor-parallel rank computes whole heads");
  if (dim % k != 0) throw ConfigError(key + " does not divide model.dim: " + std::to_string(dim));
  if (cfg.fsdp_config.vocab_parallel && vocab_size % k != 0)
    throw ConfigError(key + " with fsdp_config.vocab_parallel: true (the default) does not divide model.vocab_size: " +
                      std::to_string(vocab_size) + "; each tensor-parallel rank holds vocab_size / " +
                      std::to_string(k) +
                      " rows of the embedding and the output head, so choose a vocab_size it "
                      "divides or set fsdp_config.vocab_parallel: false");
}

void check_reshard_group(const TrainConfig& cfg, const DataParallelShape& shape) {
  const std::optional<int>& k = cfg.fsdp_config.reshard_after_forward;
  if (!k || shape.shard % *k == 0) return;
  throw ConfigError("fsdp_config.reshard_after_forward: " + std::to_string(*k) + " does not divide the " +
                    std::to_string(shape.shard) + " rank(s) each parameter is sharded over; choose a divisor of " +
                    std::to_string(shape.shard) + " (it is the group that all-gathers in backward)");
}

DataParallelShape data_parallel_shape(const TrainConfig& cfg, int world, int local_world) {
  const auto& f = cfg.fsdp_config;
  if (f.model_parallel_size > 1) world /= f.model_parallel_size;  // the data-parallel ranks
  const std::string strategy = to_string(f.sharding_strategy);
  const std::optional<int>& degree = f.replicate_degree;
  const auto wrong = [&](const std::string& rule) {
    return ConfigError("fsdp_config.replicate_degree: " + std::to_string(*degree) + " with sharding_strategy " +
                       strategy + " at a world of " + std::to_string(world) + " rank(s): " + rule);
  };
  switch (f.sharding_strategy) {
    case ShardingStrategy::FULL_SHARD:
    case ShardingStrategy::SHARD_GRAD_OP:
      if (degree && *degree != 1)
        throw wrong(
            "these strategies shard over every rank, so it must be 1 (or unset); use HYBRID_SHARD to "
            "replicate");
      return {1, world, false};
    case ShardingStrategy::NO_SHARD:
      if (degree && *degree != world)
        throw wrong(
            "NO_SHARD replicates the model on every rank, so it must equal the world size (or be unset); "
            "use HYBRID_SHARD to shard within replicas");
      return {world, 1, false};
    case ShardingStrategy::HYBRID_SHARD:
    case ShardingStrategy::HYBRID_SHARD_ZERO2: {
      const int nodes = local_world > 0 && world % local_world == 0 ? world / local_world : 1;
      const int replicate = degree ? *degree : nodes;
      if (degree && (replicate > world || world % replicate != 0))
        throw wrong("it must divide the world size (each replica shards over world / replicate_degree ranks)");
      return {replicate, world / replicate, true};
    }
  }
  throw ConfigError("fsdp_config.sharding_strategy: unknown value");
}

}  // namespace train
}  // namespace fsdp
