// GPT-2 (fsdp/models/gpt2.h) where transformers cannot see it: the parameters are transformers'
// names and shapes (Conv1D weights [in, out]), the tied head is wte's tensor, which the root holds
// under FSDP, activation checkpointing per block changes nothing, config.json's refusals name
// the file and the key (fsdp/models/gpt2_hf.h), and the planner's spec holds the model's
// parameters. The numbers themselves are checked against transformers in
// tests/interop/test_gpt2.py.
#include "error_of.h"
#include "harness/multiprocess.h"

#include <fsdp/call.h>
#include <fsdp/distributed.h>
#include <fsdp/fully_shard.h>
#include <fsdp/models/gpt2.h>
#include <fsdp/models/gpt2_hf.h>
#include <fsdp/plan.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using fsdp::models::Gpt2;
using fsdp::models::Gpt2Args;
using fsdp_test::error_of;

Gpt2Args small_args() {
  Gpt2Args a;
  a.n_layer = 1;
  a.n_inner = 48;
  return a;
}

TEST(Gpt2, ParameterNamesAndShapesAreTransformersAndTheTiedHeadIsWte) {
  torch::manual_seed(0);
  const Gpt2Args a = small_args();
  Gpt2 model(a);
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& item : model->named_parameters()) {
    names.push_back(item.key());
    shapes.push_back(item.value().sizes().vec());
  }
  const int64_t D = a.n_embd, I = a.n_inner;
  const std::vector<std::string> expected = {"transformer.wte.weight",
                                             "transformer.wpe.weight",
                                             "transformer.h.0.ln_1.weight",
                                             "transformer.h.0.ln_1.bias",
                                             "transformer.h.0.attn.c_attn.weight",
                                             "transformer.h.0.attn.c_attn.bias",
                                             "transformer.h.0.attn.c_proj.weight",
                                             "transformer.h.0.attn.c_proj.bias",
                                             "transformer.h.0.ln_2.weight",
                                             "transformer.h.0.ln_2.bias",
                                             "transformer.h.0.mlp.c_fc.weight",
                                             "transformer.h.0.mlp.c_fc.bias",
                                             "transformer.h.0.mlp.c_proj.weight",
                                             "transformer.h.0.mlp.c_proj.bias",
                                             "transformer.ln_f.weight",
                                             "transformer.ln_f.bias",
                                             "lm_head.weight"};
  EXPECT_EQ(names, expected);
  const std::vector<std::vector<int64_t>> expected_shapes = {{a.vocab_size, D},
                                                             {a.n_positions, D},
                                                             {D},
                                                             {D},
                                                             {D, 3 * D},
                                                             {3 * D},
                                                             {D, D},
                                                             {D},
                                                             {D},
                                                             {D},
                                                             {D, I},
                                                             {I},
                                                             {I, D},
                                                             {D},
                                                             {D},
                                                             {D},
                                                             {a.vocab_size, D}};
  EXPECT_EQ(shapes, expected_shapes);
  EXPECT_TRUE(model->lm_head->weight.is_same(model->transformer->wte->weight));
  EXPECT_EQ(model->unique_parameters().size(), expected.size() - 1);
  EXPECT_TRUE(model->named_buffers().is_empty());
}

TEST(Gpt2, Conv1DIsXTimesItsWeightPlusBias) {
  torch::manual_seed(0);
  fsdp::models::Gpt2Conv1D conv(3, 5);
  {
    at::NoGradGuard no_grad;
    conv->weight.normal_();
    conv->bias.normal_();
  }
  const at::Tensor x = at::randn({2, 4, 3});
  EXPECT_TRUE(conv(x).allclose(at::matmul(x, conv->weight) + conv->bias, 1e-6, 1e-6));
}

TEST(Gpt2, ChunkedLossAndCheckpointedBlocksEqualThePlainModel) {
  const at::Tensor tokens = at::randint(0, 64, {2, 12}, at::kLong), targets = at::randint(0, 64, {2, 12}, at::kLong);
  auto run = [&](int64_t every, int64_t chunks) {
    torch::manual_seed(0);
    Gpt2 model(small_args());
    model->set_activation_checkpointing(every);
    at::Tensor loss = model->forward_loss(tokens, targets, chunks);
    loss.backward();
    std::vector<at::Tensor> grads;
    for (const auto& p : model->unique_parameters()) grads.push_back(p.grad().clone());
    return std::make_pair(loss.item<double>(), grads);
  };
  const auto [plain, plain_grads] = run(0, 1);
  for (const auto& [every, chunks] : {std::pair<int64_t, int64_t>{1, 1}, {0, 5}}) {
    const auto [loss, grads] = run(every, chunks);
    EXPECT_NEAR(loss, plain, 1e-6 * std::abs(plain)) << every << " " << chunks;
    ASSERT_EQ(grads.size(), plain_grads.size());
    for (size_t i = 0; i < grads.size(); ++i) EXPECT_TRUE(grads[i].allclose(plain_grads[i], 1e-5, 1e-6)) << i;
  }
}

TEST(Gpt2, DropoutOnlyInTraining) {
  torch::manual_seed(0);
  Gpt2Args a = small_args();
  a.embd_pdrop = a.attn_pdrop = a.resid_pdrop = 0.5;
  Gpt2 model(a);
  const at::Tensor tokens = at::randint(0, 64, {2, 12}, at::kLong);
  model->eval();
  EXPECT_TRUE(model(tokens).equal(model(tokens)));
  model->train();
  EXPECT_FALSE(model(tokens).equal(model(tokens)));
}

TEST(Gpt2, RootHoldsTheTiedWeightAndTrainsItAtTwoRanks) {
  fsdp::testing::run_distributed(2, [] {
    torch::manual_seed(0);
    Gpt2 model(small_args(), [](fsdp::models::Gpt2Block& block) { fsdp::fully_shard(block); });
    fsdp::fully_shard(model);
    const at::Tensor tokens = at::randint(0, 64, {2, 8}, at::kLong);
    at::Tensor loss = fsdp::call_method(model, &fsdp::models::Gpt2Impl::forward_loss, tokens, tokens, int64_t{1});
    loss.backward();
    const at::Tensor grad = model->transformer->wte->named_parameters()["weight"].grad();
    ASSERT_TRUE(grad.defined());
    EXPECT_GT(grad.abs().sum().item<double>(), 0.0);
  });
}

TEST(Gpt2Hf, ReadsGpt2ConfigsDefaultsAndRefusesWhatItDoesNotComputeNamingFileAndKey) {
  const std::string path = "ckpt/config.json";
  const Gpt2Args a = fsdp::models::gpt2_args_from_hf_config_text(
      R"({"architectures": ["GPT2LMHeadModel"], "vocab_size": 96, "n_embd": 32, "n_layer": 2, "n_head": 4,
          "n_positions": 64, "n_inner": null})",
      path);
  EXPECT_EQ(a.n_inner, 128);
  EXPECT_EQ(a.activation_function, "gelu_new");
  EXPECT_TRUE(a.tie_word_embeddings);
  EXPECT_EQ(a.resid_pdrop, 0.1);  // GPT2Config's default
  auto refusal = [&](const std::string& extra) {
    return error_of([&] {
      fsdp::models::gpt2_args_from_hf_config_text(
          R"({"architectures": ["GPT2LMHeadModel"], "n_embd": 32, "n_head": 4)" + extra + "}", path);
    });
  };
  for (const char* key : {"scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"}) {
    const std::string e = refusal(std::string(", \"") + key + "\": true");
    EXPECT_NE(e.find(path + ": key '" + key + "'"), std::string::npos) << e;
  }
  EXPECT_NE(refusal(R"(, "activation_function": "relu")").find("key 'activation_function'"), std::string::npos);
  EXPECT_NE(refusal(R"(, "n_head": 5)").find("n_embd=32 is not a multiple of n_head=5"), std::string::npos);
  const std::string llama = error_of(
      [&] { fsdp::models::gpt2_args_from_hf_config_text(R"({"architectures": ["LlamaForCausalLM"]})", path); });
  EXPECT_NE(llama.find("key 'architectures' names LlamaForCausalLM"), std::string::npos) << llama;
}

TEST(Gpt2Plan, SpecHoldsTheModelsParametersAndRefusesTensorParallelism) {
  for (const bool tied : {true, false}) {
    Gpt2Args a = small_args();
    a.n_layer = 2;
    a.tie_word_embeddings = tied;
    torch::manual_seed(0);
    Gpt2 model(a);
    int64_t numel = 0;
    for (const auto& p : model->unique_parameters()) numel += p.numel();
    fsdp::plan::Gpt2Shape s;
    s.n_layers = a.n_layer, s.vocab_size = a.vocab_size, s.n_embd = a.n_embd, s.n_inner = a.n_inner;
    s.n_heads = a.n_head, s.n_positions = a.n_positions, s.tie_word_embeddings = tied;
    fsdp::plan::ActivationOptions act;
    const fsdp::plan::ModelSpec spec = fsdp::plan::gpt2_spec(s, act);
    int64_t planned = 0;
    for (const auto& g : spec.groups)
      for (const auto& p : g.params) planned += p.numel();
    EXPECT_EQ(planned, numel) << "tied " << tied;
    EXPECT_EQ(spec.groups.size(), 3u);
    EXPECT_EQ(spec.stages.size(), 4u);
  }
  fsdp::plan::TransformerSharding tp;
  tp.tensor_parallel = 2;
  try {
    fsdp::plan::gpt2_spec(fsdp::plan::Gpt2Shape(), fsdp::plan::ActivationOptions(), tp);
    FAIL() << "tensor_parallel 2 was planned";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("no tensor-parallel plan"), std::string::npos) << e.what();
  }
}

}  // namespace
