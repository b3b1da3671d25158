// test_config.cpp — fsdp-train's configuration: shipped configs, overrides, errors, support
// checks and the launcher agreement (single process, no torch).
#include "config/config.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

using namespace fsdp::train;

namespace {

const std::string kConfigs = FSDP_TRAIN_CONFIGS_DIR;
// Scratch files go beside the test program, in the build folder (found at run time: a compile
// definition naming it would keep the CPU and CUDA configurations from sharing this object file).
const std::string kScratch = std::filesystem::read_symlink("/proc/self/exe").parent_path().string();

// Writes text to a scratch file named after the running test; returns its path.
std::string write_yaml(const std::string& text) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string path = kScratch + "/" + info->name() + ".yaml";
  std::ofstream(path) << text;
  return path;
}

// fn must throw ConfigError whose message contains every one of parts.
void expect_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
    return;
  }
  ADD_FAILURE() << "no ConfigError; expected one mentioning " << parts.at(0);
}

// A file with one section holding one key: the error must name the key and the file.
void expect_file_error(const std::string& section, const std::string& line, const std::string& key) {
  SCOPED_TRACE(section + ": " + line);
  const std::string path = write_yaml(section + ":\n  " + line + "\n");
  expect_error([&] { load_config(path, {}); }, {key, path});
}

void expect_cli_error(const std::string& arg, const std::string& key) {
  SCOPED_TRACE(arg);
  expect_error([&] { load_config("", {arg}); }, {key, "command line"});
}

std::vector<std::string> with_args(std::vector<std::string> args, const std::vector<std::string>& more) {
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

}  // namespace

TEST(TrainConfig, ShippedConfigsLoadAndAreSupported) {
  for (const char* name : {"tiny", "small", "medium", "seed002", "gpl3-spm"}) {
    SCOPED_TRACE(name);
    if (std::string(name) == "gpl3-spm" && !built_with_sentencepiece()) {  // its data.tokenizer needs it
      expect_error([] { load_config(kConfigs + "/gpl3-spm.yaml", {}); },
                   {"gpl3-spm.yaml: data.tokenizer", "FSDP_WITH_SENTENCEPIECE"});
      continue;
    }
    TrainConfig c = load_config(kConfigs + "/" + name + ".yaml", {});
    EXPECT_NO_THROW(check_supported(c, DeviceSupport{true, ""}));  // seed002 is written for GPUs
    EXPECT_TRUE(reshard_after_forward(c));
  }
  TrainConfig small = load_config(kConfigs + "/small.yaml", {});
  EXPECT_EQ(small.model.preset, "small");
  EXPECT_EQ(small.training.seq_len, 256);
  EXPECT_EQ(*small.model.dropout_p, 0.0);
  EXPECT_FALSE(small.model.n_layers.has_value());  // no override: the preset's
}

// The example's 13 fsdp_config values, as written.
TEST(TrainConfig, Seed002HoldsTheExamplesValuesAsWritten) {
  const TrainConfig c = load_config(kConfigs + "/seed002.yaml", {});
  const FsdpConfig& f = c.fsdp_config;
  EXPECT_EQ(f.world_size, 8);
  EXPECT_EQ(f.local_rank, 0);
  EXPECT_TRUE(f.shard_optimizer_state);
  EXPECT_TRUE(f.mixed_precision);
  EXPECT_TRUE(f.fp16);
  EXPECT_TRUE(f.activation_checkpointing);
  EXPECT_EQ(f.device, "cuda");
  EXPECT_TRUE(f.offload_params);
  EXPECT_FALSE(f.offload_optimizer_state);
  EXPECT_TRUE(f.use_reentrant);
  EXPECT_EQ(f.model_parallel_size, 2);
  EXPECT_EQ(f.checkpoint_interval, 1000);
  EXPECT_EQ(f.checkpoint_dir, "./checkpoints");
  // fp16 wins over mixed_precision's bf16; the optimizer steps on the GPU (the state stays there).
  EXPECT_EQ(precision_of(f).describe(), "param fp16, reduce fp32 with loss scaling");
  // As written it runs where there is a GPU; without one the device is named.
  EXPECT_NO_THROW(check_supported(c, DeviceSupport{true, ""}));
  expect_error(
      [&] {
        check_supported(c, DeviceSupport{false, "no GPU here"});
      },
      {"fsdp_config.device: cuda needs a GPU", "no GPU here"});
}

// On a machine without a GPU the example runs with two overrides: device: cpu, and fp16: false,
// since fp16 with loss scaling is the GPU recipe (mixed_precision then computes in bf16).
TEST(TrainConfig, Seed002OnACpuNeedsOnlyTheDeviceAndFp16Overridden) {
  const std::vector<std::string> on_cpu = {"--fsdp_config.device=cpu", "--fsdp_config.fp16=false"};
  TrainConfig c = load_config(kConfigs + "/seed002.yaml", on_cpu);
  EXPECT_NO_THROW(check_supported(c));
  EXPECT_EQ(precision_of(c.fsdp_config).describe(), "param bf16, reduce fp32");
  EXPECT_TRUE(c.fsdp_config.vocab_parallel);
  EXPECT_NO_THROW(check_model_parallel(c, 8, 4, 16, 8));
  expect_error([&] { check_model_parallel(c, 3, 4, 16, 8); }, {"fsdp_config.model_parallel_size: 2", "world of 3"});
  expect_error([&] { check_model_parallel(c, 8, 3, 15, 8); },
               {"fsdp_config.model_parallel_size: 2", "model.n_heads: 3"});
  expect_error([&] { check_model_parallel(c, 8, 4, 16, 7); },
               {"fsdp_config.model_parallel_size: 2", "fsdp_config.vocab_parallel: true", "model.vocab_size: 7",
                "vocab_parallel: false"});
  TrainConfig whole_head =
      load_config(kConfigs + "/seed002.yaml", with_args(on_cpu, {"--fsdp_config.vocab_parallel=false"}));
  EXPECT_NO_THROW(check_model_parallel(whole_head, 8, 4, 16, 7));
  expect_error(
      [&] {
        check_supported(load_config(kConfigs + "/seed002.yaml",
                                    with_args(on_cpu, {"--fsdp_config.sharding_strategy=HYBRID_SHARD"})));
      },
      {"fsdp_config.model_parallel_size: 2", "HYBRID_SHARD", "not supported yet"});
  EXPECT_NO_THROW(check_against_launcher(c, 8, 5));  // local_rank 0 = every rank's
  expect_error([&] { check_against_launcher(c, 2, 0); }, {"world_size", "8", "2"});
  // fp16 left on: refused on cpu, naming the key and the device.
  expect_error([] { check_supported(load_config(kConfigs + "/seed002.yaml", {"--fsdp_config.device=cpu"})); },
               {"fsdp_config.fp16: true", "not supported on device: cpu", "mixed_precision: true"});
}

TEST(TrainConfig, DefaultsWithoutFile) {
  TrainConfig c = load_config("", {});
  EXPECT_EQ(c.fsdp_config.sharding_strategy, ShardingStrategy::FULL_SHARD);
  EXPECT_EQ(c.training.steps, 100);
  EXPECT_EQ(c.data.source, "synthetic");
  EXPECT_NO_THROW(check_supported(c));
}

TEST(TrainConfig, OverridesApplyAfterYaml) {
  TrainConfig c =
      load_config(kConfigs + "/tiny.yaml",
                  {"--training.steps=7", "--fsdp_config.sharding_strategy=SHARD_GRAD_OP",
                   "--optimizer.betas=[0.8, 0.95]", "--optimizer.lr=3e-4", "--model.n_layers=3", "--logging.trace=true",
                   "--logging.jsonl=m.jsonl", "--training.resume=never", "--training.steps=9"});
  EXPECT_EQ(c.training.steps, 9);  // the last override of a key wins
  EXPECT_EQ(c.fsdp_config.sharding_strategy, ShardingStrategy::SHARD_GRAD_OP);
  EXPECT_FALSE(reshard_after_forward(c));
  EXPECT_DOUBLE_EQ(c.optimizer.beta1, 0.8);
  EXPECT_DOUBLE_EQ(c.optimizer.beta2, 0.95);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 3e-4);
  EXPECT_EQ(c.model.n_layers, 3);
  EXPECT_TRUE(c.logging.trace);
  EXPECT_EQ(c.logging.jsonl, "m.jsonl");
  EXPECT_EQ(c.training.resume, "never");
  EXPECT_EQ(c.model.preset, "tiny");  // untouched keys keep the file's value
  // An empty value empties a string key.
  EXPECT_EQ(load_config("", {"--logging.jsonl=x", "--logging.jsonl="}).logging.jsonl, "");
}

TEST(TrainConfig, TrainerKeys) {
  TrainConfig c = load_config(
      kConfigs + "/gpl3.yaml",
      {"--model.init_from=init.pt", "--training.export=out.safetensors", "--training.keep_checkpoints=0",
       "--sample.length=5", "--sample.temperature=1.5", "--logging.summary_json=s.json", "--logging.trace_dir=t"});
  EXPECT_EQ(c.model.init_from, "init.pt");
  EXPECT_EQ(c.training.export_path, "out.safetensors");
  EXPECT_EQ(c.training.keep_checkpoints, 0);
  EXPECT_EQ(c.sample.length, 5);
  EXPECT_DOUBLE_EQ(c.sample.temperature, 1.5);
  EXPECT_EQ(c.sample.prompt, "The GNU General Public License is ");  // from the file
  EXPECT_EQ(c.logging.summary_json, "s.json");
  EXPECT_EQ(c.logging.trace_dir, "t");
  EXPECT_EQ(c.data.source, "tokens");
  EXPECT_THROW(load_config("", {"--sample.temperature=0"}), ConfigError);
  EXPECT_THROW(load_config("", {"--sample.length=-1"}), ConfigError);
  EXPECT_THROW(load_config("", {"--training.export="}), ConfigError);
}

// logging.tensorboard_dir, and the configuration as given (the file's text and the overrides in
// order), which the TensorBoard file records as text.
TEST(TrainConfig, TensorBoardDirAndSource) {
  const std::string text = "# a comment kept\ntraining:\n  steps: 5\n";
  const std::string path = write_yaml(text);
  TrainConfig c = load_config(path, {"--logging.tensorboard_dir=tb", "--training.steps=7"});
  EXPECT_EQ(c.logging.tensorboard_dir, "tb");
  EXPECT_EQ(c.source.path, path);
  EXPECT_EQ(c.source.text, text);
  EXPECT_EQ(c.source.overrides, (std::vector<std::string>{"--logging.tensorboard_dir=tb", "--training.steps=7"}));
  EXPECT_EQ(load_config("", {}).logging.tensorboard_dir, "");  // off by default
  EXPECT_TRUE(load_config("", {}).source.path.empty());
  EXPECT_TRUE(load_config("", {}).source.text.empty());
}

TEST(TrainConfig, BetasAsSeparateKeys) {
  const std::string path = write_yaml("optimizer:\n  beta1: 0.5\n  beta2: 0.6\n");
  TrainConfig c = load_config(path, {"--optimizer.beta2=0.7"});
  EXPECT_DOUBLE_EQ(c.optimizer.beta1, 0.5);
  EXPECT_DOUBLE_EQ(c.optimizer.beta2, 0.7);
}

TEST(TrainConfig, FileErrorsNameKeyAndFile) {
  expect_file_error("training", "stepz: 10", "training.stepz");
  expect_file_error("training", "steps: abc", "training.steps");
  expect_file_error("training", "steps: 1.5", "training.steps");
  expect_file_error("training", "steps: 0", "training.steps");
  expect_file_error("training", "steps: -3", "training.steps");
  expect_file_error("training", "micro_batch_size: 0", "training.micro_batch_size");
  expect_file_error("training", "gradient_accumulation_steps: 0", "training.gradient_accumulation_steps");
  expect_file_error("training", "max_grad_norm: -1", "training.max_grad_norm");
  expect_file_error("optimizer", "lr: 0", "optimizer.lr");
  expect_file_error("optimizer", "lr: -1e-3", "optimizer.lr");
  expect_file_error("optimizer", "lr: [1]", "optimizer.lr");
  expect_file_error("optimizer", "betas: [0.9, 1.0]", "optimizer.betas");
  expect_file_error("optimizer", "betas: [0.9]", "optimizer.betas");
  expect_file_error("optimizer", "beta1: -0.1", "optimizer.beta1");
  expect_file_error("optimizer", "eps: 0", "optimizer.eps");
  expect_file_error("optimizer", "weight_decay: -0.1", "optimizer.weight_decay");
  expect_file_error("model", "dropout_p: 1.0", "model.dropout_p");
  expect_file_error("model", "preset: huge", "model.preset");
  expect_file_error("model", "n_heads: 0", "model.n_heads");
  expect_file_error("fsdp_config", "world_size: 0", "fsdp_config.world_size");
  expect_file_error("fsdp_config", "local_rank: -2", "fsdp_config.local_rank");
  expect_file_error("fsdp_config", "checkpoint_interval: -1", "fsdp_config.checkpoint_interval");
  expect_file_error("fsdp_config", "sharding_strategy: PARTIAL", "fsdp_config.sharding_strategy");
  expect_file_error("fsdp_config", "fp16: maybe", "fsdp_config.fp16");
  expect_file_error("fsdp_config", "device: tpu", "fsdp_config.device");
  expect_file_error("fsdp_config", "model_parallel_size: 0", "fsdp_config.model_parallel_size");
  expect_file_error("schedule", "warmup_steps: -1", "schedule.warmup_steps");
  expect_file_error("data", "source: web", "data.source");
  expect_file_error("data", "source: tokens", "data.path");  // tokens without a path
  expect_file_error("logging", "progress: sometimes", "logging.progress");
  expect_file_error("logging", "log_interval: 0", "logging.log_interval");
  expect_file_error("trainig", "steps: 1", "trainig");  // unknown section
}

TEST(TrainConfig, ErrorsGiveLineAndSuggestion) {
  const std::string path = write_yaml("training:\n  steps: 5\n  seq_lne: 8\n");
  expect_error([&] { load_config(path, {}); },
               {path + ":3", "unknown key 'training.seq_lne'", "did you mean 'seq_len'"});
  const std::string sec = write_yaml("optimiser:\n  lr: 1\n");
  expect_error([&] { load_config(sec, {}); }, {"unknown section 'optimiser'", "did you mean 'optimizer'"});
}

// A key put in the wrong section is answered with its section; otherwise a near miss anywhere.
TEST(TrainConfig, UnknownKeysSuggestTheSameNameElsewhereAndNearMisses) {
  expect_error(
      [] { load_config("", {"--training.log_interval=5"}); },
      {"unknown key 'training.log_interval'", "did you mean 'logging.log_interval'? it is in another section"});
  expect_error([] { load_config("", {"--model.seed=5"}); },
               {"unknown key 'model.seed'", "'training.seed' or 'sample.seed'"});
  expect_error([] { load_config("", {"--training.stesp=5"}); }, {"did you mean 'steps'"});
  expect_error([] { load_config("", {"--optimizer.betas=[0.9]"}); },
               {"optimizer.betas: expected two values [beta1, beta2], got a list of 1 value"});
  expect_error([] { load_config("", {"--optimizer.betas=[0.9, 0.95, 0.99]"}); }, {"got a list of 3 values"});
}

// Where each key was set, for the errors found after loading (training.seq_len against the model).
TEST(TrainConfig, OriginsSayWhereEachKeyWasSet) {
  const std::string path = write_yaml("training:\n  steps: 5\n  seq_len: 8\n");
  const TrainConfig c = load_config(path, {"--training.steps=7"});
  EXPECT_EQ(origin_of(c, "training.seq_len"), path + ":3");
  EXPECT_EQ(origin_of(c, "training.steps"), "command line (--training.steps=7)");
  EXPECT_EQ(origin_of(c, "model.max_seq_len"), "");
}

TEST(TrainConfig, EmptyOversizedAndNonRegularConfigFilesAreRefused) {
  const std::string empty = write_yaml("# nothing but a comment\n");
  expect_error([&] { load_config(empty, {}); }, {empty + ": the config file is empty", "give no config file"});
  const std::string huge = write_yaml(std::string(size_t{1} << 20, '#') + "\n");
  expect_error([&] { load_config(huge, {}); }, {huge + ": the config file is larger than 1 MiB"});
  expect_error([] { load_config("/dev/zero", {}); }, {"/dev/zero: is not a regular file"});
  EXPECT_NO_THROW(load_config("", {}));  // no file at all: the built-in defaults
}

TEST(TrainConfig, MalformedFiles) {
  expect_error([] { load_config("/nonexistent/x.yaml", {}); }, {"/nonexistent/x.yaml", "cannot open"});
  const std::string bad = write_yaml("training: [steps: 1\n");
  expect_error([&] { load_config(bad, {}); }, {bad, "invalid YAML"});
  const std::string list = write_yaml("- training\n");
  expect_error([&] { load_config(list, {}); }, {list, "mapping"});
  const std::string scalar_section = write_yaml("training: 5\n");
  expect_error([&] { load_config(scalar_section, {}); }, {scalar_section, "training", "mapping"});
}

TEST(TrainConfig, CommandLineErrorsNameKey) {
  expect_cli_error("--training.steps=abc", "training.steps");
  expect_cli_error("--training.steps=0", "training.steps");
  expect_cli_error("--training.stepz=3", "training.stepz");
  expect_cli_error("--trainer.steps=3", "trainer");
  expect_cli_error("--fsdp_config.sharding_strategy=PARTIAL", "fsdp_config.sharding_strategy");
  expect_cli_error("--optimizer.betas=[0.9,1.5]", "optimizer.betas");
  expect_cli_error("--optimizer.betas=[0.9", "optimizer.betas");  // malformed YAML value
  expect_cli_error("--data.source=tokens", "data.path");
  expect_cli_error("--training.steps", "--training.steps");  // no '='
  expect_cli_error("training.steps=3", "training.steps=3");  // no '--'
  expect_cli_error("--steps=3", "--steps=3");                // no section
}

TEST(TrainConfig, CheckSupportedRejectsEachUnsupportedKey) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--fsdp_config.shard_optimizer_state=false", "fsdp_config.shard_optimizer_state"},
  };
  for (const auto& [arg, key] : cases) {
    SCOPED_TRACE(arg);
    TrainConfig c = load_config(kConfigs + "/tiny.yaml", {arg});  // loads: the value is valid
    expect_error([&] { check_supported(c); }, {key, "not supported yet"});
  }
  // device: cuda is refused where the machine has no GPU, with the reason the program gives.
  const TrainConfig on_gpu = load_config(kConfigs + "/tiny.yaml", {"--fsdp_config.device=cuda"});
  expect_error(
      [&] {
        check_supported(on_gpu, DeviceSupport{false, "no driver here"});
      },
      {"fsdp_config.device: cuda needs a GPU", "no driver here"});
  EXPECT_NO_THROW(check_supported(on_gpu, DeviceSupport{true, ""}));
  // Every pair of offload keys on cpu, where they mean the same placement.
  for (const char* params : {"true", "false"}) {
    for (const char* state : {"true", "false"}) {
      EXPECT_NO_THROW(
          check_supported(load_config("", {std::string("--fsdp_config.offload_params=") + params,
                                           std::string("--fsdp_config.offload_optimizer_state=") + state})));
    }
  }
  // On cuda: parameters alone (the state on the GPU) runs, but not with FusedAdamW's CPU pass; the
  // state alone is not built.
  const std::vector<std::string> params_alone = {"--fsdp_config.device=cuda", "--fsdp_config.offload_params=true",
                                                 "--fsdp_config.offload_optimizer_state=false"};
  EXPECT_NO_THROW(check_supported(load_config("", params_alone), DeviceSupport{true, ""}));
  expect_error(
      [&] {
        check_supported(load_config("", with_args(params_alone, {"--optimizer.fused=true"})), DeviceSupport{true, ""});
      },
      {"optimizer.fused: true", "offload_optimizer_state: false", "DeviceStateAdamW"});
  expect_error(
      [] {
        check_supported(load_config("", {"--fsdp_config.device=cuda", "--fsdp_config.offload_optimizer_state=true"}),
                        DeviceSupport{true, ""});
      },
      {"fsdp_config.offload_optimizer_state: true with fsdp_config.offload_params: false is not supported yet"});
  // Checkpointing is reentrant only.
  EXPECT_NO_THROW(check_supported(load_config("", {"--fsdp_config.activation_checkpointing=true"})));
  expect_error(
      [] {
        check_supported(
            load_config("", {"--fsdp_config.activation_checkpointing=true", "--fsdp_config.use_reentrant=false"}));
      },
      {"fsdp_config.use_reentrant: false", "saved-tensor hooks"});
  expect_error([] { load_config("", {"--fsdp_config.activation_checkpointing_every=0"}); },
               {"fsdp_config.activation_checkpointing_every"});
  // use_reentrant alone is accepted: it only means something with activation checkpointing.
  EXPECT_NO_THROW(check_supported(load_config("", {"--fsdp_config.use_reentrant=true"})));
  expect_error([] { reshard_after_forward(load_config("", {"--fsdp_config.sharding_strategy=NO_SHARD"})); },
               {"NO_SHARD", "does not shard"});
  // NO_SHARD (replicate) has no policies.
  expect_error(
      [] {
        check_supported(
            load_config("", {"--fsdp_config.sharding_strategy=NO_SHARD", "--fsdp_config.mixed_precision=true"}));
      },
      {"fsdp_config.mixed_precision", "NO_SHARD is not supported yet"});
  expect_error(
      [] {
        check_supported(
            load_config("", {"--fsdp_config.sharding_strategy=NO_SHARD", "--fsdp_config.offload_params=true",
                             "--fsdp_config.offload_optimizer_state=true"}));
      },
      {"fsdp_config.offload_params: true with fsdp_config.sharding_strategy: NO_SHARD"});
  for (const char* s : {"NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"}) {
    SCOPED_TRACE(s);
    EXPECT_NO_THROW(check_supported(load_config("", {std::string("--fsdp_config.sharding_strategy=") + s})));
  }
}

TEST(TrainConfig, StrategiesAndReplicateDegree) {
  auto shape = [](std::vector<std::string> args, int world, int local_world) {
    return data_parallel_shape(load_config("", args), world, local_world);
  };
  auto expect_shape = [](DataParallelShape got, int replicate, int shard, bool hybrid) {
    EXPECT_EQ(got.replicate, replicate);
    EXPECT_EQ(got.shard, shard);
    EXPECT_EQ(got.hybrid, hybrid);
  };
  expect_shape(shape({}, 4, 4), 1, 4, false);
  expect_shape(shape({"--fsdp_config.sharding_strategy=SHARD_GRAD_OP"}, 4, 4), 1, 4, false);
  expect_shape(shape({"--fsdp_config.sharding_strategy=NO_SHARD"}, 4, 4), 4, 1, false);
  expect_shape(shape({"--fsdp_config.sharding_strategy=NO_SHARD", "--fsdp_config.replicate_degree=4"}, 4, 4), 4, 1,
               false);
  // HYBRID_SHARD: one replica per node by default (8 ranks, 4 per node), or as configured.
  expect_shape(shape({"--fsdp_config.sharding_strategy=HYBRID_SHARD"}, 8, 4), 2, 4, true);
  expect_shape(shape({"--fsdp_config.sharding_strategy=HYBRID_SHARD"}, 4, 4), 1, 4, true);
  expect_shape(shape({"--fsdp_config.sharding_strategy=HYBRID_SHARD", "--fsdp_config.replicate_degree=2"}, 4, 4), 2, 2,
               true);
  expect_shape(shape({"--fsdp_config.sharding_strategy=HYBRID_SHARD_ZERO2", "--fsdp_config.replicate_degree=4"}, 4, 4),
               4, 1, true);
  EXPECT_TRUE(reshard_after_forward(load_config("", {"--fsdp_config.sharding_strategy=HYBRID_SHARD"})));
  EXPECT_FALSE(reshard_after_forward(load_config("", {"--fsdp_config.sharding_strategy=HYBRID_SHARD_ZERO2"})));
  // Each wrong degree names the key, the strategy and the world.
  expect_error(
      [&] {
        shape({"--fsdp_config.sharding_strategy=HYBRID_SHARD", "--fsdp_config.replicate_degree=3"}, 4, 4);
      },
      {"fsdp_config.replicate_degree: 3 with sharding_strategy HYBRID_SHARD at a world of 4", "divide"});
  expect_error(
      [&] {
        shape({"--fsdp_config.sharding_strategy=HYBRID_SHARD", "--fsdp_config.replicate_degree=8"}, 4, 4);
      },
      {"fsdp_config.replicate_degree: 8", "divide"});
  expect_error([&] { shape({"--fsdp_config.replicate_degree=2"}, 4, 4); },
               {"fsdp_config.replicate_degree: 2 with sharding_strategy FULL_SHARD", "must be 1"});
  expect_error(
      [&] {
        shape({"--fsdp_config.sharding_strategy=NO_SHARD", "--fsdp_config.replicate_degree=2"}, 4, 4);
      },
      {"fsdp_config.replicate_degree: 2 with sharding_strategy NO_SHARD", "equal the world size"});
  expect_cli_error("--fsdp_config.replicate_degree=0", "fsdp_config.replicate_degree");
}

TEST(TrainConfig, ReshardAfterForwardTakesAGroupSizeThatDividesTheShardGroup) {
  const TrainConfig c = load_config("", {"--fsdp_config.reshard_after_forward=2"});
  ASSERT_TRUE(c.fsdp_config.reshard_after_forward.has_value());
  EXPECT_EQ(*c.fsdp_config.reshard_after_forward, 2);
  EXPECT_NO_THROW(check_supported(c));
  EXPECT_NO_THROW(check_reshard_group(c, data_parallel_shape(c, 4, 4)));
  expect_error([&] { check_reshard_group(c, data_parallel_shape(c, 3, 3)); },
               {"fsdp_config.reshard_after_forward: 2 does not divide the 3 rank(s)"});
  // HSDP: the group lies within a replica's shard group (2 ranks of a 2 x 2 mesh).
  const TrainConfig hybrid =
      load_config("", {"--fsdp_config.sharding_strategy=HYBRID_SHARD", "--fsdp_config.replicate_degree=2",
                       "--fsdp_config.reshard_after_forward=2"});
  EXPECT_NO_THROW(check_reshard_group(hybrid, data_parallel_shape(hybrid, 4, 4)));
  for (const char* s : {"SHARD_GRAD_OP", "HYBRID_SHARD_ZERO2", "NO_SHARD"}) {
    SCOPED_TRACE(s);
    expect_error(
        [&] {
          check_supported(load_config(
              "", {std::string("--fsdp_config.sharding_strategy=") + s, "--fsdp_config.reshard_after_forward=2"}));
        },
        {"fsdp_config.reshard_after_forward: 2 with fsdp_config.sharding_strategy: " + std::string(s),
         "unset the key"});
  }
  expect_cli_error("--fsdp_config.reshard_after_forward=0", "fsdp_config.reshard_after_forward");
  expect_cli_error("--fsdp_config.reshard_after_forward=true", "fsdp_config.reshard_after_forward");
}

// The options that move fewer bytes between hosts: their values, and the strategies they need.
TEST(TrainConfig, QuantizedCollectivesAndDiLoCoKeys) {
  const std::vector<std::string> hybrid = {"--fsdp_config.sharding_strategy=HYBRID_SHARD",
                                           "--fsdp_config.replicate_degree=2"};
  const TrainConfig c = load_config(
      "", with_args(hybrid, {"--fsdp_config.quantized_weights=int8", "--fsdp_config.quantized_gradients=bfloat16",
                             "--fsdp_config.quantization_block_size=64"}));
  EXPECT_EQ(c.fsdp_config.quantized_weights.value_or(""), "int8");
  EXPECT_EQ(c.fsdp_config.quantized_gradients.value_or(""), "bfloat16");
  EXPECT_EQ(c.fsdp_config.quantization_block_size, 64);
  EXPECT_NO_THROW(check_supported(c));
  EXPECT_FALSE(load_config("", {"--fsdp_config.quantized_weights=int8", "--fsdp_config.quantized_weights="})
                   .fsdp_config.quantized_weights.has_value());
  expect_error([] { check_supported(load_config("", {"--fsdp_config.quantized_gradients=int8"})); },
               {"fsdp_config.quantized_gradients: int8 with fsdp_config.sharding_strategy: FULL_SHARD",
                "fsdp_config.reduce_dtype: bfloat16"});
  const TrainConfig diloco =
      load_config("", with_args(hybrid, {"--fsdp_config.diloco_inner_steps=50", "--training.export=none",
                                         "--fsdp_config.diloco_quantized=int8", "--fsdp_config.diloco_fragments=2"}));
  EXPECT_EQ(diloco.fsdp_config.diloco_inner_steps, 50);
  EXPECT_DOUBLE_EQ(diloco.fsdp_config.diloco_outer_lr, 0.7);
  EXPECT_DOUBLE_EQ(diloco.fsdp_config.diloco_outer_momentum, 0.9);
  EXPECT_NO_THROW(check_supported(diloco));
  expect_error(
      [] {
        check_supported(load_config("", {"--fsdp_config.diloco_inner_steps=50", "--training.export=none"}));
      },
      {"fsdp_config.diloco_inner_steps: 50 needs sharding_strategy: HYBRID_SHARD"});
  expect_error([&] { check_supported(load_config("", with_args(hybrid, {"--fsdp_config.diloco_inner_steps=5"}))); },
               {"the outer state", "training.export: none"});
  EXPECT_NO_THROW(
      check_supported(load_config("", with_args(hybrid, {"--fsdp_config.quantized_gradients=int8",
                                                         "--fsdp_config.quantized_gradients_skip_zero_blocks=true"}))));
  expect_error(
      [&] {
        check_supported(
            load_config("", with_args(hybrid, {"--fsdp_config.quantized_gradients=bfloat16",
                                               "--fsdp_config.quantized_gradients_skip_zero_blocks=true"})));
      },
      {"fsdp_config.quantized_gradients_skip_zero_blocks: true needs", "but it is bfloat16"});
  expect_error(
      [&] {
        check_supported(
            load_config("", with_args(hybrid, {"--fsdp_config.quantized_gradients_skip_zero_blocks=true"})));
      },
      {"quantized_gradients_skip_zero_blocks", "but it is unset"});
  expect_cli_error("--fsdp_config.quantized_weights=int4", "fsdp_config.quantized_weights");
  expect_cli_error("--fsdp_config.quantization_block_size=8", "fsdp_config.quantization_block_size");
  expect_cli_error("--fsdp_config.diloco_outer_momentum=1", "fsdp_config.diloco_outer_momentum");
}

TEST(TrainConfig, FreezeIsAListOfNames) {
  const TrainConfig c = load_config("", {"--model.freeze=[tok_embeddings, layers.0.attention.wq.weight]"});
  EXPECT_EQ(c.model.freeze, (std::vector<std::string>{"tok_embeddings", "layers.0.attention.wq.weight"}));
  EXPECT_TRUE(load_config("", {}).model.freeze.empty());
  expect_cli_error("--model.freeze=tok_embeddings", "model.freeze");  // a list, not one name
  expect_cli_error("--model.freeze=['']", "model.freeze");
}

TEST(TrainConfig, CheckAgainstLauncher) {
  TrainConfig c;  // -1 / -1: take the launcher's
  EXPECT_NO_THROW(check_against_launcher(c, 4, 3));
  c.fsdp_config.world_size = 0;
  c.fsdp_config.local_rank = 0;
  EXPECT_NO_THROW(check_against_launcher(c, 4, 3));
  c.fsdp_config.world_size = 2;
  EXPECT_NO_THROW(check_against_launcher(c, 2, 1));
  expect_error([&] { check_against_launcher(c, 4, 1); }, {"world_size", "2", "4"});
  c.fsdp_config.local_rank = 1;
  EXPECT_NO_THROW(check_against_launcher(c, 2, 1));
  expect_error([&] { check_against_launcher(c, 2, 0); }, {"local_rank", "1", "LOCAL_RANK 0"});
  // From a file and the command line alike.
  TrainConfig f = load_config(kConfigs + "/tiny.yaml", {"--fsdp_config.world_size=2"});
  expect_error([&] { check_against_launcher(f, 1, 0); }, {"fsdp_config.world_size is 2", "1"});
}

TEST(TrainConfig, KeyGivenTwiceNamesTheKeyTheFileAndBothLines) {
  const std::string path = write_yaml("training:\n  steps: 5\n  seed: 1\n  steps: 7\n");
  expect_error([&] { load_config(path, {}); }, {path + ":4", "training.steps", "twice", "lines 2 and 4"});
}

TEST(TrainConfig, SectionGivenTwiceNamesTheSectionTheFileAndBothLines) {
  const std::string path = write_yaml("training:\n  steps: 5\noptimizer:\n  lr: 0.1\ntraining:\n  seed: 3\n");
  expect_error([&] { load_config(path, {}); }, {path + ":5", "section 'training'", "lines 1 and 5"});
  // The same key in two sections is two keys; on the command line the last override still wins.
  const std::string ok = write_yaml("training:\n  seed: 1\nsample:\n  seed: 2\n");
  EXPECT_EQ(load_config(ok, {"--training.seed=4", "--training.seed=5"}).training.seed, 5);
}

// yaml-cpp reads a quoted scalar over several lines, so a missing closing quote swallowed the
// keys after it (here temperature and the logging section) without any error.
TEST(TrainConfig, UnterminatedQuoteIsReportedAtTheLineThatOpensIt) {
  const std::string swallowing =
      write_yaml("sample:\n  prompt: \"The GNU\n  temperature: 0.7\nlogging:\n  log_interval: 3\n");
  expect_error([&] { load_config(swallowing, {}); }, {swallowing + ":2:", "quoted value", "not closed"});
  const std::string single = write_yaml("training:\n  steps: 3\nsample:\n  prompt: 'it''s\n  length: 4\n");
  expect_error([&] { load_config(single, {}); }, {single + ":4:", "not closed"});
  const std::string in_list = write_yaml("optimizer:\n  betas: [0.9, \"0.95]\n");
  expect_error([&] { load_config(in_list, {}); }, {in_list + ":2:", "not closed"});
}

TEST(TrainConfig, QuotesThatAreNotUnterminatedStillLoad) {
  const std::string path = write_yaml(
      "# a comment with a \" quote\n"
      "sample:\n"
      "  prompt: \"say \\\"hi\\\" # not a comment\"  # it's a comment\n"
      "  temperature: 0.5\n"
      "logging:\n"
      "  jsonl: don't\"quote\n"
      "  trace_dir: 'it''s here'\n"
      "  summary_json: |\n"
      "    a block \" with 'quotes\n"
      "  progress: \"off\"\n");
  const TrainConfig c = load_config(path, {});
  EXPECT_EQ(c.sample.prompt, "say \"hi\" # not a comment");
  EXPECT_DOUBLE_EQ(c.sample.temperature, 0.5);
  EXPECT_EQ(c.logging.jsonl, "don't\"quote");
  EXPECT_EQ(c.logging.trace_dir, "it's here");
  EXPECT_EQ(c.logging.summary_json, "a block \" with 'quotes\n");
  EXPECT_EQ(c.logging.progress, "off");
}

TEST(TrainConfig, DirectoryAsConfigFileNamesIt) {
  expect_error([] { load_config(kScratch, {}); }, {kScratch, "is a directory"});
}

TEST(TrainConfig, ComplexKeysAndDeepNestingAreConfigErrors) {
  const std::string complex = write_yaml("? [training, steps]\n: 3\n");
  expect_error([&] { load_config(complex, {}); }, {complex + ":1", "expected a section name, got a list"});
  const std::string complex_key = write_yaml("training:\n  {steps: 1}: 3\n");
  expect_error([&] { load_config(complex_key, {}); }, {complex_key + ":2", "expected a key name, got a mapping"});
  const std::string deep = write_yaml("training:\n  steps: " + std::string(5000, '[') + "\n");
  expect_error([&] { load_config(deep, {}); }, {deep, "nested deeper than"});
}

TEST(TrainConfig, CollectiveTimeout) {
  EXPECT_FALSE(load_config("", {}).fsdp_config.collective_timeout_s.has_value());  // the library's
  EXPECT_DOUBLE_EQ(*load_config("", {"--fsdp_config.collective_timeout_s=90"}).fsdp_config.collective_timeout_s, 90);
  EXPECT_DOUBLE_EQ(*load_config("", {"--fsdp_config.collective_timeout_s=0.5"}).fsdp_config.collective_timeout_s, 0.5);
  EXPECT_FALSE(load_config("", {"--fsdp_config.collective_timeout_s=9", "--fsdp_config.collective_timeout_s="})
                   .fsdp_config.collective_timeout_s.has_value());
  for (const char* bad : {"0", "-5", "0.0001", "1e9", ".nan", ".inf", "soon", "[1]"})
    expect_cli_error(std::string("--fsdp_config.collective_timeout_s=") + bad, "fsdp_config.collective_timeout_s");
  expect_file_error("fsdp_config", "collective_timeout_s: -1", "fsdp_config.collective_timeout_s");
  for (const char* name : {"tiny", "small", "medium", "gpl3", "seed002"}) {
    SCOPED_TRACE(name);  // the shipped configs set it (and document it)
    EXPECT_TRUE(load_config(kConfigs + "/" + name + ".yaml", {}).fsdp_config.collective_timeout_s.has_value());
  }
}

TEST(TrainConfig, Backend) {
  EXPECT_EQ(load_config("", {}).fsdp_config.backend, "auto");  // mpi under mpirun/srun, else gloo
  for (const char* name : {"auto", "gloo", "mpi"}) {
    EXPECT_EQ(load_config("", {std::string("--fsdp_config.backend=") + name}).fsdp_config.backend, name);
  }
  expect_cli_error("--fsdp_config.backend=nccl", "fsdp_config.backend");
  expect_file_error("fsdp_config", "backend: tcp", "fsdp_config.backend");
}

// ------------------------------------------------------------------ mixed precision

TEST(TrainConfig, MixedPrecisionIsBf16ParamsWithFp32ReductionsAndTheDtypeKeysOverrideIt) {
  auto precision = [](const std::vector<std::string>& overrides) {
    const TrainConfig c = load_config(kConfigs + "/tiny.yaml", overrides);  // mixed_precision: false
    EXPECT_NO_THROW(check_supported(c));
    return precision_of(c.fsdp_config).describe();
  };
  EXPECT_EQ(precision({}), "fp32");
  EXPECT_FALSE(precision_of(load_config("", {}).fsdp_config).is_mixed());
  EXPECT_EQ(precision({"--fsdp_config.mixed_precision=true"}), "param bf16, reduce fp32");
  // The dtypes are the policy: one set alone turns mixed precision on, whatever the switch says...
  EXPECT_EQ(precision({"--fsdp_config.param_dtype=bfloat16"}), "param bf16, reduce fp32");
  EXPECT_EQ(precision({"--fsdp_config.reduce_dtype=bfloat16"}), "param fp32, reduce bf16");
  EXPECT_EQ(precision({"--fsdp_config.reduce_dtype=float16"}), "param fp32, reduce fp16");
  // ...and overrides what mixed_precision: true would give, down to no policy at all.
  EXPECT_EQ(precision({"--fsdp_config.mixed_precision=true", "--fsdp_config.reduce_dtype=bfloat16"}),
            "param bf16, reduce bf16");
  EXPECT_EQ(precision({"--fsdp_config.mixed_precision=true", "--fsdp_config.param_dtype=float32"}), "fp32");
  // An empty value unsets a dtype key: mixed_precision decides again.
  EXPECT_EQ(precision({"--fsdp_config.param_dtype=float32",
                       "--fsdp_config.param_dtype=", "--fsdp_config.mixed_precision=true"}),
            "param bf16, reduce fp32");
  const std::string path = write_yaml("fsdp_config:\n  param_dtype: bfloat16\n  reduce_dtype: float32\n");
  const FsdpConfig f = load_config(path, {}).fsdp_config;
  EXPECT_EQ(f.param_dtype, Dtype::kBFloat16);
  EXPECT_EQ(f.reduce_dtype, Dtype::kFloat32);
  EXPECT_FALSE(f.mixed_precision);
}

TEST(TrainConfig, DtypeKeysRejectOtherValuesNamingTheKeyAndTheChoices) {
  for (const char* key : {"param_dtype", "reduce_dtype"}) {
    const std::string name = std::string("fsdp_config.") + key;
    for (const char* bad : {"bf16", "fp32", "float64", "BFloat16", "true"}) {
      SCOPED_TRACE(name + "=" + bad);
      expect_error([&] { load_config("", {"--" + name + "=" + bad}); },
                   {name, "command line", "expected one of float32 | bfloat16 | float16, got '" + std::string(bad)});
    }
    expect_cli_error("--" + name + "=[bfloat16]", name + ": expected a string, got a list");
    expect_file_error("fsdp_config", std::string(key) + ": half", name);
  }
}

TEST(TrainConfig, Fp16ParametersRunAnywhereAndFp16WithAScalerOnCudaOnly) {
  // LibTorch 2.x has fp16 matmuls on CPU: fp16 parameters alone run.
  EXPECT_NO_THROW(check_supported(load_config(kConfigs + "/tiny.yaml", {"--fsdp_config.param_dtype=float16"})));
  // Reductions are additions: fp16 is fine there.
  EXPECT_NO_THROW(check_supported(load_config(kConfigs + "/tiny.yaml", {"--fsdp_config.reduce_dtype=float16"})));
  EXPECT_NO_THROW(check_supported(load_config(kConfigs + "/tiny.yaml", {"--fsdp_config.mixed_precision=true"})));
  // fp16: true is the GPU recipe: refused on cpu with its reason and the alternatives...
  expect_error([] { check_supported(load_config(kConfigs + "/tiny.yaml", {"--fsdp_config.fp16=true"})); },
               {"fsdp_config.fp16: true (fp16 compute with a gradient scaler) is not supported on device: cpu", "bf16",
                "fsdp_config.mixed_precision: true", "param_dtype: float16", "device: cuda"});
  // ...and accepted on cuda where there is a GPU, where it is fp16 compute, fp32 reductions and
  // loss scaling, over mixed_precision's bf16; an explicit dtype key still wins.
  const DeviceSupport gpu{true, ""};
  const TrainConfig on_gpu = load_config("", {"--fsdp_config.fp16=true", "--fsdp_config.device=cuda"});
  EXPECT_NO_THROW(check_supported(on_gpu, gpu));
  EXPECT_EQ(precision_of(on_gpu.fsdp_config).describe(), "param fp16, reduce fp32 with loss scaling");
  EXPECT_TRUE(precision_of(on_gpu.fsdp_config).loss_scaling);
  EXPECT_EQ(precision_of(load_config("", {"--fsdp_config.fp16=true", "--fsdp_config.mixed_precision=true"}).fsdp_config)
                .describe(),
            "param fp16, reduce fp32 with loss scaling");
  EXPECT_EQ(precision_of(load_config("", {"--fsdp_config.fp16=true", "--fsdp_config.reduce_dtype=float16"}).fsdp_config)
                .describe(),
            "param fp16, reduce fp16 with loss scaling");
  // Without a GPU the device is what stops it.
  expect_error(
      [] {
        check_supported(load_config("", {"--fsdp_config.fp16=true", "--fsdp_config.device=cuda"}));
      },
      {"fsdp_config.device: cuda needs a GPU"});
}

TEST(TrainConfig, CheckpointFormatIsFsdpOrDcpAndOtherValuesNameTheKeyAndTheLine) {
  EXPECT_EQ(load_config("", {}).fsdp_config.checkpoint_format, "fsdp");
  EXPECT_EQ(load_config(kConfigs + "/tiny.yaml", {}).fsdp_config.checkpoint_format, "fsdp");
  EXPECT_EQ(load_config("", {"--fsdp_config.checkpoint_format=dcp"}).fsdp_config.checkpoint_format, "dcp");
  for (const char* bad : {"DCP", "torch", "safetensors", ""}) {
    SCOPED_TRACE(bad);
    expect_error([&] { load_config("", {std::string("--fsdp_config.checkpoint_format=") + bad}); },
                 {"fsdp_config.checkpoint_format", "command line", "expected one of fsdp | dcp"});
  }
  const std::string path = write_yaml("fsdp_config:\n  checkpoint_dir: /tmp/x\n  checkpoint_format: distcp\n");
  expect_error([&] { load_config(path, {}); },
               {path + ":3", "fsdp_config.checkpoint_format", "expected one of fsdp | dcp, got 'distcp'"});
}

// The eval section and data.tokenizer: defaults, values, and the rule across keys.
TEST(TrainConfig, EvalSectionAndTokenizerKeys) {
  const TrainConfig d = load_config("", {});
  EXPECT_TRUE(d.eval.path.empty());
  EXPECT_EQ(d.eval.batches, 1);
  EXPECT_EQ(d.eval.interval, 0);
  EXPECT_TRUE(d.data.tokenizer.empty());
  const TrainConfig c = load_config("", {"--eval.path=e.tokens", "--eval.batches=3", "--eval.interval=50"});
  EXPECT_EQ(c.eval.path, "e.tokens");
  EXPECT_EQ(c.eval.batches, 3);
  EXPECT_EQ(c.eval.interval, 50);
  if (built_with_sentencepiece()) {
    EXPECT_EQ(load_config("", {"--data.tokenizer=m.model"}).data.tokenizer, "m.model");
  } else {  // refused by name, with the build option, before anything is read
    expect_error([] { load_config("", {"--data.tokenizer=m.model"}); },
                 {"data.tokenizer", "m.model", "FSDP_WITH_SENTENCEPIECE", "leave data.tokenizer unset"});
  }
  expect_error([] { load_config("", {"--eval.batches=0"}); }, {"eval.batches", "must be >= 1"});
  expect_error([] { load_config("", {"--eval.interval=-1"}); }, {"eval.interval", "must be >= 0"});
  expect_error([] { load_config("", {"--eval.interval=10"}); }, {"eval.path: required when eval.interval"});
}
