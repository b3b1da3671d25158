// The Llama family's decoder (fsdp/models/llama.h) where transformers cannot see it: the tied
// head is one tensor under two names, FSDP keeps it in the root's group and refuses to split it
// across two groups, the rotary table is in no state dict, and config.json's refusals name the
// file and the key (fsdp/models/llama_hf.h). The numbers themselves are checked against
// transformers in tests/interop/test_llama.py.
#include "error_of.h"
#include "harness/multiprocess.h"

#include <fsdp/call.h>
#include <fsdp/distributed.h>
#include <fsdp/fully_shard.h>
#include <fsdp/models/llama.h>
#include <fsdp/models/llama_hf.h>
#include <fsdp/state_dict.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <fstream>
#include <string>
#include <vector>

namespace {

using fsdp::models::Llama;
using fsdp::models::LlamaArgs;

LlamaArgs tied_args() {
  LlamaArgs a;
  a.num_hidden_layers = 1;
  a.tie_word_embeddings = true;
  return a;
}

using fsdp_test::error_of;

TEST(Llama, ParameterNamesAreTransformersAndTheTiedHeadIsTheEmbedding) {
  torch::manual_seed(0);
  LlamaArgs a = tied_args();
  a.attention_bias = true;
  Llama model(a);
  std::vector<std::string> names;
  for (const auto& item : model->named_parameters()) names.push_back(item.key());
  const std::vector<std::string> expected = {"model.embed_tokens.weight",
                                             "model.layers.0.self_attn.q_proj.weight",
                                             "model.layers.0.self_attn.q_proj.bias",
                                             "model.layers.0.self_attn.k_proj.weight",
                                             "model.layers.0.self_attn.k_proj.bias",
                                             "model.layers.0.self_attn.v_proj.weight",
                                             "model.layers.0.self_attn.v_proj.bias",
                                             "model.layers.0.self_attn.o_proj.weight",
                                             "model.layers.0.mlp.gate_proj.weight",
                                             "model.layers.0.mlp.up_proj.weight",
                                             "model.layers.0.mlp.down_proj.weight",
                                             "model.layers.0.input_layernorm.weight",
                                             "model.layers.0.post_attention_layernorm.weight",
                                             "model.norm.weight",
                                             "lm_head.weight"};
  EXPECT_EQ(names, expected);
  EXPECT_TRUE(model->lm_head->weight.is_same(model->model->embed_tokens->weight));
  EXPECT_EQ(model->unique_parameters().size(), expected.size() - 1);
  EXPECT_TRUE(model->named_buffers().is_empty()) << "the rotary table is not a registered buffer";
  EXPECT_EQ(model->model->layers[0]->named_parameters()["self_attn.k_proj.weight"].sizes(),
            (std::vector<int64_t>{a.num_key_value_heads * a.head_dim, a.hidden_size}));
}

TEST(Llama, ChunkedLossEqualsTheWholeLogitsLoss) {
  torch::manual_seed(0);
  Llama model(tied_args());
  const at::Tensor tokens = at::randint(0, 64, {2, 12}, at::kLong), targets = at::randint(0, 64, {2, 12}, at::kLong);
  const double whole = model->forward_loss(tokens, targets, 1).item<double>();
  EXPECT_NEAR(model->forward_loss(tokens, targets, 5).item<double>(), whole, 1e-5 * std::abs(whole));
  EXPECT_NE(error_of([&] { model->forward_loss(tokens, targets, 13); }).find("chunks=13"), std::string::npos);
}

// Activation checkpointing per decoder layer (CausalLM, written once for every family): the same
// loss and the same gradients, each layer's forward run again in backward.
TEST(Llama, CheckpointingEachDecoderLayerGivesTheSameLossAndGradients) {
  const at::Tensor tokens = at::randint(0, 64, {2, 12}, at::kLong), targets = at::randint(0, 64, {2, 12}, at::kLong);
  auto run = [&](int64_t every) {
    torch::manual_seed(0);
    Llama model(tied_args());
    model->set_activation_checkpointing(every);
    EXPECT_EQ(model->is_layer_checkpointed(0), every == 1);
    at::Tensor loss = model->forward_loss(tokens, targets, 1);
    loss.backward();
    std::vector<at::Tensor> grads;
    for (const auto& p : model->unique_parameters()) grads.push_back(p.grad().clone());
    return std::make_pair(loss.item<double>(), grads);
  };
  const auto [plain, plain_grads] = run(0);
  const auto [checkpointed, grads] = run(1);
  EXPECT_EQ(checkpointed, plain);
  ASSERT_EQ(grads.size(), plain_grads.size());
  for (size_t i = 0; i < grads.size(); ++i) EXPECT_TRUE(grads[i].allclose(plain_grads[i], 1e-6, 1e-7)) << i;
  EXPECT_NE(error_of([] { Llama(tied_args())->set_activation_checkpointing(-1); }).find("every_k=-1"),
            std::string::npos);
}

TEST(Llama, RootHoldsTheTiedWeightAndTrainsItOnceAtTwoRanks) {
  fsdp::testing::run_distributed(2, [] {
    torch::manual_seed(0);
    Llama model(tied_args(), [](fsdp::models::LlamaDecoderLayer& layer) { fsdp::fully_shard(layer); });
    fsdp::fully_shard(model);
    EXPECT_TRUE(
        model->lm_head->named_parameters()["weight"].is_same(model->model->embed_tokens->named_parameters()["weight"]));
    const at::Tensor tokens = at::randint(0, 64, {2, 8}, at::kLong);
    at::Tensor loss = fsdp::call_method(model, &fsdp::models::LlamaImpl::forward_loss, tokens, tokens, int64_t{1});
    loss.backward();
    const at::Tensor grad = model->model->embed_tokens->named_parameters()["weight"].grad();
    ASSERT_TRUE(grad.defined());
    EXPECT_GT(grad.abs().sum().item<double>(), 0.0);
    for (const auto& item : fsdp::sharded_state_dict(*model))
      EXPECT_EQ(item.key().find("inv_freq"), std::string::npos) << item.key();
  });
}

TEST(Llama, FullyShardRefusesToSplitTheTiedWeightAcrossTwoGroupsAtTwoRanks) {
  fsdp::testing::run_distributed(2, [] {
    torch::manual_seed(0);
    Llama model(tied_args());
    fsdp::fully_shard(model->lm_head.ptr());
    const std::string message = error_of([&] { fsdp::fully_shard(model); });
    EXPECT_NE(message.find("'model.embed_tokens.weight' is shared"), std::string::npos) << message;
  });
}

std::string write_config(const std::string& text) {
  const std::string path = ::testing::TempDir() + "/llama_config_" + std::to_string(::getpid()) + ".json";
  std::ofstream(path) << text;
  return path;
}

TEST(LlamaHf, ReadsTheHubsRopeScalingAndRefusesWhatItDoesNotComputeNamingFileAndKey) {
  const std::string base =
      R"("vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64)";
  const std::string llama = write_config(R"({"architectures": ["LlamaForCausalLM"], )" + base +
                                         R"(, "rope_theta": 500000.0, "rope_scaling": {"type": "llama3",
         "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192}})");
  const LlamaArgs a = fsdp::models::llama_args_from_hf_config(llama, 16);
  EXPECT_EQ(a.rope.type, "llama3");
  EXPECT_EQ(a.rope.theta, 500000.0);
  EXPECT_EQ(a.head_dim, 4);
  EXPECT_FALSE(a.tie_word_embeddings);

  auto refusal = [&](const std::string& json, int64_t seq) {
    const std::string path = write_config(json);
    return std::make_pair(path, error_of([&] { fsdp::models::llama_args_from_hf_config(path, seq); }));
  };
  auto [gpt2, gpt2_error] = refusal(R"({"architectures": ["GPT2LMHeadModel"], )" + base + "}", 16);
  EXPECT_NE(gpt2_error.find(gpt2 + ": key 'architectures'"), std::string::npos) << gpt2_error;
  auto [missing, missing_error] =
      refusal(R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16,
                  "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 64})",
              16);
  EXPECT_NE(missing_error.find("key 'intermediate_size' is missing"), std::string::npos) << missing_error;
  auto [window, window_error] =
      refusal(R"({"architectures": ["MistralForCausalLM"], "sliding_window": 8, )" + base + "}", 16);
  EXPECT_NE(window_error.find("key 'sliding_window'"), std::string::npos) << window_error;
  EXPECT_TRUE(
      refusal(R"({"architectures": ["MistralForCausalLM"], "sliding_window": 16, )" + base + "}", 16).second.empty());
  auto [yarn, yarn_error] =
      refusal(R"({"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "yarn"}, )" + base + "}", 16);
  EXPECT_NE(yarn_error.find("rope_scaling.rope_type"), std::string::npos) << yarn_error;
}

// transformers 5.25 reads rope_scaling whenever it is set, even beside rope_parameters; the
// rope_theta of the object it reads wins over the top-level one. Disagreeing objects are said.
TEST(LlamaHf, RopeScalingWinsOverRopeParametersAsInTransformersAndADisagreementIsSaid) {
  const std::string base =
      R"("architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
         "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 64)";
  const std::string llama3 =
      R"({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0})";
  auto read = [&](const std::string& keys, std::vector<std::string>* notes) {
    return fsdp::models::llama_args_from_hf_config(write_config("{" + base + ", " + keys + "}"), 16, notes).rope;
  };
  std::vector<std::string> notes;
  // Both set, disagreeing: rope_scaling's llama3, the top-level rope_theta (rope_scaling has none),
  // original_max_position_embeddings filled from max_position_embeddings; one note names both.
  auto rope = read(R"("rope_theta": 77.0, "rope_parameters": {"rope_type": "default", "rope_theta": 1234.0},
                      "rope_scaling": )" +
                       llama3,
                   &notes);
  EXPECT_EQ(rope.type, "llama3");
  EXPECT_EQ(rope.theta, 77.0);
  EXPECT_EQ(rope.original_max_position_embeddings, 64);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_NE(notes[0].find("rope_scaling is used"), std::string::npos) << notes[0];
  EXPECT_NE(notes[0].find("\"rope_theta\":1234.0"), std::string::npos) << notes[0];
  // Both set and agreeing (rope_scaling's older "type" key): no note.
  notes.clear();
  rope = read(R"("rope_parameters": {"rope_type": "default", "rope_theta": 99.0},
                 "rope_scaling": {"type": "default", "rope_theta": 99.0})",
              &notes);
  EXPECT_EQ(rope.type, "default");
  EXPECT_EQ(rope.theta, 99.0);
  EXPECT_TRUE(notes.empty());
  // An empty rope_scaling counts as unset (Python's truth value): rope_parameters is read.
  rope = read(R"("rope_scaling": {}, "rope_parameters": )" + llama3, &notes);
  EXPECT_EQ(rope.type, "llama3");
  EXPECT_EQ(rope.theta, 10000.0);
  EXPECT_TRUE(notes.empty());
  // A yarn rope_scaling beside a default rope_parameters is the yarn model: refused, not trained as default.
  const std::string yarn = error_of([&] {
    read(R"("rope_parameters": {"rope_type": "default"}, "rope_scaling": {"rope_type": "yarn", "factor": 4.0})",
         nullptr);
  });
  EXPECT_NE(yarn.find("key 'rope_scaling.rope_type' is \"yarn\""), std::string::npos) << yarn;
}

}  // namespace
