// fsdp::plan's arithmetic on models small enough to follow by hand: the shard layout and its
// padding, the step's peak and what makes it up, mixed precision's copies, the collectives per
// step of each strategy, and the Transformer's description.
#include <fsdp/plan.h>

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

namespace {

using namespace fsdp::plan;

// One root group with one parameter of `shape`, one stage keeping 1000 bytes for backward and
// 500 more at its backward's high point.
ModelSpec one_group(std::vector<int64_t> shape) {
  ModelSpec m;
  m.groups.push_back(GroupSpec{"", {{"w", std::move(shape)}}});
  StageSpec s;
  s.name = "body";
  s.grads = {0};
  s.saved_bytes = 1000;
  s.backward_extra_bytes = 500;
  m.stages.push_back(s);
  return m;
}

Constants no_time() {
  Constants c = measured_constants();
  c.runtime_rss_bytes = 100;
  c.rss_per_tensor_byte = 2;
  return c;
}

int64_t bytes_of_buffer(const RankPlan& r, const std::string& what) {
  int64_t n = 0;
  for (const Buffer& b : r.at_peak)
    if (b.what == what) n += b.bytes;
  return n;
}

TEST(Plan, OneRankPeaksInBackwardWithGradientsAndActivations) {
  // 100 fp32 parameters: 400 bytes, AdamW's moments 800. Backward's high point: the floor
  // (1200) + saved activations 1000 + 500 + the unsharded gradient 400 = 3100. The optimizer
  // step (1200 + gradients 400 + AdamW's two temporaries 800 = 2400) is lower.
  const Plan p = plan(one_group({100}), PlanOptions().constants(no_time()));
  ASSERT_EQ(p.ranks.size(), 1u);
  const RankPlan& r = p.ranks[0];
  EXPECT_EQ(r.peak_tensor_bytes, 3100);
  EXPECT_NE(r.peak_at.find("backward of body"), std::string::npos) << r.peak_at;
  EXPECT_EQ(r.params[0].bytes, 400);
  EXPECT_EQ(r.optimizer_state[0].bytes, 800);
  EXPECT_EQ(r.grads[0].bytes, 400);
  EXPECT_EQ(r.activation_bytes, 1000);
  EXPECT_EQ(bytes_of_buffer(r, "unsharded gradients"), 400);
  EXPECT_EQ(r.peak_rss_bytes, 100 + 2 * 3100);
  EXPECT_TRUE(r.collectives.empty());  // one rank gathers and reduces nothing
}

TEST(Plan, ShardsPadDimZeroAndTheLastRanksHoldFewerRealRows) {
  // [10, 3] over 4 ranks: pieces of ceil(10 / 4) = 3 rows = 9 elements, padded alike on every
  // rank; rank 3 holds the one real row left (3 elements), so its optimizer state is smaller.
  const Plan p = plan(one_group({10, 3}), PlanOptions().world(4).constants(no_time()));
  ASSERT_EQ(p.ranks.size(), 4u);
  for (const RankPlan& r : p.ranks) EXPECT_EQ(r.params[0].bytes, 9 * 4) << "rank " << r.rank;
  EXPECT_EQ(p.ranks[0].optimizer_state[0].bytes, 2 * 9 * 4);
  EXPECT_EQ(p.ranks[3].optimizer_state[0].bytes, 2 * 3 * 4);
  // The root's all-gather (4 x 9 elements) in forward only, its reduce-scatter once.
  ASSERT_EQ(p.ranks[0].collectives.size(), 2u);
  EXPECT_EQ(p.ranks[0].collectives[0].kind, "all_gather");
  EXPECT_EQ(p.ranks[0].collectives[0].count, 1);
  EXPECT_EQ(p.ranks[0].collectives[0].bytes, 4 * 9 * 4);
  EXPECT_EQ(p.ranks[0].collectives[1].kind, "reduce_scatter");
  EXPECT_EQ(p.ranks[0].collectives[1].bytes, 4 * 9 * 4);
}

TEST(Plan, MixedPrecisionKeepsBf16UnshardedCopiesAndCastsGradientsToFp32) {
  // One rank, bf16 compute: the unsharded parameters are a bf16 copy (200 bytes) kept by the
  // root through the step; backward's high point is 1200 + 200 + 1000 + 500 + bf16 gradient 200.
  const Plan p = plan(one_group({100}), PlanOptions().param_dtype(Dtype::kBFloat16).constants(no_time()));
  const RankPlan& r = p.ranks[0];
  EXPECT_EQ(r.peak_tensor_bytes, 3100);
  EXPECT_EQ(bytes_of_buffer(r, "unsharded parameters"), 200);
  EXPECT_EQ(bytes_of_buffer(r, "unsharded gradients"), 200);
  EXPECT_EQ(r.grads[0].bytes, 400);  // fp32 after the hand-over's cast
}

// The root [4, 2] and one block [6, 2], each with a stage.
ModelSpec root_and_block() {
  ModelSpec m;
  m.groups.push_back(GroupSpec{"", {{"root.w", {4, 2}}}});
  m.groups.push_back(GroupSpec{"block", {{"block.w", {6, 2}}}});
  for (int g = 0; g < 2; ++g) {
    StageSpec s;
    s.name = g == 0 ? "root" : "block";
    s.group = g;
    s.grads = {0};
    s.saved_bytes = 100;
    m.stages.push_back(s);
  }
  return m;
}

const Collectives& find(const RankPlan& r, const std::string& group, const std::string& kind) {
  for (const Collectives& c : r.collectives)
    if (c.group == group && c.kind == kind) return c;
  throw std::runtime_error("no " + kind + " of " + group);
}

TEST(Plan, ReshardAfterForwardGathersBlocksAgainInBackwardButNeverTheRoot) {
  // W=2: the root's row is 2 x 2 = 4 elements, the block's 3 x 2 = 6.
  const Plan zero3 = plan(root_and_block(), PlanOptions().world(2).constants(no_time()));
  EXPECT_EQ(find(zero3.ranks[0], "(root)", "all_gather").count, 1);
  EXPECT_EQ(find(zero3.ranks[0], "block", "all_gather").count, 2);
  EXPECT_EQ(find(zero3.ranks[0], "block", "all_gather").bytes, 2 * (2 * 6 * 4));
  EXPECT_EQ(find(zero3.ranks[0], "block", "reduce_scatter").bytes, 2 * 6 * 4);
  const Plan zero2 =
      plan(root_and_block(), PlanOptions().world(2).reshard_after_forward(false).constants(no_time()));
  EXPECT_EQ(find(zero2.ranks[0], "block", "all_gather").count, 1);
  // Keeping the block gathered until backward cannot lower the peak.
  EXPECT_GE(zero2.ranks[0].peak_tensor_bytes, zero3.ranks[0].peak_tensor_bytes);
}

TEST(Plan, AccumulationGathersPerMicroBatchAndReducesOnceUnlessHybrid) {
  const Plan fsdp = plan(root_and_block(), PlanOptions().world(2).micro_batches(3).constants(no_time()));
  EXPECT_EQ(find(fsdp.ranks[0], "block", "all_gather").count, 6);
  EXPECT_EQ(find(fsdp.ranks[0], "block", "reduce_scatter").count, 1);
  // HSDP, 2 replicas of 2 shards: a reduce-scatter per micro-batch, one all-reduce of the
  // shard (6 elements) across replicas.
  const Plan hsdp = plan(root_and_block(), PlanOptions().world(4).replicate(2).micro_batches(3).constants(no_time()));
  EXPECT_EQ(find(hsdp.ranks[0], "block", "reduce_scatter").count, 3);
  const Collectives& ar = find(hsdp.ranks[0], "block", "all_reduce");
  EXPECT_EQ(ar.mesh, "replicate");
  EXPECT_EQ(ar.count, 1);
  EXPECT_EQ(ar.bytes, 6 * 4);
}

TEST(Plan, NoShardKeepsWholeParametersAndGradientBuckets) {
  const Plan p = plan(root_and_block(), PlanOptions().world(2).no_shard(true).constants(no_time()));
  const RankPlan& r = p.ranks[0];
  EXPECT_EQ(r.params[0].bytes, (8 + 12) * 4);
  EXPECT_EQ(r.optimizer_state[0].bytes, 2 * (8 + 12) * 4);
  ASSERT_EQ(r.collectives.size(), 1u);
  EXPECT_EQ(r.collectives[0].kind, "all_reduce");
  EXPECT_EQ(r.collectives[0].bytes, (8 + 12) * 4);
  EXPECT_THROW(plan(root_and_block(), PlanOptions().no_shard(true).param_dtype(Dtype::kBFloat16)),
               std::invalid_argument);
}

TEST(Plan, RefusesImpossibleOptionsNamingThem) {
  try {
    plan(root_and_block(), PlanOptions().world(3).replicate(2));
    FAIL() << "a replicate degree that does not divide the world was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("replicate (2) must divide the world (3)"), std::string::npos) << e.what();
  }
  EXPECT_THROW(plan(ModelSpec{}, PlanOptions()), std::invalid_argument);
}

TEST(PlanTransformer, GroupsHoldEveryParameterOfTheModel) {
  TransformerShape t;
  t.n_layers = 3, t.vocab_size = 50, t.max_seq_len = 20, t.dim = 8, t.n_heads = 2;
  const ModelSpec m = transformer_spec(t, ActivationOptions{2, 10});
  ASSERT_EQ(m.groups.size(), 4u);  // the root and three blocks
  int64_t n = 0;
  for (const GroupSpec& g : m.groups)
    for (const ParamSpec& p : g.params) n += p.numel();
  // 2 V D + S D + L (12 D^2 + 9 D) + 2 D
  EXPECT_EQ(n, 2 * 50 * 8 + 20 * 8 + 3 * (12 * 64 + 9 * 8) + 2 * 8);
  ASSERT_EQ(m.stages.size(), 5u);  // embeddings, three blocks, the head
  // A block keeps 16 N D + B H T T elements (fp32), the mask and its LayerNorms' statistics.
  const double N = 2 * 10;
  EXPECT_DOUBLE_EQ(m.stages[1].saved_bytes, 4 * (16 * N * 8 + 2 * 2 * 10 * 10) + 10 * 10 + 2 * 2 * N * 4);
  // The head: the norm's output and the fp32 log-softmax.
  EXPECT_DOUBLE_EQ(m.stages[4].saved_bytes, 4 * N * 8 + 4 * N * 50 + 2 * N * 4);
}

TEST(PlanTransformer, CheckpointingKeepsOnlyTheCheckpointedBlocksOutputs) {
  TransformerShape t;
  ActivationOptions a{4, 16};
  a.checkpoint_every = 2;
  const ModelSpec m = transformer_spec(t, a);
  EXPECT_FALSE(m.stages[1].checkpointed);  // block 0
  EXPECT_TRUE(m.stages[2].checkpointed);   // block 1: (1 + 1) % 2 == 0
  a.loss_chunks = 4;
  const ModelSpec chunked = transformer_spec(t, a);
  EXPECT_TRUE(chunked.stages.back().checkpointed);
  EXPECT_EQ(chunked.stages.back().pieces, 4);
  // One piece's logits: a quarter of the sequence.
  EXPECT_DOUBLE_EQ(chunked.stages.back().backward_extra_bytes, 8 * 4 * 4 * 8);
}

TEST(PlanTransformer, RefusesSizesTheModelRefuses) {
  TransformerShape t;
  t.dim = 10, t.n_heads = 4;
  EXPECT_THROW(transformer_spec(t, ActivationOptions{1, 8}), std::invalid_argument);
  TransformerShape ok;
  EXPECT_THROW(transformer_spec(ok, ActivationOptions{1, 17}), std::invalid_argument);  // seq > max_seq_len 16
  ActivationOptions chunks{1, 8};
  chunks.loss_chunks = 9;
  EXPECT_THROW(transformer_spec(ok, chunks), std::invalid_argument);
}

TEST(PlanConstants, BuiltInConstantsParseAndAMissingKeyIsNamed) {
  const Constants c = measured_constants();
  EXPECT_GT(c.matmul_flops_fp32, 0);
  EXPECT_FALSE(c.source.empty());
  try {
    constants_from_json(R"({"matmul_flops_fp32": 1})");
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("matmul_flops_bf16"), std::string::npos) << e.what();
  }
}

}  // namespace
