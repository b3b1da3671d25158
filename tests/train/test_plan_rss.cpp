// `fsdp-train plan`'s peak RSS against the trainer's at a size where a rank's memory is mostly the
// model: a 0.2 B-parameter Llama (hidden 1024, 12 layers, 16/4 heads, SwiGLU 2816, vocabulary
// 32000, untied) at W = 2 in fp32, micro-batch 1 x 128. Two training steps (the second holds
// AdamW's state beside the gradients: the peak), exported as a Hugging Face directory in bf16
// (one file per rank), then `fsdp-train eval` of that directory: each run's peak RSS is within
// 10 % of the plan's (`fsdp-train plan --eval` for the eval).
//
// What the plans count is tensors, the runtime and the block cache; what they cannot see
// (weights read from a file beside the model, blocks cached for sizes no request of the moment
// can use, glibc's heap holding freed blocks, a file assembled in memory before it is written)
// is what these runs would show above them: the final checkpoint (written before the export, so
// that nothing trained is lost), assembled whole in memory, would take the training run from
// 2.1 GiB to 3.7 GiB per rank. About 2 x 2.1 GiB of memory and a minute of two cores: the
// label "memory" keeps it out of the CUDA configuration's run, where it would test the same
// object code again.
#include "process_harness.h"
#include "trainer_runs.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <fstream>
#include <iostream>
#include <regex>
#include <string>
#include <vector>

using namespace process_test;
using namespace trainer_test;

namespace {

const char* kConfigJson = R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
  "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 12, "num_attention_heads": 16,
  "num_key_value_heads": 4, "max_position_embeddings": 2048, "rms_norm_eps": 1e-06,
  "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "hidden_act": "silu",
  "tie_word_embeddings": false})";

// An own-format token file of `n` ids below 32000 (2-byte ids).
void write_tokens(const std::string& path, uint64_t n) {
  std::string out = std::string("FSDPTOK") + '\0';
  auto put = [&](uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  };
  put(1, 4), put(2, 4), put(32000, 8), put(n, 8);
  for (uint64_t i = 0; i < n; ++i) put((i * 7919) % 32000, 2);
  std::ofstream(path, std::ios::binary) << out;
}

double planned_rss_mib(const std::vector<std::string>& config_args, bool eval) {
  std::vector<std::string> args = {"plan"};
  args.insert(args.end(), config_args.begin(), config_args.end());
  args.insert(args.end(), {"--world", "2", "--json"});
  if (eval) args.push_back("--eval");
  const RunResult r = trainer.run(args, {}, 600);
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  if (r.exit_code != 0) return 0;
  return nlohmann::json::parse(r.out)["ranks"][0]["peak_rss_bytes"].get<double>() / (1 << 20);
}

void expect_within_ten_percent(double planned, const std::vector<double>& measured, const std::string& what) {
  ASSERT_EQ(measured.size(), 2u) << what;
  for (double m : measured) {
    ASSERT_GT(m, 0) << what;
    std::cout << what << ": planned peak RSS " << planned << " MiB, measured " << m << " MiB\n";
    EXPECT_NEAR(planned / m, 1.0, 0.10) << what << ": planned peak RSS " << planned << " MiB, measured " << m << " MiB";
  }
}

}  // namespace

TEST(PlanRss, TrainingAndEvaluationOfATwoHundredMillionParameterLlamaStayWithinTenPercentOfThePlan) {
  TempDir dir;
  write_text(dir / "config.json", kConfigJson);
  write_tokens(dir / "eval.tokens", 4096);
  const std::vector<std::string> common = {"--training.seq_len=128",
                                           "--training.micro_batch_size=1",
                                           "--fsdp_config.checkpoint_interval=0",
                                           "--fsdp_config.checkpoint_dir=" + dir / "ckpt",
                                           "--training.resume=never",
                                           "--logging.progress=off",
                                           "--sample.length=0",
                                           "--eval.path=" + dir / "eval.tokens"};
  std::vector<std::string> train = {configs_dir() + "/llama.yaml",
                                    "--model.hf_config=" + dir / "config.json",
                                    "--data.source=synthetic",
                                    "--training.steps=2",
                                    "--training.export=hf:" + dir / "hf",
                                    "--training.export_dtype=bfloat16",
                                    "--logging.jsonl=",
                                    "--logging.summary_json=" + dir / "summary.json"};
  train.insert(train.end(), common.begin(), common.end());

  const double planned_train = planned_rss_mib(train, false);
  const RunResult trained = fsdprun.run(under_fsdprun(2, train), {}, 3000);
  ASSERT_EQ(trained.exit_code, 0) << describe(trained);
  const auto summary = nlohmann::json::parse(read_file(dir / "summary.json"));
  expect_within_ten_percent(planned_train, summary.at("peak_rss_mib_per_rank").get<std::vector<double>>(),
                            "2 training steps");

  // The export read back a tensor at a time, converted from bf16 into the fp32 shards.
  std::vector<std::string> eval = {configs_dir() + "/llama.yaml",
                                   "--model.hf_config=", "--model.init_from=" + dir / "hf", "--data.source=synthetic"};
  eval.insert(eval.end(), common.begin(), common.end());
  const double planned_eval = planned_rss_mib(eval, true);
  std::vector<std::string> eval_command = {"eval"};
  eval_command.insert(eval_command.end(), eval.begin(), eval.end());
  const RunResult evaluated = fsdprun.run(under_fsdprun(2, eval_command), {}, 1500);
  ASSERT_EQ(evaluated.exit_code, 0) << describe(evaluated);
  std::smatch m;
  const std::regex line(R"(eval: peak RSS per rank ([0-9.]+) MiB, ([0-9.]+) MiB)");
  ASSERT_TRUE(std::regex_search(evaluated.out, m, line)) << describe(evaluated);
  expect_within_ten_percent(planned_eval, {std::stod(m[1]), std::stod(m[2])}, "fsdp-train eval of the export");
}
