// `fsdp-train plan` end to end: its predicted peak tensor bytes against what the trainer reports
// for the same configuration, the keys it refuses, a GPU configuration's two memories, and the
// largest model that fits.
#include "process_harness.h"
#include "trainer_runs.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <string>
#include <vector>

using namespace process_test;
using namespace trainer_test;

namespace {

// A model with enough activations that the peak is not noise: dim 64, seq 64, vocab 512.
std::vector<std::string> config(const std::vector<std::string>& more) {
  return with({configs_dir() + "/tiny.yaml", "--model.dim=64", "--model.max_seq_len=64", "--model.vocab_size=512",
               "--training.seq_len=64", "--training.micro_batch_size=4"},
              more);
}

// configs/llama.yaml (a Llama of GQA, SwiGLU and a tied head, micro-batch 8 x 128) on synthetic
// tokens, its config.json found wherever the test runs.
std::vector<std::string> llama_config(const std::vector<std::string>& more) {
  return with({configs_dir() + "/llama.yaml", "--model.hf_config=" + configs_dir() + "/llama/config.json",
               "--data.source=synthetic", "--training.export=none"},
              more);
}

nlohmann::json plan_json_of(int world, const std::vector<std::string>& config_args) {
  std::vector<std::string> args = {"plan"};
  for (const auto& a : config_args) args.push_back(a);
  args.insert(args.end(), {"--world", std::to_string(world), "--json"});
  const RunResult r = trainer.run(args, {}, 60);
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  return nlohmann::json::parse(r.out);
}

// The trainer's reported peak tensor MiB of rank 0, over the steps after the first (the first
// has no optimizer state yet).
double measured_peak_mib_of(int world, const std::vector<std::string>& config_args) {
  TempDir dir;
  const std::vector<std::string> args =
      with(config_args, {"--training.steps=3", "--training.resume=never", "--training.export=none",
                         "--fsdp_config.checkpoint_interval=0", "--fsdp_config.checkpoint_dir=" + dir.path() + "/c",
                         "--logging.jsonl=" + dir.path() + "/m{rank}.jsonl", "--logging.progress=off"});
  const RunResult r = world == 1 ? trainer.run(args, {}, 120) : fsdprun.run(under_fsdprun(world, args), {}, 240);
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  std::ifstream in(dir.path() + "/m0.jsonl");
  double peak = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const auto j = nlohmann::json::parse(line);
    if (j["step"].get<int>() > 1) peak = std::max(peak, j["peak_mib"].get<double>());
  }
  return peak;
}

void expect_within_ten_percent_of(int world, const std::vector<std::string>& config_args) {
  const double predicted = plan_json_of(world, config_args)["ranks"][0]["peak_tensor_bytes"].get<double>() / (1 << 20);
  const double measured = measured_peak_mib_of(world, config_args);
  ASSERT_GT(measured, 0);
  EXPECT_NEAR(predicted / measured, 1.0, 0.10)
      << "W=" << world << ": predicted " << predicted << " MiB, measured " << measured << " MiB";
}

void expect_within_ten_percent(int world, const std::vector<std::string>& overrides) {
  expect_within_ten_percent_of(world, config(overrides));
}

TEST(PlanCli, PredictsTheTrainersPeakAtOneRankWithinTenPercent) { expect_within_ten_percent(1, {}); }

TEST(PlanCli, PredictsTheTrainersPeakAtTwoRanksWithMixedPrecisionAndCheckpointing) {
  expect_within_ten_percent(2, {"--fsdp_config.mixed_precision=true", "--fsdp_config.activation_checkpointing=true",
                                "--fsdp_config.sharding_strategy=SHARD_GRAD_OP"});
}

TEST(PlanCli, PredictsTheTrainersPeakWithTensorParallelism) {
  expect_within_ten_percent(2, {"--fsdp_config.model_parallel_size=2"});
  expect_within_ten_percent(2, {"--fsdp_config.model_parallel_size=2", "--fsdp_config.vocab_parallel=false"});
}

TEST(PlanCli, PredictsTheTrainersPeakWithTheOutputHeadAsAGroupOfItsOwn) {
  expect_within_ten_percent(2, {"--fsdp_config.output_head_group=true", "--training.loss_chunks=4",
                                "--fsdp_config.activation_checkpointing=true"});
}

// The Llama family: GQA, SwiGLU, RMSNorm's fp32 tensors and the tied head in the root, at W=2 in
// fp32, in bf16 (the norms' fp32 copies), with the loss in pieces, with every decoder layer
// checkpointed and under NO_SHARD; the plan counts the parameters the trainer builds.
TEST(PlanCli, PredictsTheLlamasPeakAtTwoRanksWithinTenPercent) {
  expect_within_ten_percent_of(2, llama_config({}));
  expect_within_ten_percent_of(2, llama_config({"--fsdp_config.mixed_precision=true"}));
  expect_within_ten_percent_of(2, llama_config({"--training.loss_chunks=4"}));
  expect_within_ten_percent_of(2, llama_config({"--fsdp_config.activation_checkpointing=true"}));
  expect_within_ten_percent_of(2, llama_config({"--fsdp_config.sharding_strategy=NO_SHARD"}));
  EXPECT_EQ(plan_json_of(2, llama_config({}))["parameters"].get<int64_t>(), 771200);
}

// GPT-2 (fused c_attn, Conv1D weights, LayerNorm, GELU, learned positions), its config.json
// written here: tied in fp32, bf16, with every block checkpointed and the loss in pieces, under
// NO_SHARD, with dropout; untied with the head a group of its own. The plan counts the
// parameters the trainer builds.
TEST(PlanCli, PredictsGpt2sPeakAtTwoRanksWithinTenPercent) {
  TempDir dir;
  auto gpt2_config = [&](const std::string& name, bool tied, double pdrop, const std::vector<std::string>& more) {
    const std::string p = std::to_string(pdrop);
    std::ofstream(dir.path() + "/" + name + ".json")
        << R"({"architectures": ["GPT2LMHeadModel"], "vocab_size": 512, "n_positions": 128, "n_embd": 64,
              "n_layer": 2, "n_head": 4, "embd_pdrop": )"
        << p << R"(, "attn_pdrop": )" << p << R"(, "resid_pdrop": )" << p << R"(, "tie_word_embeddings": )"
        << (tied ? "true" : "false") << "}";
    std::ofstream(dir.path() + "/gpt2.yaml") << "data:\n  source: synthetic\n";
    return with({dir.path() + "/gpt2.yaml", "--model.architecture=gpt2",
                 "--model.hf_config=" + dir.path() + "/" + name + ".json", "--training.seq_len=128",
                 "--training.micro_batch_size=4", "--training.export=none"},
                more);
  };
  expect_within_ten_percent_of(2, gpt2_config("tied", true, 0, {}));
  expect_within_ten_percent_of(2, gpt2_config("tied", true, 0, {"--fsdp_config.mixed_precision=true"}));
  expect_within_ten_percent_of(
      2, gpt2_config("tied", true, 0, {"--fsdp_config.activation_checkpointing=true", "--training.loss_chunks=4"}));
  expect_within_ten_percent_of(2, gpt2_config("tied", true, 0, {"--fsdp_config.sharding_strategy=NO_SHARD"}));
  expect_within_ten_percent_of(2, gpt2_config("dropout", true, 0.1, {"--fsdp_config.activation_checkpointing=true"}));
  expect_within_ten_percent_of(2, gpt2_config("untied", false, 0, {"--fsdp_config.output_head_group=true"}));
  EXPECT_EQ(plan_json_of(2, gpt2_config("tied", true, 0, {}))["parameters"].get<int64_t>(), 141056);
}

// Tensor parallelism of the Llama family (the shipped config's tied head stays whole), and what
// the trainer refuses for it refused by the plan with the same key: a tied head split by
// vocabulary, or in a group of its own.
TEST(PlanCli, PredictsTheLlamasPeakWithTensorParallelismAndRefusesWhatTheTrainerRefuses) {
  expect_within_ten_percent_of(
      2, llama_config({"--fsdp_config.model_parallel_size=2", "--fsdp_config.vocab_parallel=false"}));
  for (const auto& [overrides, key] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--fsdp_config.model_parallel_size=2"}, "fsdp_config.vocab_parallel"},
           {{"--fsdp_config.output_head_group=true"}, "fsdp_config.output_head_group"}}) {
    std::vector<std::string> args = {"plan"};
    for (const auto& a : llama_config(overrides)) args.push_back(a);
    args.insert(args.end(), {"--world", "2"});
    const RunResult r = trainer.run(args, {}, 60);
    EXPECT_EQ(r.exit_code, 2) << describe(r);
    EXPECT_EQ(r.err.find("fsdp-train: configuration error: " + key), 0u) << describe(r);
  }
}

// The trainer's check before a run counts the Llama's own parameters: a SwiGLU too wide for the
// machine stops it at configuration time naming the config.json key, before anything is built.
TEST(PlanCli, TheTrainersMemoryCheckCountsTheLlamasOwnParameters) {
  TempDir dir;
  std::string json = read_file(configs_dir() + "/llama/config.json");
  const std::string narrow = "\"intermediate_size\": 352";
  ASSERT_NE(json.find(narrow), std::string::npos);
  json.replace(json.find(narrow), narrow.size(), "\"intermediate_size\": 17179869184");
  std::ofstream(dir.path() + "/config.json") << json;
  const RunResult r = trainer.run(
      with(llama_config({}), {"--model.hf_config=" + dir.path() + "/config.json", "--training.steps=1",
                              "--training.resume=never", "--fsdp_config.checkpoint_dir=" + dir.path() + "/c"}),
      {}, 60);
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_NE(r.err.find("configuration error: intermediate_size (config.json): this run needs at least"),
            std::string::npos)
      << describe(r);
  // SwiGLU's three matrices of 17179869184 columns are nearly all of the model; the check counts
  // them (which part of the step dominates is the planner's answer, here the activations).
  EXPECT_NE(r.err.find("The model has 32985"), std::string::npos) << describe(r);
}

// The same tokens as an llm.c .bin file and as the project's own token file: the plan reads both,
// as the trainer does, and counts the same resident bytes for them.
TEST(PlanCli, ReadsEveryTokenFileTheTrainerReads) {
  TempDir dir;
  auto put = [](std::string& out, uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  };
  const uint64_t n = 5000;
  std::string llmc, own = std::string("FSDPTOK") + '\0';
  put(llmc, 20240520, 4), put(llmc, 1, 4), put(llmc, n, 4);
  llmc.resize(256 * 4, '\0');
  put(own, 1, 4), put(own, 2, 4), put(own, 64, 8), put(own, n, 8);
  for (uint64_t i = 0; i < n; ++i) put(llmc, i % 64, 2), put(own, i % 64, 2);
  std::ofstream(dir.path() + "/train.bin", std::ios::binary) << llmc;
  std::ofstream(dir.path() + "/train.tokens", std::ios::binary) << own;
  std::vector<double> peaks;
  for (const std::string name : {"train.bin", "train.tokens"}) {
    const nlohmann::json plan =
        plan_json_of(2, config({"--data.source=tokens", "--data.path=" + dir.path() + "/" + name}));
    peaks.push_back(plan["ranks"][0]["peak_tensor_bytes"].get<double>());
  }
  EXPECT_EQ(peaks[0], peaks[1]);
  const nlohmann::json synthetic = plan_json_of(2, config({"--data.source=synthetic"}));
  EXPECT_EQ(peaks[0] - synthetic["ranks"][0]["peak_tensor_bytes"].get<double>(), 8.0 * n);
}

TEST(PlanCli, RefusesWhatTheTrainerRefusesNamingTheKey) {
  std::vector<std::string> args = {"plan"};
  for (const auto& a : config({"--fsdp_config.model_parallel_size=2"})) args.push_back(a);
  args.insert(args.end(), {"--world", "3"});
  RunResult r = trainer.run(args, {}, 60);
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_NE(r.err.find("fsdp_config.model_parallel_size: 2 does not divide the world"), std::string::npos) << r.err;
  r = trainer.run({"plan", configs_dir() + "/tiny.yaml"}, {}, 60);
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_NE(r.err.find("--world N is required"), std::string::npos) << r.err;
  r = trainer.run({"plan", configs_dir() + "/tiny.yaml", "--world", "3", "--fsdp_config.replicate_degree=2",
                   "--fsdp_config.sharding_strategy=HYBRID_SHARD"},
                  {}, 60);
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_NE(r.err.find("fsdp_config.replicate_degree"), std::string::npos) << r.err;
  r = trainer.run({"plan", configs_dir() + "/tiny.yaml", "--world", "2", "--fsdp_config.output_head_group=true",
                   "--fsdp_config.sharding_strategy=NO_SHARD"},
                  {}, 60);
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_NE(r.err.find("fsdp_config.output_head_group"), std::string::npos) << r.err;
  // A key the trainer takes and the plan cannot model yet: refused by name, not planned as 1.
  r = trainer.run(
      {"plan", configs_dir() + "/tiny.yaml", "--world", "2", "--fsdp_config.reduce_scatter_max_input_buffers=2"}, {},
      60);
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_NE(r.err.find("does not model fsdp_config.reduce_scatter_max_input_buffers: 2"), std::string::npos) << r.err;
  r = trainer.run(
      {"plan", configs_dir() + "/tiny.yaml", "--world", "2", "--data.source=tokens", "--data.path=/nonexistent.tokens"},
      {}, 60);
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_NE(r.err.find("data.path: /nonexistent.tokens"), std::string::npos) << r.err;
  // On a GPU: the optimizer state offloaded without the parameters is refused, as the trainer
  // refuses it; fp16 with loss scaling on cpu too.
  r = trainer.run({"plan", configs_dir() + "/seed002.yaml", "--fsdp_config.offload_params=false",
                   "--fsdp_config.offload_optimizer_state=true"},
                  {}, 60);
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_NE(r.err.find("fsdp_config.offload_optimizer_state: true with fsdp_config.offload_params: false"),
            std::string::npos)
      << r.err;
  r = trainer.run({"plan", configs_dir() + "/seed002.yaml", "--fsdp_config.device=cpu"}, {}, 60);
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_NE(r.err.find("fsdp_config.fp16: true"), std::string::npos) << r.err;
  r = trainer.run({"plan", configs_dir() + "/seed002.yaml", "--world", "4"}, {}, 60);
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_NE(r.err.find("fsdp_config.world_size is 8 but --world is 4"), std::string::npos) << r.err;
  // The one-memory plan of the same shapes, as before.
  r = trainer.run(
      {"plan", configs_dir() + "/seed002.yaml", "--world", "8", "--fsdp_config.device=cpu", "--fsdp_config.fp16=false"},
      {}, 60);
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.out.find("peak RSS"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("predicted step time"), std::string::npos) << r.out;
}

// The example config as written (device cuda, fp16, parameters offloaded, AdamW's state on the
// GPU, tensor parallel 2 over world_size 8): the GPU's memory and the host's per rank, said to be
// a model, and no step time.
TEST(PlanCli, PlansAGpuConfigWithTheGpuAndHostMemoryApart) {
  RunResult r = trainer.run({"plan", configs_dir() + "/seed002.yaml"}, {}, 60);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.out.find("at W=8"), std::string::npos) << r.out;  // fsdp_config.world_size
  EXPECT_NE(r.out.find("device cuda"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("DeviceStateAdamW"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("GPU peak tensors"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("host peak tensors"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("optimizer state fp32"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("not yet checked against a run on a GPU"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("step time: not modelled for GPUs"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("predicted step time"), std::string::npos) << r.out;
  r = trainer.run({"plan", configs_dir() + "/seed002.yaml", "--json"}, {}, 60);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["device"], "cuda");
  EXPECT_FALSE(j["step_time_modeled"].get<bool>());
  EXPECT_FALSE(j.contains("step_time_s"));
  ASSERT_EQ(j["ranks"].size(), 8u);
  const auto& r0 = j["ranks"][0];
  EXPECT_EQ(r0["params_in"], "host");
  EXPECT_EQ(r0["grads_in"], "host");
  EXPECT_EQ(r0["optimizer_state_in"], "GPU");
  EXPECT_GT(r0["peak_tensor_bytes"].get<int64_t>(), 0);
  EXPECT_GT(r0["host_peak_tensor_bytes"].get<int64_t>(), 0);
  // Offloading the optimizer state too (CPUOffloadPolicy) moves it to the host: the GPU's peak
  // falls and the host's rises.
  r = trainer.run({"plan", configs_dir() + "/seed002.yaml", "--json", "--fsdp_config.offload_optimizer_state=true"}, {},
                  60);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const auto full = nlohmann::json::parse(r.out)["ranks"][0];
  EXPECT_EQ(full["optimizer_state_in"], "host");
  EXPECT_LT(full["peak_tensor_bytes"].get<int64_t>(), r0["peak_tensor_bytes"].get<int64_t>());
  EXPECT_GT(full["host_peak_tensor_bytes"].get<int64_t>(), r0["host_peak_tensor_bytes"].get<int64_t>());
}

TEST(PlanCli, SaysWhichBackendAndThreadsItPlansAndTheStepAfterASave) {
  // W=4: the root's 16 MiB reduce-scatter runs on fsdp-cpp's ring, whose scratch is a tensor (on
  // MPI as on Gloo, from 256 KiB).
  RunResult r = trainer.run({"plan", configs_dir() + "/small.yaml", "--world", "4", "--fsdp_config.backend=mpi",
                             "--fsdp_config.checkpoint_interval=5"},
                            {}, 60);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.out.find("collectives on mpi"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("one thread per rank"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("the step after a background checkpoint save: peak tensors"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("collective scratch"), std::string::npos) << r.out;
  // A model whose reduce-scatters stay below 256 KiB leaves them to OpenMPI: no scratch tensor.
  r = trainer.run({"plan", configs_dir() + "/tiny.yaml", "--world", "4", "--fsdp_config.backend=mpi"}, {}, 60);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(r.out.find("collective scratch"), std::string::npos) << r.out;
  r = trainer.run({"plan", configs_dir() + "/small.yaml", "--world", "2", "--fsdp_config.backend=mpi",
                   "--fsdp_config.checkpoint_interval=0"},
                  {{"FSDP_BACKEND", "gloo"}}, 60);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.out.find("collectives on gloo (FSDP_BACKEND in the environment)"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("background checkpoint"), std::string::npos) << r.out;
}

TEST(PlanCli, FindsTheLargestModelThatFitsAndPrintsEveryRank) {
  std::vector<std::string> args = {"plan", configs_dir() + "/small.yaml", "--world", "4", "--memory-per-rank", "1GiB"};
  RunResult text = trainer.run(args, {}, 60);
  ASSERT_EQ(text.exit_code, 0) << describe(text);
  EXPECT_NE(text.out.find("ranks 0-3:"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("peak tensors"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("layers.3: all_gather on the shard mesh x2"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("fits 1024.00 MiB per rank"), std::string::npos) << text.out;
  args.push_back("--json");
  const auto small = nlohmann::json::parse(trainer.run(args, {}, 60).out);
  args[5] = "4GiB";
  const auto large = nlohmann::json::parse(trainer.run(args, {}, 60).out);
  EXPECT_GE(small["largest_n_layers"].get<int64_t>(), 4);  // small itself fits in 1 GiB at W=4
  EXPECT_GT(large["largest_n_layers"].get<int64_t>(), small["largest_n_layers"].get<int64_t>());
  EXPECT_GT(large["largest_dim"].get<int64_t>(), small["largest_dim"].get<int64_t>());
  EXPECT_EQ(large["largest_dim"].get<int64_t>() % 8, 0);  // a multiple of n_heads
  EXPECT_EQ(small["ranks"].size(), 4u);
}

}  // namespace
