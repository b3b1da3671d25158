// fsdp-train's sharding strategies end to end: each one trains like one process on the global
// batch, and one checkpoint carries a run across strategies and world sizes.
#include "process_harness.h"
#include "trainer_runs.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

using namespace process_test;
using namespace trainer_test;

namespace {

constexpr int kGlobalBatch = 8;
constexpr int kSteps = 12;

struct StrategyRun {
  std::string name;
  int world;
  std::vector<std::string> args;
};

// `world` ranks with kGlobalBatch / (world * accumulation) rows each: the same global batch.
// With model_parallel > 1 the world / model_parallel data-parallel ranks share the batch.
std::map<int64_t, StepMetrics> train(const std::string& dir, int world, std::vector<std::string> args,
                                     int accumulation = 1, int steps = kSteps, int model_parallel = 1) {
  args = with(base_args(dir, steps), with({"--training.micro_batch_size=" +
                                               std::to_string(kGlobalBatch * model_parallel / (world * accumulation)),
                                           "--fsdp_config.model_parallel_size=" + std::to_string(model_parallel),
                                           "--training.gradient_accumulation_steps=" + std::to_string(accumulation),
                                           "--fsdp_config.checkpoint_interval=4"},
                                          args));
  RunResult r = fsdprun.run(under_fsdprun(world, args), {}, 240);
  EXPECT_EQ(r.exit_code, 0) << dir << ": " << describe(r);
  return read_metrics(dir + "/m0.jsonl");
}

void expect_losses_near(const std::map<int64_t, StepMetrics>& got, const std::map<int64_t, StepMetrics>& want,
                        int64_t first_step, const std::string& what) {
  ASSERT_EQ(got.size(), static_cast<size_t>(kSteps - first_step + 1)) << what;
  for (const auto& [step, m] : got) {
    ASSERT_TRUE(want.count(step)) << what << " step " << step;
    EXPECT_NEAR(m.loss, want.at(step).loss, 1e-5) << what << " step " << step;
    EXPECT_NEAR(m.grad_norm, want.at(step).grad_norm, 1e-5) << what << " step " << step;
  }
}

// One process on the global batch: what every strategy must reproduce.
const std::map<int64_t, StepMetrics>& single_process_losses() {
  static TempDir dir;
  static const std::map<int64_t, StepMetrics> losses = train(dir.path(), 1, {});
  return losses;
}

TEST(TrainerStrategies, EachStrategyTrainsLikeOneProcessOnTheGlobalBatch) {
  const auto& want = single_process_losses();
  ASSERT_EQ(want.size(), static_cast<size_t>(kSteps));
  const std::string hybrid = "--fsdp_config.sharding_strategy=HYBRID_SHARD";
  const std::vector<std::pair<StrategyRun, int>> runs = {
      {{"SHARD_GRAD_OP W=2", 2, {"--fsdp_config.sharding_strategy=SHARD_GRAD_OP"}}, 1},
      {{"NO_SHARD W=2", 2, {"--fsdp_config.sharding_strategy=NO_SHARD"}}, 1},
      {{"NO_SHARD W=4, 2 micro-batches", 4, {"--fsdp_config.sharding_strategy=NO_SHARD"}}, 2},
      {{"HYBRID_SHARD 2x2", 4, {hybrid, "--fsdp_config.replicate_degree=2"}}, 1},
      // The reduce-scatter runs every micro-batch, the all-reduce only after the last.
      {{"HYBRID_SHARD 2x2, 2 micro-batches", 4, {hybrid, "--fsdp_config.replicate_degree=2"}}, 2},
      {{"HYBRID_SHARD 4x1", 4, {hybrid, "--fsdp_config.replicate_degree=4"}}, 1},
      {{"HYBRID_SHARD_ZERO2 2x1",
        2,
        {"--fsdp_config.sharding_strategy=HYBRID_SHARD_ZERO2", "--fsdp_config.replicate_degree=2"}},
       1},
  };
  TempDir dir;
  int i = 0;
  for (const auto& [run, accumulation] : runs) {
    SCOPED_TRACE(run.name);
    const auto got = train(dir / std::to_string(i++), run.world, run.args, accumulation);
    expect_losses_near(got, want, 1, run.name);
  }
}

TEST(TrainerStrategies, StartLineNamesTheDataParallelLayout) {
  TempDir dir;
  const auto args =
      with(base_args(dir.path(), 1), {"--fsdp_config.sharding_strategy=HYBRID_SHARD",
                                      "--fsdp_config.replicate_degree=2", "--training.micro_batch_size=2"});
  RunResult r = fsdprun.run(under_fsdprun(4, args), {}, 120);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.out.find("sharded over 2 rank(s) in each of 2 replicas, HYBRID_SHARD"), std::string::npos) << r.out;
  TempDir dir2;
  r = fsdprun.run(under_fsdprun(2, with(base_args(dir2.path(), 1), {"--fsdp_config.sharding_strategy=NO_SHARD"})), {},
                  120);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.out.find("replicated on 2 rank(s), NO_SHARD"), std::string::npos) << r.out;
}

// The sharded strategies build the model sharded, one block at a time, so building it never
// takes the whole model's parameters on any rank; NO_SHARD holds them whole (each rank has a
// full replica). Mostly blocks, so that a block is small next to the model.
TEST(TrainerStrategies, ShardedStrategiesNeverHoldTheWholeModelWhileBuildingIt) {
  const double full_mib = 4 * transformer_parameter_count(16, 64, 64, 64) / (1024.0 * 1024.0);
  auto build_peaks = [&](const std::string& strategy) {
    TempDir dir;
    const auto args =
        with(base_args(dir.path(), 1), {"--model.n_layers=16", "--fsdp_config.sharding_strategy=" + strategy,
                                        "--fsdp_config.checkpoint_interval=0", "--training.micro_batch_size=1",
                                        "--logging.summary_json=" + dir / "summary.json"});
    RunResult r = fsdprun.run(under_fsdprun(2, args), {}, 120);
    EXPECT_EQ(r.exit_code, 0) << describe(r);
    return nlohmann::json::parse(read_file(dir / "summary.json"))
        .at("build_peak_tensor_mib_per_rank")
        .get<std::vector<double>>();
  };
  const std::vector<double> sharded = build_peaks("FULL_SHARD");
  ASSERT_EQ(sharded.size(), 2u);
  // Half of the model (the shards), one block (1/16) and the root, and little else.
  for (double mib : sharded) EXPECT_LT(mib, 0.7 * full_mib) << "FULL_SHARD, the whole model is " << full_mib << " MiB";
  for (double mib : build_peaks("NO_SHARD")) EXPECT_GE(mib, full_mib) << "NO_SHARD";
}

// FULL_SHARD at W=2 saves step 4; HYBRID_SHARD 2x2 at W=4 resumes it and saves step 8; NO_SHARD
// at W=1 resumes that. Each continues with the losses of one process that never stopped.
// Then the other way: a NO_SHARD checkpoint resumed by FULL_SHARD.
TEST(TrainerStrategies, OneCheckpointCarriesARunAcrossStrategiesAndWorldSizes) {
  const auto& want = single_process_losses();
  TempDir dir;
  const std::string full = dir / "full", hybrid = dir / "hybrid", replicated = dir / "replicated";
  const auto first = train(full, 2, {"--fsdp_config.sharding_strategy=FULL_SHARD"});
  expect_losses_near(first, want, 1, "FULL_SHARD W=2");
  ASSERT_TRUE(std::filesystem::exists(full + "/ckpt/step_4/metadata.json"));

  const auto second = train(hybrid, 4,
                            {"--fsdp_config.sharding_strategy=HYBRID_SHARD", "--fsdp_config.replicate_degree=2",
                             "--training.resume=" + full + "/ckpt/step_4"});
  expect_losses_near(second, want, 5, "HYBRID_SHARD 2x2 W=4 from FULL_SHARD W=2");
  ASSERT_TRUE(std::filesystem::exists(hybrid + "/ckpt/step_8/metadata.json"));

  const auto third = train(
      replicated, 1, {"--fsdp_config.sharding_strategy=NO_SHARD", "--training.resume=" + hybrid + "/ckpt/step_8"});
  expect_losses_near(third, want, 9, "NO_SHARD W=1 from HYBRID_SHARD W=4");

  // And from a replicated run into a sharded one: NO_SHARD at W=2 saves step 4, FULL_SHARD at
  // W=4 resumes it.
  const auto ddp = train(dir / "ddp", 2, {"--fsdp_config.sharding_strategy=NO_SHARD"});
  ASSERT_TRUE(std::filesystem::exists(dir / "ddp/ckpt/step_4/metadata.json"));
  const auto sharded = train(dir / "sharded", 4, {"--training.resume=" + (dir / "ddp/ckpt/step_4")});
  expect_losses_near(sharded, want, 5, "FULL_SHARD W=4 from NO_SHARD W=2");
}

// logging.summary_json's communication of one mesh dim: {kind: {calls_per_rank, ...}}.
double per_rank(const nlohmann::json& summary, const std::string& dim, const std::string& kind,
                const std::string& field, int rank) {
  return summary.at("comm_by_mesh_dim").at(dim).at(kind).at(field).at(rank).get<double>();
}

// The summary splits communication by mesh dim: FSDP's all-gathers and reduce-scatters on dp,
// the tensor-parallel layers' all-reduces on tp (4 per block: 2 in forward, 2 in backward; the
// vocab-parallel embedding's and head's, and the loss's 2), and one all-reduce of the gradient
// norm on each; the dims add up to the summed per-kind totals.
void expect_dp_and_tp_split(const nlohmann::json& summary, int world, int64_t steps, int64_t blocks) {
  EXPECT_EQ(summary.at("mesh_dim_names"), nlohmann::json({"dp", "tp"}));
  EXPECT_EQ(summary.at("mesh_shape"), nlohmann::json({world / 2, 2}));
  EXPECT_EQ(summary.at("model_parallel_size"), 2);
  EXPECT_EQ(summary.at("vocab_parallel"), true);
  for (int q = 0; q < world; ++q) {
    SCOPED_TRACE("rank " + std::to_string(q));
    // Forward gathers every block and the root, backward the blocks again.
    EXPECT_EQ(per_rank(summary, "dp", "all_gather", "calls_per_rank", q), steps * (2 * blocks + 1));
    EXPECT_EQ(per_rank(summary, "dp", "reduce_scatter", "calls_per_rank", q), steps * (blocks + 1));
    EXPECT_EQ(per_rank(summary, "dp", "all_reduce", "calls_per_rank", q), steps);
    EXPECT_EQ(per_rank(summary, "tp", "all_reduce", "calls_per_rank", q), steps * (4 * blocks + 4 + 1));
    EXPECT_EQ(per_rank(summary, "tp", "all_gather", "calls_per_rank", q), 0);
    EXPECT_EQ(per_rank(summary, "tp", "reduce_scatter", "calls_per_rank", q), 0);
    EXPECT_GT(per_rank(summary, "tp", "all_reduce", "bytes_per_rank", q), 0);
    EXPECT_GE(per_rank(summary, "tp", "all_reduce", "s_per_rank", q), 0);
    for (const std::string kind : {"all_gather", "reduce_scatter", "all_reduce"}) {
      const double dp = per_rank(summary, "dp", kind, "bytes_per_rank", q);
      const double tp = per_rank(summary, "tp", kind, "bytes_per_rank", q);
      EXPECT_EQ(dp + tp, summary.at(kind + "_bytes_per_rank").at(q).get<double>()) << kind;
    }
  }
}

// model_parallel_size: 2 at W=4 (dp 2 x tp 2) trains like one process (the embedding and head
// split by vocabulary, the default; the loss in pieces; the head whole), and its checkpoint
// resumes at W=2 without tensor parallelism, continuing with the same losses.
TEST(TrainerStrategies, TensorParallelTrainsLikeOneProcessAndResumesWithoutIt) {
  const auto& want = single_process_losses();
  TempDir dir;
  const std::string tp = dir / "tp", plain = dir / "plain";
  expect_losses_near(train(tp, 4, {"--logging.summary_json=" + tp + "/summary.json"}, 1, kSteps, /*model_parallel=*/2),
                     want, 1, "dp2 x tp2 W=4");
  expect_dp_and_tp_split(nlohmann::json::parse(read_file(tp + "/summary.json")), 4, kSteps, /*tiny's blocks*/ 2);
  ASSERT_TRUE(std::filesystem::exists(tp + "/ckpt/step_4/metadata.json"));
  expect_losses_near(train(plain, 2, {"--training.resume=" + tp + "/ckpt/step_4"}), want, 5,
                     "FULL_SHARD W=2 from dp2 x tp2");
  expect_losses_near(train(dir / "chunked", 4, {"--training.loss_chunks=3"}, 1, kSteps, 2), want, 1,
                     "dp2 x tp2 W=4, the loss in 3 pieces");
  expect_losses_near(train(dir / "whole_head", 4, {"--fsdp_config.vocab_parallel=false"}, 1, kSteps, 2), want, 1,
                     "dp2 x tp2 W=4, the embedding and head whole");
}

// configs/seed002.yaml on a CPU (device: cpu and fp16: false: fp16 with loss scaling is the
// GPU recipe; model_parallel_size: 2, bf16, activation checkpointing, offload) runs at W=4 and
// resumes at W=2 with model_parallel_size: 1.
TEST(TrainerStrategies, Seed002RunsTensorParallelAndResumesWithoutIt) {
  TempDir dir;
  auto seed002 = [&](int world, const std::string& sub, std::vector<std::string> more) {
    std::vector<std::string> args = {configs_dir() + "/seed002.yaml",
                                     "--fsdp_config.device=cpu",
                                     "--fsdp_config.fp16=false",
                                     "--fsdp_config.world_size=" + std::to_string(world),
                                     "--training.steps=4",
                                     "--fsdp_config.checkpoint_interval=2",
                                     "--fsdp_config.checkpoint_dir=" + dir / sub,
                                     "--logging.progress=off",
                                     "--training.export=none",
                                     "--logging.jsonl=" + dir / (sub + "_m{rank}.jsonl")};
    return fsdprun.run(under_fsdprun(world, with(args, more)), {}, 240);
  };
  RunResult r = seed002(4, "ckpt", {});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.out.find("tensor-parallel over 2 (tp, embedding and head split by vocabulary)"), std::string::npos)
      << r.out;
  ASSERT_TRUE(std::filesystem::exists(dir / "ckpt/step_2/metadata.json"));
  r = seed002(2, "ckpt", {"--fsdp_config.model_parallel_size=1", "--training.resume=" + dir / "ckpt/step_2"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(read_metrics(dir / "ckpt_m0.jsonl").rbegin()->first, 4);
}

// configs/seed002.yaml with nothing of its fsdp_config changed but what a CPU needs (device: cpu,
// fp16: false, as above): 8 ranks, a (4, 2) mesh, offload_params: true beside
// offload_optimizer_state: false (one placement on cpu, which the run says), checkpoints in
// ./checkpoints of the run's directory. Only training.steps is shortened.
TEST(TrainerStrategies, Seed002AsWrittenRunsOnEightCpuRanks) {
  TempDir dir;
  const std::vector<std::string> args = {configs_dir() + "/seed002.yaml", "--fsdp_config.device=cpu",
                                         "--fsdp_config.fp16=false",      "--training.steps=2",
                                         "--logging.progress=off",        "--training.export=none"};
  RunResult r = fsdprun.run(under_fsdprun(8, args), {}, 300, dir.path());
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_TRUE(contains(r,
                       "offload_params: true, offload_optimizer_state: false: on device cpu device memory is "
                       "host memory"))
      << describe(r);
  EXPECT_TRUE(contains(r, "param bf16, reduce fp32")) << describe(r);
  EXPECT_TRUE(std::filesystem::exists(dir / "checkpoints/step_2/metadata.json"));
}

}  // namespace

// model.freeze: a name that matches nothing stops every rank before training (a typo must not
// train what was meant to stay fixed); NO_SHARD and FULL_SHARD both run with a frozen
// embedding. tests/interop compares the frozen run's numbers with PyTorch's FSDP2.
TEST(TrainerStrategies, FreezeNamesParametersAndAMisspelledNameStopsTheRun) {
  TempDir tmp;
  RunResult typo =
      fsdprun.run(under_fsdprun(2, with(base_args(tmp / "typo", 2), {"--model.freeze=[tok_embedding]"})), {}, 120);
  EXPECT_NE(typo.exit_code, 0) << describe(typo);
  EXPECT_TRUE(contains(typo, "model.freeze: 'tok_embedding' names no parameter of the model")) << describe(typo);
  for (const char* strategy : {"NO_SHARD", "FULL_SHARD"}) {
    SCOPED_TRACE(strategy);
    const std::map<int64_t, StepMetrics> frozen = train(tmp / strategy, 2,
                                                        {"--model.freeze=[tok_embeddings, layers.0.attention]",
                                                         std::string("--fsdp_config.sharding_strategy=") + strategy},
                                                        1, 3);
    EXPECT_EQ(frozen.size(), 3u);
  }
}
