// End-to-end tests of fsdp-train: the real program, started directly or by fsdprun, with real
// ranks on loopback. Losses come from the per-rank JSONL metrics.
#include "process_harness.h"
#include "trainer_runs.h"

#include "../python_path.h"
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <signal.h>
#include <sys/types.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

using namespace process_test;
using namespace trainer_test;

namespace {

void expect_same_losses(const std::map<int64_t, StepMetrics>& got, const std::map<int64_t, StepMetrics>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [step, m] : want) {
    ASSERT_TRUE(got.count(step)) << "step " << step << " missing";
    EXPECT_EQ(got.at(step).loss, m.loss) << "step " << step;  // bitwise: the same computation
  }
}

constexpr int kSteps = 60;

// The uninterrupted reference run (W=2), made once for the tests that compare against it; its
// directory keeps every checkpoint (ckpt/step_5, step_10, ...).
const TempDir& reference_run() {
  static TempDir dir;
  static bool done = [] {
    RunResult r = fsdprun.run(under_fsdprun(2, base_args(dir.path(), kSteps)), {}, 120);
    EXPECT_EQ(r.exit_code, 0) << describe(r);
    return true;
  }();
  (void)done;
  return dir;
}

const std::map<int64_t, StepMetrics>& reference_losses() {
  static std::map<int64_t, StepMetrics> losses = read_metrics(reference_run() / "m0.jsonl");
  return losses;
}

// ------------------------------------------------------------------ resume after a failure

TEST(Trainer, KilledRankThenResumeAutoEndsWithTheLossesOfAnUninterruptedRun) {
  const auto& want = reference_losses();
  ASSERT_EQ(static_cast<int>(want.size()), kSteps);
  TempDir dir;
  const auto args = under_fsdprun(2, base_args(dir.path(), kSteps));
  {
    Process run = fsdprun.start(args);
    ASSERT_TRUE(wait_for_step(dir / "m0.jsonl", 12));
    const auto kids = children_of(run.pid());
    ASSERT_EQ(kids.size(), 2u);
    kill(kids.back(), SIGKILL);  // one rank dies without any warning
    RunResult r = run.wait(60);
    EXPECT_NE(r.exit_code, 0) << describe(r);
  }
  const int64_t reached = last_step_in(dir / "m0.jsonl");
  ASSERT_LT(reached, kSteps) << "the run finished before it was killed";
  RunResult r = fsdprun.run(args, {}, 120);  // training.resume: auto (configs/tiny.yaml)
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.out.find("resumed from"), std::string::npos) << r.out;
  expect_same_losses(read_metrics(dir / "m0.jsonl"), want);
}

TEST(Trainer, FsdprunMaxRestartsResumesFromTheLatestCheckpointWithTheSameLosses) {
  const auto& want = reference_losses();
  TempDir dir;
  Process run = fsdprun.start(under_fsdprun(2, base_args(dir.path(), kSteps), {"--max-restarts", "1"}));
  ASSERT_TRUE(wait_for_step(dir / "m0.jsonl", 12));
  const auto kids = children_of(run.pid());
  ASSERT_EQ(kids.size(), 2u);
  kill(kids.front(), SIGKILL);
  RunResult r = run.wait(120);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.out.find("resumed from"), std::string::npos) << describe(r);
  expect_same_losses(read_metrics(dir / "m0.jsonl"), want);
}

TEST(Trainer, SigtermSavesACheckpointAndTheResumedRunHasTheSameLosses) {
  const auto& want = reference_losses();
  TempDir dir;
  const auto args = under_fsdprun(2, base_args(dir.path(), kSteps), {"--stop-grace-seconds", "30"});
  {
    Process run = fsdprun.start(args);
    ASSERT_TRUE(wait_for_step(dir / "m0.jsonl", 7));
    kill(run.pid(), SIGTERM);  // fsdprun forwards it to both ranks
    RunResult r = run.wait(60);
    EXPECT_NE(r.exit_code, 0) << describe(r);
    EXPECT_NE(r.out.find("stop requested"), std::string::npos) << describe(r);
  }
  const int64_t stopped_at = last_step_in(dir / "m0.jsonl");
  ASSERT_LT(stopped_at, kSteps);
  // The stop saved exactly the step it stopped at, whatever the interval.
  EXPECT_TRUE(std::filesystem::exists(dir / ("ckpt/step_" + std::to_string(stopped_at) + "/metadata.json")));
  RunResult r = fsdprun.run(args, {}, 120);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.out.find("at step " + std::to_string(stopped_at)), std::string::npos) << r.out;
  expect_same_losses(read_metrics(dir / "m0.jsonl"), want);
}

// ------------------------------------------------------------------ other world sizes

// Saved at W=2 (B=4 per rank) and resumed at W=1 (B=8) and W=4 (B=2): the same global batch,
// so the continued losses match the W=2 run up to the order of floating-point sums.
TEST(Trainer, CheckpointSavedAtTwoRanksResumesAtOneAndFourRanks) {
  const auto& want = reference_losses();
  TempDir dir;
  const std::string ckpt = reference_run() / "ckpt/step_30";  // saved by 2 ranks
  ASSERT_TRUE(std::filesystem::exists(ckpt + "/metadata.json"));
  for (int world : {1, 4}) {
    const std::string run_dir = dir / ("w" + std::to_string(world));
    const auto args = with(base_args(run_dir, kSteps),
                           {"--training.micro_batch_size=" + std::to_string(8 / world), "--training.resume=" + ckpt});
    RunResult r = fsdprun.run(under_fsdprun(world, args), {}, 180);
    ASSERT_EQ(r.exit_code, 0) << "W=" << world << ": " << describe(r);
    const auto got = read_metrics(run_dir + "/m0.jsonl");
    ASSERT_EQ(got.size(), static_cast<size_t>(kSteps - 30)) << "W=" << world;
    for (const auto& [step, m] : got) {
      EXPECT_NEAR(m.loss, want.at(step).loss, 1e-4 * std::abs(want.at(step).loss)) << "W=" << world << " step " << step;
    }
  }
}

// ------------------------------------------------------------------ gradient accumulation

// k micro-batches of B rows with one reduce-scatter = one batch of kB rows.
TEST(Trainer, GradientAccumulationEqualsOneLargerBatch) {
  TempDir dir;
  auto run = [&](const std::string& name, int world, int batch, int accumulation) {
    const auto args =
        with(base_args(dir / name, 4), {"--training.micro_batch_size=" + std::to_string(batch),
                                        "--training.gradient_accumulation_steps=" + std::to_string(accumulation),
                                        "--fsdp_config.checkpoint_interval=0"});
    RunResult r = fsdprun.run(under_fsdprun(world, args), {}, 120);
    EXPECT_EQ(r.exit_code, 0) << name << ": " << describe(r);
    return read_metrics(dir / (name + "/m0.jsonl"));
  };
  const auto big = run("big", 2, 8, 1);
  for (const auto& [name, world, batch, k] :
       std::vector<std::tuple<std::string, int, int, int>>{{"k2", 2, 4, 2}, {"k4", 2, 2, 4}, {"w1k4", 1, 4, 4}}) {
    const auto acc = run(name, world, batch, k);
    ASSERT_EQ(acc.size(), big.size()) << name;
    for (const auto& [step, m] : big) {
      EXPECT_NEAR(acc.at(step).loss, m.loss, 1e-6) << name << " step " << step;
      EXPECT_NEAR(acc.at(step).grad_norm, m.grad_norm, 1e-6) << name << " step " << step;
    }
  }
}

// ------------------------------------------------------------------ stops with a message

TEST(Trainer, NonFiniteLossStopsWithAClearMessage) {
  TempDir dir;
  const auto args = with(base_args(dir.path(), 20),
                         {"--optimizer.lr=1e30", "--training.max_grad_norm=0", "--schedule.warmup_steps=0"});
  RunResult r = fsdprun.run(under_fsdprun(2, args), {}, 120);
  EXPECT_EQ(r.exit_code, 1) << describe(r);  // fsdprun's, for a failed group: it names the workers' code
  EXPECT_NE(r.err.find("exited with code 3"), std::string::npos) << describe(r);
  EXPECT_NE(r.out.find("non-finite"), std::string::npos) << describe(r);
  // Clipping is off here, so the advice includes turning it on.
  EXPECT_NE(r.out.find("or set training.max_grad_norm (clipping is off)"), std::string::npos) << describe(r);
  EXPECT_LT(last_step_in(dir / "m0.jsonl"), 20);
}

// ------------------------------------------------------------------ the default run's pieces

TEST(Trainer, TokenizeThenTrainOnATextFile) {
  TempDir dir;
  std::ofstream(dir / "text.txt") << std::string(200, 'a') + "the quick brown fox jumps over the lazy dog\n";
  RunResult tok = trainer.run({"tokenize", dir / "text.txt", dir / "text.tokens"}, {}, 30);
  ASSERT_EQ(tok.exit_code, 0) << describe(tok);
  const auto args = with(
      base_args(dir.path(), 10),
      {"--model.vocab_size=256", "--data.source=tokens", "--data.path=" + dir / "text.tokens", "--training.seq_len=32",
       "--sample.length=16", "--sample.prompt=the ", "--training.export=" + dir / "model.pt"});
  RunResult r = fsdprun.run(under_fsdprun(2, args), {}, 120);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.out.find("sample (16 tokens"), std::string::npos) << r.out;
  EXPECT_TRUE(std::filesystem::exists(dir / "model.pt"));
  const auto losses = read_metrics(dir / "m0.jsonl");
  ASSERT_EQ(losses.size(), 10u);
  EXPECT_LT(losses.at(10).loss, losses.at(1).loss);
}

// model.init_from reads what Python's torch.save wrote: here our own export, saved again by
// Python torch; a run with a vanishing learning rate exports the same weights back.
TEST(Trainer, StartsFromATorchSaveFile) {
  FSDP_SKIP_WITHOUT_PYTHON();
  TempDir dir;
  const auto common = [&](const std::string& name, int steps) {
    return with(base_args(dir / name, steps),
                {"--fsdp_config.checkpoint_interval=0", "--training.export=" + dir / (name + ".pt")});
  };
  RunResult a = fsdprun.run(under_fsdprun(2, common("a", 3)), {}, 120);
  ASSERT_EQ(a.exit_code, 0) << describe(a);
  const std::string python =
      "import sys, torch\n"
      "torch.save(dict(torch.load(sys.argv[1])), sys.argv[2])\n";
  std::ofstream(dir / "resave.py") << python;
  ASSERT_EQ(
      std::system((fsdp_test::python() + " " + dir / "resave.py" + " " + dir / "a.pt" + " " + dir / "init.pt").c_str()),
      0);
  RunResult b = fsdprun.run(under_fsdprun(2, with(common("b", 1), {"--model.init_from=" + dir / "init.pt",
                                                                   "--optimizer.lr=1e-30", "--schedule.min_lr=0"})),
                            {}, 120);
  ASSERT_EQ(b.exit_code, 0) << describe(b);
  std::ofstream(dir / "compare.py") << "import sys, torch\n"
                                       "a, b = torch.load(sys.argv[1]), torch.load(sys.argv[2])\n"
                                       "assert a.keys() == b.keys(), (a.keys(), b.keys())\n"
                                       "for k in a: assert torch.allclose(a[k], b[k], rtol=0, atol=1e-20), k\n"
                                       "print('OK', len(a))\n";
  EXPECT_EQ(
      std::system((fsdp_test::python() + " " + dir / "compare.py" + " " + dir / "a.pt" + " " + dir / "b.pt").c_str()),
      0);
}

// model.init_from also takes a safetensors export, of which each rank reads only its rows: a
// run at W=3 starts from the weights a W=2 run exported (here checked against the same W=2 run
// exported as a torch.save file: the runs are deterministic), and with a vanishing learning
// rate exports them back.
TEST(Trainer, StartsFromASafetensorsExportAtAnotherWorldSize) {
  FSDP_SKIP_WITHOUT_PYTHON();
  TempDir dir;
  const auto common = [&](const std::string& name, int steps, const std::string& export_path) {
    return with(base_args(dir / name, steps), {"--fsdp_config.checkpoint_interval=0", "--training.micro_batch_size=2",
                                               "--training.export=" + export_path});
  };
  for (const std::string exported : {"a.safetensors", "a.pt"}) {
    RunResult a = fsdprun.run(under_fsdprun(2, common("a_" + exported, 3, dir / exported)), {}, 120);
    ASSERT_EQ(a.exit_code, 0) << describe(a);
  }
  RunResult b =
      fsdprun.run(under_fsdprun(3, with(common("b", 1, dir / "b.pt"), {"--model.init_from=" + dir / "a.safetensors",
                                                                       "--optimizer.lr=1e-30", "--schedule.min_lr=0"})),
                  {}, 120);
  ASSERT_EQ(b.exit_code, 0) << describe(b);
  std::ofstream(dir / "compare.py") << "import sys, torch\n"
                                       "a, b = torch.load(sys.argv[1]), torch.load(sys.argv[2])\n"
                                       "assert a.keys() == b.keys(), (a.keys(), b.keys())\n"
                                       "for k in a: assert torch.allclose(a[k], b[k], rtol=0, atol=1e-20), k\n"
                                       "print('OK', len(a))\n";
  EXPECT_EQ(
      std::system((fsdp_test::python() + " " + dir / "compare.py" + " " + dir / "a.pt" + " " + dir / "b.pt").c_str()),
      0);
}

TEST(Trainer, TraceHasSpansForComputeCollectivesAndWaitsAndSafetensorsExport) {
  TempDir dir;
  const auto args = with(base_args(dir.path(), 3), {"--logging.trace=true", "--logging.trace_dir=" + dir / "trace",
                                                    "--training.export=" + dir / "model.safetensors"});
  RunResult r = fsdprun.run(under_fsdprun(2, args), {}, 120);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_TRUE(std::filesystem::exists(dir / "model.safetensors/model.safetensors.index.json")) << describe(r);
  for (int rank : {0, 1}) {
    const auto j = nlohmann::json::parse(read_file(dir / ("trace/trace_rank" + std::to_string(rank) + ".json")));
    std::map<std::string, int> names;
    for (const auto& e : j.at("traceEvents")) {
      if (e.at("ph") != "X") continue;
      const std::string name = e.at("name");
      names[name.substr(0, name.find_first_of(" #"))]++;
      if (name.rfind("wait", 0) == 0) names[name.substr(0, name.find(' ', 5))]++;
    }
    EXPECT_EQ(names["forward"], 3) << "rank " << rank;
    EXPECT_EQ(names["backward"], 3);
    EXPECT_EQ(names["optimizer"], 3);
    EXPECT_GE(names["all_gather"], 3 * 3);  // 2 blocks + root per forward (and backward)
    EXPECT_EQ(names["reduce_scatter"], 3 * 3);
  }
}

// ------------------------------------------------------------------ the parameter count

// The count of the first line and of logging.summary_json is the whole model's, not a rank's
// shards, and the one the Transformer's shapes give (test_memory_check.cpp checks the planner's
// count of the presets, which the memory check prints). Sizes of no preset, so that nothing cancels.
TEST(Trainer, PrintsTheWholeModelsParameterCountWhichTheFormulaGives) {
  TempDir dir;
  const auto args = with(base_args(dir.path(), 1),
                         {"--model.n_layers=3", "--model.vocab_size=40", "--model.max_seq_len=24", "--model.dim=32",
                          "--model.n_heads=4", "--training.seq_len=24", "--fsdp_config.checkpoint_interval=0",
                          "--logging.summary_json=" + dir / "summary.json"});
  RunResult r = fsdprun.run(under_fsdprun(2, args), {}, 120);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const auto want = static_cast<int64_t>(transformer_parameter_count(3, 40, 24, 32));
  EXPECT_NE(r.out.find("fsdp-train: " + std::to_string(want) + " parameters (3 layers, dim 32, 4 heads, vocab 40"),
            std::string::npos)
      << "expected " << want << " parameters\n"
      << describe(r);
  const auto summary = nlohmann::json::parse(read_file(dir / "summary.json"));
  EXPECT_EQ(summary.at("params").get<int64_t>(), want);
}

// ------------------------------------------------------------------ mixed precision

constexpr int kMixedSteps = 20;  // checkpoints at 5, 10, 15

// A W=2 run of kMixedSteps steps in `dir` with these extra arguments; exits 0.
RunResult train(const std::string& dir, const std::vector<std::string>& more, const Env& env = {}) {
  RunResult r = fsdprun.run(under_fsdprun(2, with(base_args(dir, kMixedSteps), more)), env, 120);
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  return r;
}

bool has(const RunResult& r, const std::string& text) { return r.out.find(text) != std::string::npos; }

// Every model tensor of a checkpoint is stored as fp32, whatever the run computed in.
void expect_fp32_model(const std::string& checkpoint) {
  const auto meta = nlohmann::json::parse(read_file(checkpoint + "/metadata.json"));
  int model_keys = 0;
  for (const auto& [key, entry] : meta.at("entries").items()) {
    if (key.rfind("model.", 0) != 0) continue;
    ++model_keys;
    EXPECT_EQ(entry.at("dtype"), "Float") << key;
  }
  EXPECT_GT(model_keys, 0) << checkpoint;
}

// A mixed-precision run of kMixedSteps: every step finite, and the loss fell.
void expect_finite_and_learning(const std::map<int64_t, StepMetrics>& metrics) {
  ASSERT_EQ(metrics.size(), static_cast<size_t>(kMixedSteps));
  for (const auto& [step, m] : metrics) {
    EXPECT_TRUE(std::isfinite(m.loss) && std::isfinite(m.grad_norm)) << "step " << step;
  }
  EXPECT_LT(metrics.at(kMixedSteps).loss, metrics.at(1).loss);
}

// The losses of a run resumed at first_step - 1 under another precision: within 0.2 % of the
// uninterrupted run's (bf16 moves them by about 0.01 % here; a model that lost its trained
// weights would be about 2 % off), and returns whether any differs at all.
bool expect_close_losses(const std::map<int64_t, StepMetrics>& got, const std::map<int64_t, StepMetrics>& want,
                         int64_t first_step, const std::string& what) {
  EXPECT_EQ(got.size(), static_cast<size_t>(kMixedSteps - first_step + 1)) << what;
  bool any_differs = false;
  for (const auto& [step, m] : got) {
    EXPECT_GE(step, first_step) << what;
    EXPECT_NEAR(m.loss, want.at(step).loss, 2e-3 * want.at(step).loss) << what << " step " << step;
    any_differs = any_differs || m.loss != want.at(step).loss;
  }
  return any_differs;
}

// mixed_precision: true computes in bf16 (the opening line, each step line and the summary say
// so), learns, keeps fp32 master weights in its checkpoints, and a run resumed from one of
// them continues bitwise as the uninterrupted run did. The CPU flags are replaced by some
// without native bf16, so the start-up check measures both matmul rates and reports them.
TEST(Trainer, MixedPrecisionTrainsInBf16AndResumesBitwiseFromItsOwnCheckpoint) {
  TempDir dir;
  const std::vector<std::string> bf16 = {"--fsdp_config.mixed_precision=true",
                                         "--logging.summary_json=" + dir / "whole/summary.json"};
  const RunResult whole = train(dir / "whole", bf16, {{"FSDP_TRAIN_CPU_FLAGS", "fpu sse2 avx2 avx512f"}});
  EXPECT_TRUE(has(whole, "rank(s), FULL_SHARD, param bf16, reduce fp32;")) << whole.out;
  EXPECT_TRUE(has(whole, "precision: param bf16, reduce fp32")) << whole.out;  // the step line
  EXPECT_TRUE(has(whole, " (param bf16, reduce fp32)\n")) << whole.out;        // the summary line
  EXPECT_TRUE(has(whole, "this CPU has no native bf16 (no avx512_bf16 or amx_bf16 flag): bf16 matmul ")) << whole.out;
  EXPECT_TRUE(has(whole, " GFLOP/s vs fp32 ")) << whole.out;
  const auto summary = nlohmann::json::parse(read_file(dir / "whole/summary.json"));
  EXPECT_EQ(summary.at("param_dtype"), "bfloat16");
  EXPECT_EQ(summary.at("reduce_dtype"), "float32");
  const auto want = read_metrics(dir / "whole/m0.jsonl");
  expect_finite_and_learning(want);
  ASSERT_EQ(want.size(), static_cast<size_t>(kMixedSteps));
  expect_fp32_model(dir / "whole/ckpt/step_10");

  const RunResult resumed = train(dir / "resumed", with(bf16, {"--training.resume=" + dir / "whole/ckpt/step_10"}));
  EXPECT_TRUE(has(resumed, "at step 10")) << resumed.out;
  const auto got = read_metrics(dir / "resumed/m0.jsonl");
  ASSERT_EQ(got.size(), static_cast<size_t>(kMixedSteps - 10));
  for (const auto& [step, m] : got) EXPECT_EQ(m.loss, want.at(step).loss) << "step " << step;  // bitwise
}

// Checkpoints hold the fp32 shards whatever the policy, so a run can change it when it
// resumes: an fp32 checkpoint continues in bf16, and that run's checkpoint in fp32 again, with
// losses close to the fp32 run's.
TEST(Trainer, CheckpointsResumeAcrossAChangeOfPrecision) {
  TempDir dir;
  const RunResult fp32 = train(dir / "fp32", {});
  EXPECT_TRUE(has(fp32, "rank(s), FULL_SHARD, fp32;")) << fp32.out;
  EXPECT_TRUE(has(fp32, "precision: fp32")) << fp32.out;
  EXPECT_FALSE(has(fp32, "native bf16")) << "no bf16, no check\n" << fp32.out;
  const auto want = read_metrics(dir / "fp32/m0.jsonl");

  const RunResult to_bf16 =
      train(dir / "to_bf16", {"--fsdp_config.param_dtype=bfloat16", "--training.resume=" + dir / "fp32/ckpt/step_10"});
  EXPECT_TRUE(has(to_bf16, "resumed from") && has(to_bf16, "at step 10")) << to_bf16.out;
  EXPECT_TRUE(has(to_bf16, "precision: param bf16, reduce fp32")) << to_bf16.out;
  EXPECT_TRUE(has(to_bf16, "native bf16")) << "the start-up check, whatever this CPU has\n" << to_bf16.out;
  EXPECT_TRUE(expect_close_losses(read_metrics(dir / "to_bf16/m0.jsonl"), want, 11, "fp32 -> bf16"))
      << "bf16 gave the fp32 losses bit for bit: the policy did not take effect";
  expect_fp32_model(dir / "to_bf16/ckpt/step_15");

  const RunResult back = train(dir / "back", {"--training.resume=" + dir / "to_bf16/ckpt/step_15"});
  EXPECT_TRUE(has(back, "at step 15") && has(back, "precision: fp32")) << back.out;
  expect_close_losses(read_metrics(dir / "back/m0.jsonl"), want, 16, "bf16 -> fp32");
}

// param_dtype: float16 computes in fp16 on CPU (LibTorch 2.x has fp16 matmuls there) and learns,
// with fp32 master weights in its checkpoints.
TEST(Trainer, Fp16ParametersTrainOnCpu) {
  TempDir dir;
  const RunResult fp16 = train(dir / "fp16", {"--fsdp_config.param_dtype=float16"});
  EXPECT_TRUE(has(fp16, "precision: param fp16, reduce fp32")) << fp16.out;
  expect_finite_and_learning(read_metrics(dir / "fp16/m0.jsonl"));
  expect_fp32_model(dir / "fp16/ckpt/step_10");
}

// ------------------------------------------------------------------ bad configurations

struct BadCase {
  std::string name;
  std::string yaml;               // written to bad.yaml when not empty
  std::vector<std::string> args;  // after the config file
  std::string expected;           // in stderr
  int nproc = 0;                  // > 0: under fsdprun with that many ranks
  int exit_code = 2;              // configuration error, unless the input is a bad file
};

std::vector<BadCase> bad_cases() {
  const std::string tiny = configs_dir() + "/tiny.yaml";
  return {
      {"UnknownKeyInFile", "training:\n  stepz: 3\n", {}, "unknown key 'training.stepz' (did you mean 'steps'?)"},
      {"UnknownSection", "trainer:\n  steps: 3\n", {}, "unknown section 'trainer'"},
      {"WrongType", "training:\n  steps: many\n", {}, "training.steps: expected an integer, got 'many'"},
      {"NegativeSteps", "", {"--training.steps=-5"}, "training.steps: must be >= 1, got -5"},
      {"MissingConfigFile", "", {}, "cannot open config file"},
      {"InvalidYaml", "training: [steps: 3\n", {}, "invalid YAML"},
      {"OverrideWithoutValue", "", {"--training.steps"}, "expected --section.key=value"},
      {"UnknownOverrideKey", "", {"--optimizer.learning_rate=0.1"}, "unknown key 'optimizer.learning_rate'"},
      {"BadBetas",
       "",
       {"--optimizer.betas=[0.9]"},
       "optimizer.betas: expected two values [beta1, beta2], got a list of 1 value"},
      {"BetasNotAList", "", {"--optimizer.betas=0.9"}, "optimizer.betas: expected a list [beta1, beta2], got '0.9'"},
      {"BetaOutOfRange", "", {"--optimizer.beta2=1.5"}, "optimizer.beta2: must be in [0, 1)"},
      // Mixed precision: dtypes by name, and no fp16 compute on CPU.
      {"UnknownParamDtype",
       "",
       {"--fsdp_config.param_dtype=bf16"},
       "fsdp_config.param_dtype: expected one of float32 | bfloat16 | float16, got 'bf16'"},
      {"UnknownReduceDtypeInFile",
       "fsdp_config:\n  reduce_dtype: double\n",
       {},
       "bad.yaml:2: fsdp_config.reduce_dtype: expected one of float32 | bfloat16 | float16, got 'double'"},
      {"Fp16WithAScaler",
       "",
       {"--fsdp_config.fp16=true"},
       "fsdp_config.fp16: true (fp16 compute with a gradient scaler) is not supported on device: cpu"},
      {"ReplicateDegreeNotDividingWorld",
       "",
       {"--fsdp_config.sharding_strategy=HYBRID_SHARD", "--fsdp_config.replicate_degree=3"},
       "fsdp_config.replicate_degree: 3 with sharding_strategy HYBRID_SHARD at a world of 2 rank(s)",
       2},
      {"CudaWithoutAGpu", "", {"--fsdp_config.device=cuda"}, "fsdp_config.device: cuda needs a GPU"},
      {"ModelParallelNotDividingWorld",
       "",
       {"--fsdp_config.model_parallel_size=3"},
       "fsdp_config.model_parallel_size: 3 does not divide the world of 2 rank(s)",
       2},
      {"ModelParallelNotDividingHeads",
       "",
       {"--fsdp_config.model_parallel_size=2", "--model.n_heads=1"},
       "fsdp_config.model_parallel_size: 2 does not divide model.n_heads: 1",
       2},
      {"ModelParallelNotDividingVocab",
       "",
       {"--fsdp_config.model_parallel_size=2", "--model.vocab_size=7"},
       "fsdp_config.model_parallel_size: 2 with fsdp_config.vocab_parallel: true (the default) does not divide "
       "model.vocab_size: 7",
       2},
      {"WorldSizeMismatch",
       "",
       {"--fsdp_config.world_size=4"},
       "fsdp_config.world_size is 4 but the launcher started 2",
       2},
      {"SeqLongerThanModel",
       "",
       {"--training.seq_len=999"},
       "command line (--training.seq_len=999): training.seq_len (999) is longer than model.max_seq_len (16, "
       "model.preset tiny's)"},
      {"SeqLongerThanModelInFile",
       "model:\n  max_seq_len: 16\ntraining:\n  seq_len: 100000\n",
       {},
       "bad.yaml:4: training.seq_len (100000) is longer than model.max_seq_len (16, set at "},
      {"KeyOfAnotherSection",
       "",
       {"--training.log_interval=5"},
       "unknown key 'training.log_interval' (did you mean 'logging.log_interval'? it is in another section)"},
      {"KeyNearMiss", "", {"--training.stpes=5"}, "unknown key 'training.stpes' (did you mean 'steps'?)"},
      {"EmptyConfigFile", "# only a comment\n", {}, "bad.yaml: the config file is empty (no sections)"},
      {"ConfigFileIsADevice", "", {}, "/dev/zero: is not a regular file"},
      {"ConfigFileTooLarge", "", {}, "the config file is larger than 1 MiB"},
      {"ControlBytesInYamlAreEscaped",
       "logging:\n  progress: \"\\e[31mred\"\n",
       {},
       "bad.yaml:2: logging.progress: expected one of auto | on | off, got '\\x1b[31mred'"},
      {"LossChunksZero", "", {"--training.loss_chunks=0"}, "training.loss_chunks: must be >= 1, got 0"},
      {"OutputHeadGroupWithNoShard",
       "",
       {"--fsdp_config.output_head_group=true", "--fsdp_config.sharding_strategy=NO_SHARD"},
       "fsdp_config.output_head_group: true with fsdp_config.sharding_strategy: NO_SHARD is not supported"},
      {"PrefetchDepthWithNoShard",
       "",
       {"--fsdp_config.prefetch_depth=2", "--fsdp_config.sharding_strategy=NO_SHARD"},
       "fsdp_config.prefetch_depth: 2 with fsdp_config.sharding_strategy: NO_SHARD is not supported"},
      {"PrefetchDepthZero", "", {"--fsdp_config.prefetch_depth=0"}, "fsdp_config.prefetch_depth: must be >= 1, got 0"},
      {"ReduceScatterBuffersWithNoShard",
       "",
       {"--fsdp_config.reduce_scatter_max_input_buffers=2", "--fsdp_config.sharding_strategy=NO_SHARD"},
       "fsdp_config.reduce_scatter_max_input_buffers: 2 with fsdp_config.sharding_strategy: NO_SHARD is not supported"},
      {"ReduceScatterBuffersZero",
       "",
       {"--fsdp_config.reduce_scatter_max_input_buffers=0"},
       "fsdp_config.reduce_scatter_max_input_buffers: must be >= 1, got 0"},
      {"LossChunksMoreThanPositions",
       "",
       {"--training.seq_len=8", "--training.loss_chunks=9"},
       "training.loss_chunks (9) is more than the sequence has positions (training.seq_len 8)"},
      {"HeadsDoNotDivideDim", "", {"--model.n_heads=5"}, "model.dim (16) must be divisible by model.n_heads (5)"},
      {"TokensWithoutPath", "", {"--data.source=tokens"}, "data.path: required when data.source is tokens"},
      {"MissingTokenFile",
       "",
       {"--data.source=tokens", "--data.path=/nonexistent/x.tokens"},
       "/nonexistent/x.tokens: cannot open the token file",
       0,
       1},
      {"TextInsteadOfTokenFile", "", {"--data.source=tokens", "--data.path=" + tiny}, "not a token file", 0, 1},
      {"DirectoryAsTokenFile",
       "",
       {"--data.source=tokens", "--data.path=" + configs_dir()},
       configs_dir() + ": is a directory, not a token file (data.path)",
       0,
       1},
      {"MissingInitFrom", "", {"--model.init_from=/nonexistent/init.pt"}, "/nonexistent/init.pt"},
      {"MissingResumeCheckpoint", "", {"--training.resume=/nonexistent/step_5"}, "/nonexistent/step_5"},
      {"TwoConfigFiles", "", {tiny}, "only one is read"},
      {"MinLrAboveLr",
       "",
       {"--optimizer.lr=1e-4", "--schedule.min_lr=1e-3"},
       "schedule.min_lr (0.001) must not exceed optimizer.lr (0.0001)"},
      // The YAML is read strictly: a repeated key or section, an unterminated quote.
      {"KeyGivenTwice",
       "training:\n  steps: 3\n  seed: 1\n  steps: 4\n",
       {},
       "bad.yaml:4: key 'training.steps' is given twice (lines 2 and 4)"},
      {"SectionGivenTwice",
       "training:\n  steps: 3\nsample:\n  length: 0\ntraining:\n  seed: 2\n",
       {},
       "bad.yaml:5: section 'training' is given twice (lines 1 and 5)"},
      {"UnterminatedQuote",
       "sample:\n  prompt: \"The GNU\n  temperature: 0.7\nlogging:\n  log_interval: 3\n",
       {},
       "bad.yaml:2: invalid YAML: a quoted value starts on this line and is not closed on it"},
      {"UnknownShortOption", "", {"-x"}, "command line: unknown option '-x'"},
      {"UnknownLongOption", "", {"--verbose"}, "command line: unknown option '--verbose'"},
      {"ConfigFileIsADirectory", "", {}, "is a directory, not a config file"},
      {"InitFromIsADirectory",
       "",
       {"--model.init_from=" + configs_dir()},
       "model.init_from: " + configs_dir() + " is a directory"},
      // Sizes no machine holds: refused before anything is allocated, naming the key.
      {"HugeDim", "", {"--model.dim=1000000000"}, "model.dim: this run needs at least"},
      {"HugeVocab", "", {"--model.vocab_size=1000000000000"}, "model.vocab_size: this run needs at least"},
      {"HugeLayers", "", {"--model.n_layers=1000000000"}, "model.n_layers: this run needs at least"},
      {"DimSquaredOverflowsInt64", "", {"--model.dim=4611686018427387904"}, "model.dim: this run needs at least"},
      {"VocabTimesDimOverflowsInt64",
       "",
       {"--model.vocab_size=4611686018427387904", "--model.dim=64"},
       "model.vocab_size: this run needs at least"},
      {"HugeMicroBatch",
       "",
       {"--training.micro_batch_size=1000000000000"},
       "training.micro_batch_size: this run needs at least"},
      {"HugeDimUnderFsdprun", "", {"--model.dim=1000000000"}, "MemTotal", 2},
      {"CollectiveTimeoutZero",
       "",
       {"--fsdp_config.collective_timeout_s=0"},
       "fsdp_config.collective_timeout_s: must be in [0.001, "},
      // Found at start-up, not at the first save: a checkpoint_dir under a regular file.
      {"CheckpointDirUnderAFile",
       "",
       {"--fsdp_config.checkpoint_dir=" + tiny + "/ckpt"},
       "fsdp_config.checkpoint_dir: cannot create " + tiny + "/ckpt",
       2},
      {"CheckpointDirIsAFile",
       "",
       {"--fsdp_config.checkpoint_dir=" + tiny},
       "fsdp_config.checkpoint_dir: " + tiny + " exists and is not a directory"},
  };
}

class BadConfig : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadConfig, FailsNamingTheProblem) {
  const BadCase& c = GetParam();
  TempDir dir;
  std::string config = configs_dir() + "/tiny.yaml";
  if (c.name == "MissingConfigFile") config = dir / "missing.yaml";
  if (c.name == "ConfigFileIsADirectory") config = dir.path();
  if (c.name == "ConfigFileIsADevice") config = "/dev/zero";
  if (c.name == "ConfigFileTooLarge") {
    config = dir / "huge.yaml";
    std::ofstream(config) << std::string(2 << 20, '#');
  }
  if (!c.yaml.empty()) {
    config = dir / "bad.yaml";
    std::ofstream(config) << c.yaml;
  }
  std::vector<std::string> args = {config, "--fsdp_config.checkpoint_dir=" + dir / "ckpt", "--training.steps=2",
                                   "--training.export=none"};
  args.insert(args.end(), c.args.begin(), c.args.end());
  RunResult r = c.nproc > 0 ? fsdprun.run(under_fsdprun(c.nproc, args), {}, 60) : trainer.run(args, {}, 60, dir.path());
  EXPECT_FALSE(r.timed_out) << describe(r);
  if (c.nproc > 0) {  // fsdprun exits 1 when its group fails, naming the worker's exit code
    EXPECT_EQ(r.exit_code, 1) << describe(r);
    EXPECT_NE(r.err.find("exited with code " + std::to_string(c.exit_code)), std::string::npos) << describe(r);
  } else {
    EXPECT_EQ(r.exit_code, c.exit_code) << describe(r);
  }
  EXPECT_NE((r.err + r.out).find(c.expected), std::string::npos) << "expected: " << c.expected << "\n" << describe(r);
  // One line per problem and rank: no C++ backtrace.
  EXPECT_EQ((r.err + r.out).find("frame #"), std::string::npos) << describe(r);
}

INSTANTIATE_TEST_SUITE_P(Trainer, BadConfig, ::testing::ValuesIn(bad_cases()),
                         [](const ::testing::TestParamInfo<BadCase>& i) { return i.param.name; });

}  // namespace

// offload_params (with offload_optimizer_state) runs FSDP's CPU offload path, which on device
// cpu copies nothing: the run is bitwise the plain one, says so once, and resumes bitwise.
TEST(Trainer, OffloadTrainsBitwiseLikeNoOffloadAndResumes) {
  TempDir dir;
  const std::vector<std::string> offload = {"--fsdp_config.offload_params=true",
                                            "--fsdp_config.offload_optimizer_state=true"};
  train(dir / "plain", {});
  const RunResult whole = train(dir / "offload", offload);
  EXPECT_TRUE(has(whole, "on device cpu device memory is host memory, so the sharded parameters")) << whole.out;
  const auto want = read_metrics(dir / "plain/m0.jsonl");
  const auto got = read_metrics(dir / "offload/m0.jsonl");
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [step, m] : got) EXPECT_EQ(m.loss, want.at(step).loss) << "step " << step;
  train(dir / "resumed", with(offload, {"--training.resume=" + dir / "offload/ckpt/step_10"}));
  for (const auto& [step, m] : read_metrics(dir / "resumed/m0.jsonl")) {
    EXPECT_EQ(m.loss, want.at(step).loss) << "step " << step;
  }
}

// activation_checkpointing recomputes every (or every k-th) block's forward in backward: the
// same math, so the losses equal the plain run's, and a checkpointed run resumes bitwise.
TEST(Trainer, ActivationCheckpointingTrainsLikeWithoutAndResumes) {
  TempDir dir;
  train(dir / "plain", {});
  const auto want = read_metrics(dir / "plain/m0.jsonl");
  for (const char* every : {"1", "2"}) {
    SCOPED_TRACE(every);
    const std::vector<std::string> ac = {"--fsdp_config.activation_checkpointing=true",
                                         std::string("--fsdp_config.activation_checkpointing_every=") + every};
    const std::string run = dir / (std::string("ac") + every);
    train(run, ac);
    const auto got = read_metrics(run + "/m0.jsonl");
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [step, m] : got) EXPECT_NEAR(m.loss, want.at(step).loss, 1e-6) << "step " << step;
  }
  train(dir / "resumed",
        {"--fsdp_config.activation_checkpointing=true", "--training.resume=" + dir / "ac1/ckpt/step_10"});
  for (const auto& [step, m] : read_metrics(dir / "resumed/m0.jsonl")) {
    EXPECT_NEAR(m.loss, want.at(step).loss, 1e-6) << "step " << step;
  }
}

// training.loss_chunks computes the loss a piece of the rows at a time, the head and loss one
// autograd function: the same math up to float rounding, so the losses follow the one-piece
// run's, here with unequal pieces and checkpointed blocks, with the head as an FSDP group of
// its own (fsdp_config.output_head_group), and under NO_SHARD (the head's weight gets one
// gradient, so fsdp::replicate's buckets are reduced once); a chunked run resumes bitwise from
// its own checkpoint.
TEST(Trainer, LossChunksTrainLikeTheWholeLogitsAndResumeBitwise) {
  TempDir dir;
  train(dir / "plain", {});
  const auto want = read_metrics(dir / "plain/m0.jsonl");
  const std::vector<std::string> chunked = {"--training.loss_chunks=5", "--fsdp_config.activation_checkpointing=true"};
  train(dir / "chunked", chunked);
  const auto got = read_metrics(dir / "chunked/m0.jsonl");
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [step, m] : got) EXPECT_NEAR(m.loss, want.at(step).loss, 1e-5) << "step " << step;
  train(dir / "head_group", with(chunked, {"--fsdp_config.output_head_group=true"}));
  for (const auto& [step, m] : read_metrics(dir / "head_group/m0.jsonl")) {
    EXPECT_NEAR(m.loss, want.at(step).loss, 1e-5) << "head group, step " << step;
  }
  train(dir / "no_shard", {"--fsdp_config.sharding_strategy=NO_SHARD"});
  const auto no_shard = read_metrics(dir / "no_shard/m0.jsonl");
  train(dir / "no_shard_chunked", {"--fsdp_config.sharding_strategy=NO_SHARD", "--training.loss_chunks=5"});
  for (const auto& [step, m] : read_metrics(dir / "no_shard_chunked/m0.jsonl")) {
    EXPECT_NEAR(m.loss, no_shard.at(step).loss, 1e-5) << "NO_SHARD, step " << step;
  }
  train(dir / "resumed", with(chunked, {"--training.resume=" + dir / "chunked/ckpt/step_10"}));
  const auto resumed = read_metrics(dir / "resumed/m0.jsonl");
  EXPECT_FALSE(resumed.empty());
  for (const auto& [step, m] : resumed) EXPECT_EQ(m.loss, got.at(step).loss) << "step " << step;
}

// The link's schedule changes when each collective is issued, never what it sums: a Llama with its
// head as an FSDP group of its own, 3 groups all-gathered ahead and 2 reduce-scatters in flight
// trains with the default run's losses, bit for bit, under FULL_SHARD and under HSDP (2 x 2); a
// tied head cannot be a group of its own and is refused by name; the Transformer takes the same
// prefetch depth.
TEST(Trainer, LinkSchedulingTrainsBitwiseLikeTheDefault) {
  TempDir dir;
  std::string json = read_file(configs_dir() + "/llama/config.json");
  const std::string tied = "\"tie_word_embeddings\": true";
  ASSERT_NE(json.find(tied), std::string::npos);
  std::ofstream(dir / "tied.json") << json;
  json.replace(json.find(tied), tied.size(), "\"tie_word_embeddings\": false");
  std::ofstream(dir / "untied.json") << json;
  const std::vector<std::string> scheduled = {"--fsdp_config.output_head_group=true", "--fsdp_config.prefetch_depth=3",
                                              "--fsdp_config.reduce_scatter_max_input_buffers=2"};
  auto llama = [&](const std::string& run, int world, const std::string& config, std::vector<std::string> more) {
    std::vector<std::string> args = {configs_dir() + "/llama.yaml",
                                     "--model.hf_config=" + dir / config,
                                     "--data.source=synthetic",
                                     "--training.steps=4",
                                     "--training.seq_len=32",
                                     "--training.micro_batch_size=2",
                                     "--training.resume=never",
                                     "--training.export=none",
                                     "--fsdp_config.checkpoint_interval=0",
                                     "--fsdp_config.checkpoint_dir=" + dir / run + "/ckpt",
                                     "--logging.jsonl=" + dir / run + "/m{rank}.jsonl",
                                     "--logging.progress=off"};
    return fsdprun.run(under_fsdprun(world, with(args, more)), {}, 120);
  };
  const std::vector<std::string> hsdp = {"--fsdp_config.sharding_strategy=HYBRID_SHARD",
                                         "--fsdp_config.replicate_degree=2"};
  for (const auto& [name, world, strategy] : {std::tuple{std::string("full_shard"), 2, std::vector<std::string>{}},
                                              std::tuple{std::string("hsdp"), 4, hsdp}}) {
    SCOPED_TRACE(name);
    const RunResult plain = llama(name + "_plain", world, "untied.json", strategy);
    ASSERT_EQ(plain.exit_code, 0) << describe(plain);
    const RunResult r = llama(name + "_scheduled", world, "untied.json", with(strategy, scheduled));
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    const auto want = read_metrics(dir / name + "_plain/m0.jsonl");
    const auto got = read_metrics(dir / name + "_scheduled/m0.jsonl");
    ASSERT_EQ(got.size(), 4u);
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [step, m] : got) EXPECT_EQ(m.loss, want.at(step).loss) << "step " << step;
  }
  const RunResult refused = llama("tied", 2, "tied.json", scheduled);
  EXPECT_NE(refused.exit_code, 0) << describe(refused);
  EXPECT_NE((refused.out + refused.err).find("fsdp_config.output_head_group: true with tie_word_embeddings"),
            std::string::npos)
      << describe(refused);
  train(dir / "transformer_plain", {});
  train(dir / "transformer_scheduled", {"--fsdp_config.prefetch_depth=2"});
  const auto want = read_metrics(dir / "transformer_plain/m0.jsonl");
  for (const auto& [step, m] : read_metrics(dir / "transformer_scheduled/m0.jsonl")) {
    EXPECT_EQ(m.loss, want.at(step).loss) << "Transformer, step " << step;
  }
}

// optimizer.fused: FusedAdamW has AdamW's math (the losses agree to float rounding) and its
// checkpoints, so a fused run's checkpoint resumes under torch::optim::AdamW.
TEST(Trainer, FusedAdamWTrainsLikeAdamWAndItsCheckpointResumesWithAdamW) {
  TempDir dir;
  train(dir / "adamw", {});
  train(dir / "fused", {"--optimizer.fused=true"});
  const auto want = read_metrics(dir / "adamw/m0.jsonl");
  const auto got = read_metrics(dir / "fused/m0.jsonl");
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [step, m] : got) EXPECT_NEAR(m.loss, want.at(step).loss, 1e-5) << "step " << step;
  train(dir / "resumed", {"--training.resume=" + dir / "fused/ckpt/step_10"});
  for (const auto& [step, m] : read_metrics(dir / "resumed/m0.jsonl")) {
    EXPECT_NEAR(m.loss, want.at(step).loss, 1e-5) << "step " << step;
  }
}
