// train_matrix.cpp — every option for every model family, at W = 2: each cell of
// (family x sharding strategy x activation checkpointing x mixed precision x CPU offload), and the
// output head group and tensor parallelism beside them, trains 3 AdamW steps through the
// trainer's own set-up (the family the registry chooses, parallelize_model, forward_loss) on the
// same global batches. A cell's global losses must equal those of its family's reference cell
// (FULL_SHARD, no checkpointing, the same precision, no offload): 1e-5 relative in fp32, 2e-2 in
// bf16. A cell the trainer does not support must be refused at configuration time by an error
// that names its keys; no cell may be refused otherwise, nor accepted when it is expected to be
// refused. Prints one line per cell; exits 1 when any cell fails.
//
//   fsdprun --standalone --nproc-per-node 2 build/tests/train/fsdp_train_matrix [family ...]
#include "common/agreement.h"
#include "common/errors.h"
#include "config/config.h"
#include "models/model_setup.h"
#include "models/registry.h"

#include <fsdp/distributed.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

namespace {

using namespace fsdp::train;

constexpr int kSteps = 3;
constexpr int64_t kSeq = 8, kGlobalRows = 4;  // each data-parallel rank its share of the rows

const std::vector<std::string> kStrategies = {"FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2",
                                              "NO_SHARD"};

struct Cell {
  std::string family;
  std::string strategy = "FULL_SHARD";
  bool checkpointing = false, bf16 = false, offload = false, head_group = false;
  int tp = 1;

  std::string name() const {
    std::string n = family + " " + strategy;
    if (checkpointing) n += " +AC";
    n += bf16 ? " bf16" : " fp32";
    if (offload) n += " +offload";
    if (head_group) n += " +head_group";
    if (tp > 1) n += " +tp" + std::to_string(tp);
    return n;
  }
  std::vector<std::string> overrides() const {
    std::vector<std::string> o = {
        "--fsdp_config.sharding_strategy=" + strategy,
        "--fsdp_config.activation_checkpointing=" + std::string(checkpointing ? "true" : "false"),
        "--fsdp_config.mixed_precision=" + std::string(bf16 ? "true" : "false"),
        "--fsdp_config.offload_params=" + std::string(offload ? "true" : "false"),
        "--fsdp_config.output_head_group=" + std::string(head_group ? "true" : "false"),
        "--fsdp_config.model_parallel_size=" + std::to_string(tp)};
    return o;
  }
  // The keys the trainer's refusal must name; "" when the cell must train.
  std::string refusal() const {
    if (strategy == "NO_SHARD" && bf16) return "fsdp_config.mixed_precision";
    if (strategy == "NO_SHARD" && offload) return "fsdp_config.offload_params";
    if (tp > 1 && strategy != "FULL_SHARD" && strategy != "SHARD_GRAD_OP") return "fsdp_config.model_parallel_size";
    if (tp > 1 && family == "gpt2") return "fsdp_config.model_parallel_size";  // no tp plan yet
    return "";
  }
};

// A small config.json of the Llama family (GQA, untied), written once per run.
std::string llama_config_json(const std::string& dir) {
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/config.json";
  std::ofstream(path) << R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16,
  "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
  "max_position_embeddings": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": false})";
  return path;
}

// A small config.json of GPT-2 (untied, so that the head may be a group of its own; no dropout).
std::string gpt2_config_json(const std::string& dir) {
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/config.json";
  std::ofstream(path) << R"({"architectures": ["GPT2LMHeadModel"], "vocab_size": 32, "n_embd": 16, "n_layer": 2,
  "n_head": 4, "n_positions": 16, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "resid_pdrop": 0.0,
  "tie_word_embeddings": false})";
  return path;
}

// The families the matrix knows how to shape small; a registered family missing here fails the
// matrix, so that a new family gets its cells.
const std::vector<std::string> kFamilies = {"transformer", "llama", "gpt2"};

std::vector<std::string> family_overrides(const std::string& family, const std::string& scratch) {
  const std::vector<std::string> common = {"--training.seq_len=" + std::to_string(kSeq),
                                           "--training.micro_batch_size=" + std::to_string(kGlobalRows / 2),
                                           "--training.seed=3", "--data.source=synthetic"};
  std::vector<std::string> o = {"--model.architecture=" + family};
  if (family == "llama") o.push_back("--model.hf_config=" + llama_config_json(scratch + "/llama"));
  else if (family == "gpt2") o.push_back("--model.hf_config=" + gpt2_config_json(scratch + "/gpt2"));
  else
    o.insert(o.end(), {"--model.n_layers=2", "--model.dim=16", "--model.n_heads=4", "--model.vocab_size=32",
                       "--model.max_seq_len=16", "--model.dropout_p=0"});
  o.insert(o.end(), common.begin(), common.end());
  return o;
}

// The cell trained kSteps steps: the global loss of each step (the mean over the data-parallel
// ranks' local losses), or the refusal's text.
struct Outcome {
  std::vector<double> losses;
  std::string refused;
};

Outcome train_cell(const Cell& cell, const std::string& scratch, int local_world) {
  std::vector<std::string> overrides = family_overrides(cell.family, scratch);
  for (const auto& o : cell.overrides()) overrides.push_back(o);
  Outcome out;
  TrainConfig cfg;
  std::unique_ptr<const ModelFamily> family;
  int64_t seq = 0;
  try {
    cfg = load_config("", overrides);
    check_supported(cfg, device_support_for(cfg));
    family = choose_family(cfg);
    seq = seq_len_of(cfg, *family);
  } catch (const ConfigError& e) {
    out.refused = e.what();
    return out;
  }
  ParallelModel pm = parallelize_model(cfg, *family, precision_of(cfg.fsdp_config), local_world);
  torch::optim::AdamW optimizer(pm.parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  const int64_t vocab = family->shape().vocab_size;
  const int64_t rows = kGlobalRows / pm.dp_world;
  for (int step = 0; step < kSteps; ++step) {
    at::Generator gen = at::detail::createCPUGenerator(static_cast<uint64_t>(100 + step));
    const at::Tensor batch = at::randint(vocab, {kGlobalRows, seq + 1}, gen, at::kLong);
    const at::Tensor mine = batch.narrow(0, pm.dp_rank * rows, rows);
    const at::Tensor inputs = mine.narrow(1, 0, seq).contiguous(), targets = mine.narrow(1, 1, seq).contiguous();
    at::Tensor loss = pm.forward_loss(inputs, targets, 1);
    loss.backward();
    optimizer.step();
    optimizer.zero_grad();
    // Each data-parallel rank's loss is the mean over its rows (as many on every rank); the tp
    // ranks of one dp rank agree. Their mean is the global batch's.
    const std::vector<double> all = all_gather_numbers({loss.item<double>()});
    double sum = 0;
    for (double v : all) sum += v;
    out.losses.push_back(sum / static_cast<double>(all.size()));
  }
  return out;
}

std::vector<Cell> cells_of(const std::string& family) {
  std::vector<Cell> cells;
  for (bool bf16 : {false, true})
    for (const std::string& strategy : kStrategies)
      for (bool checkpointing : {false, true})
        for (bool offload : {false, true}) {
          Cell c{family, strategy, checkpointing, bf16, offload};
          cells.push_back(c);
        }
  for (const char* strategy : {"FULL_SHARD", "HYBRID_SHARD"}) {
    Cell c{family, strategy};
    c.head_group = true;
    cells.push_back(c);
  }
  for (const char* strategy : {"FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"}) {
    Cell c{family, strategy};
    c.tp = 2;
    cells.push_back(c);
  }
  return cells;
}

std::string losses_text(const std::vector<double>& v) {
  std::ostringstream s;
  s.precision(9);
  for (double x : v) s << (s.tellp() > 0 ? " " : "") << x;
  return s.str();
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> families;
  for (int i = 1; i < argc; ++i) families.push_back(argv[i]);
  if (families.empty()) families = family_names();
  for (const std::string& f : families)
    if (std::find(kFamilies.begin(), kFamilies.end(), f) == kFamilies.end()) {
      std::cerr << "fsdp_train_matrix: family " << f << " has no small configuration here; add it to kFamilies\n";
      return 1;
    }
  try {
    const fsdp::RendezvousInfo env = fsdp::rendezvous_info_from_env();
    fsdp::init_process_group(env);
    const int rank = fsdp::get_rank();
    const std::string scratch =
        (std::filesystem::temp_directory_path() / ("fsdp_train_matrix_" + std::to_string(::getpid()))).string();
    int failed = 0, cells = 0;
    for (const std::string& family : families) {
      std::optional<Outcome> reference[2];  // fp32, bf16
      for (const Cell& cell : cells_of(family)) {
        ++cells;
        const Outcome o = train_cell(cell, scratch, env.local_world_size);
        std::string verdict = "ok";
        const std::string expected = cell.refusal();
        if (!expected.empty()) {
          if (o.refused.empty()) verdict = "FAILED: trained, but the trainer should refuse it naming " + expected;
          else if (o.refused.find(expected) == std::string::npos)
            verdict = "FAILED: refused without naming " + expected + ": " + o.refused;
          else verdict = "refused as expected (" + expected + ")";
        } else if (!o.refused.empty()) {
          verdict = "FAILED: refused: " + o.refused;
        } else {
          std::optional<Outcome>& ref = reference[cell.bf16 ? 1 : 0];
          if (!ref) ref = o;  // the first cell of each precision is FULL_SHARD without options
          const double tolerance = cell.bf16 ? 2e-2 : 1e-5;
          for (int s = 0; s < kSteps; ++s) {
            const double want = ref->losses[static_cast<size_t>(s)], got = o.losses[static_cast<size_t>(s)];
            if (!std::isfinite(got) || std::abs(got - want) > tolerance * std::abs(want)) {
              verdict = "FAILED: step " + std::to_string(s + 1) + " loss " + std::to_string(got) + " against " +
                        std::to_string(want) + " (FULL_SHARD's)";
              break;
            }
          }
          verdict += "  losses " + losses_text(o.losses);
        }
        if (verdict.rfind("FAILED", 0) == 0) ++failed;
        if (rank == 0) std::cout << "matrix: " << cell.name() << ": " << verdict << "\n" << std::flush;
      }
    }
    std::filesystem::remove_all(scratch);
    if (rank == 0) std::cout << "matrix: " << cells << " cells, " << failed << " failed\n";
    return failed == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "fsdp_train_matrix: " << error_text(e) << "\n";
    return 1;
  }
}
