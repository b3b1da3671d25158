// fsdp::plan's arithmetic on models small enough to follow by hand: the shard layout and its
// padding, the step's peak and what makes it up, mixed precision's copies, the collectives per
// step of each strategy, the GPU's memory and the host's apart under each offload placement, and
// the Transformer's description.
#include <fsdp/plan.h>

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

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
  const Plan zero2 = plan(root_and_block(), PlanOptions().world(2).reshard_after_forward(false).constants(no_time()));
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

// root [4, 2] -> block [6, 2] -> head [8, 2], the head a group of its own kept gathered from its
// forward to its backward. The block's backward is the high point (5000 bytes above its 1000).
ModelSpec root_block_and_head() {
  ModelSpec m = root_and_block();
  m.stages[0].saved_bytes = 0;
  m.stages[1].saved_bytes = 1000;
  m.stages[1].backward_extra_bytes = 5000;
  GroupSpec head{"head", {{"head.w", {8, 2}}}};
  head.reshard_after_forward = false;
  m.groups.push_back(head);
  StageSpec s;
  s.name = "head";
  s.group = 2;
  s.grads = {0};
  s.saved_bytes = 100;
  m.stages.push_back(s);
  return m;
}

TEST(Plan, AHeadGroupGathersOnceAndIsFreedBeforeTheBlocksBackward) {
  const Plan p = plan(root_block_and_head(), PlanOptions().world(2).constants(no_time()));
  const RankPlan& r = p.ranks[0];
  // Kept gathered into its backward: one all-gather (the block, resharded after forward: two),
  // and its own reduce-scatter of 2 x 8 elements.
  EXPECT_EQ(find(r, "head", "all_gather").count, 1);
  EXPECT_EQ(find(r, "head", "all_gather").bytes, 2 * 8 * 4);
  EXPECT_EQ(find(r, "head", "reduce_scatter").bytes, 2 * 8 * 4);
  EXPECT_EQ(find(r, "block", "all_gather").count, 2);
  // At the block's backward: the shards (4 + 6 + 8 elements) and AdamW's moments, 216 bytes; the
  // root's unsharded parameters (32) and the block's (48); the head's reduce-scatter input and
  // output still in flight (64 + 32); the block's activations (1000 + 5000) and its unsharded
  // gradient (48). The head's unsharded parameters (64) were freed after its backward.
  EXPECT_NE(r.peak_at.find("backward of block"), std::string::npos) << r.peak_at;
  EXPECT_EQ(r.peak_tensor_bytes, 216 + 32 + 48 + 96 + 6000 + 48);
  for (const Buffer& b : r.at_peak) EXPECT_FALSE(b.module == "head" && b.what == "unsharded parameters") << b.bytes;
}

// Two blocks as the Transformer's are split over 2 tp ranks: each one's stage all-reduces twice
// in forward and four times in backward, 100 KiB each.
ModelSpec tensor_parallel_blocks() {
  ModelSpec m = root_and_block();
  m.tensor_parallel = 2;
  m.stages[1].tp_all_reduces = {{2, 4, 100 * 1024}};
  return m;
}

TEST(Plan, TensorParallelShardsOverDataParallelRanksAndAllReducesOnTheTpGroup) {
  // W=4 as (dp 2, tp 2): the block's [6, 2] piece is sharded over the 2 dp ranks (rows of 3 x 2).
  const Plan p = plan(tensor_parallel_blocks(), PlanOptions().world(4).micro_batches(2).constants(no_time()));
  ASSERT_EQ(p.ranks.size(), 4u);
  EXPECT_EQ(find(p.ranks[0], "block", "all_gather").bytes, 2 * 2 * (2 * 6 * 4));  // 2 micro-batches x 2
  const Collectives& tp = find(p.ranks[0], "block", "all_reduce");
  EXPECT_EQ(tp.mesh, "tp");
  EXPECT_EQ(tp.count, 2 * 6);
  EXPECT_EQ(tp.bytes, 2 * 6 * 100 * 1024);
  // Gloo's scratch of the tp group: an all-reduce above 64 KiB keeps one chunk, 100 KiB / 2.
  const Plan mpi = plan(tensor_parallel_blocks(), PlanOptions().world(4).backend(Backend::kMpi).constants(no_time()));
  const Plan gloo = plan(tensor_parallel_blocks(), PlanOptions().world(4).constants(no_time()));
  EXPECT_EQ(gloo.ranks[0].peak_tensor_bytes - mpi.ranks[0].peak_tensor_bytes, 50 * 1024);
  // A checkpointed block all-reduces its forward's two again in the recomputation.
  ModelSpec checkpointed = tensor_parallel_blocks();
  checkpointed.stages[1].checkpointed = true;
  EXPECT_EQ(find(plan(checkpointed, PlanOptions().world(4)).ranks[0], "block", "all_reduce").count, 8);
  EXPECT_THROW(plan(tensor_parallel_blocks(), PlanOptions().world(3)), std::invalid_argument);
  EXPECT_THROW(plan(tensor_parallel_blocks(), PlanOptions().world(4).replicate(2)), std::invalid_argument);
}

TEST(Plan, MpiKeepsScratchInTensorsOnlyForItsRingsAndUsesItsOwnRates) {
  // W=4: Gloo's ring reduce-scatter keeps two chunks of the largest row (the block's 2 x 2
  // elements, fp32) in its scratch for the whole step; MPI leaves a reduce-scatter below 256 KiB
  // to OpenMPI, whose temporaries are not tensors.
  Constants c = no_time();
  c.mpi_collective_latency_s = c.mpi_collective_latency_s_oversubscribed = 1;  // a second per ring step
  const Plan gloo = plan(root_and_block(), PlanOptions().world(4).constants(c));
  const Plan mpi = plan(root_and_block(), PlanOptions().world(4).backend(Backend::kMpi).constants(c));
  EXPECT_EQ(gloo.ranks[0].peak_tensor_bytes - mpi.ranks[0].peak_tensor_bytes, 2 * 2 * 2 * 4);
  // From 256 KiB MPI runs the same ring: a [65536, 2] block reduce-scatters 512 KiB in fp32, two
  // rows of 16384 x 2 elements kept, as Gloo keeps them.
  ModelSpec large = root_and_block();
  large.groups[1].params[0].shape = {65536, 2};
  const Plan large_gloo = plan(large, PlanOptions().world(4).constants(c));
  const Plan large_mpi = plan(large, PlanOptions().world(4).backend(Backend::kMpi).constants(c));
  EXPECT_EQ(large_gloo.ranks[0].peak_tensor_bytes, large_mpi.ranks[0].peak_tensor_bytes);
  // 2 + 1 all-gathers and 2 reduce-scatters, each a ring of 3 steps.
  EXPECT_GE(mpi.communication_s, 15.0);
  EXPECT_LT(gloo.communication_s, 1.0);
}

TEST(Plan, TheStepAfterABackgroundSaveHoldsItsStagedCopy) {
  // W=2: this rank's real elements are 4 (root) + 6 (block); the staged copy holds them and the
  // two moments in fp32, plus the trainer's counters (16 bytes) and the generator (5056).
  const Plan quiet = plan(root_and_block(), PlanOptions().world(2).constants(no_time()));
  const Plan saving = plan(root_and_block(), PlanOptions().world(2).background_checkpoints(true).constants(no_time()));
  const RankPlan& r = saving.ranks[0];
  EXPECT_EQ(r.checkpoint_staging_bytes, 3 * 10 * 4 + 16 + 5056);
  EXPECT_EQ(r.peak_tensor_bytes, quiet.ranks[0].peak_tensor_bytes);
  EXPECT_EQ(r.peak_tensor_bytes_after_save, r.peak_tensor_bytes + r.checkpoint_staging_bytes);
  EXPECT_EQ(r.peak_rss_bytes, 100 + 2 * r.peak_tensor_bytes_after_save);
  EXPECT_EQ(quiet.ranks[0].peak_tensor_bytes_after_save, quiet.ranks[0].peak_tensor_bytes);
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

// Device cuda: the GPU's memory and the host's apart, for the trainer's three placements.

PlanOptions on_gpu(int world) { return PlanOptions().world(world).device(Device::kCuda).constants(no_time()); }

// The bytes of the buffers in `alive` whose kind starts with `what` ("sharded parameters" takes
// in "sharded parameters (pinned)").
int64_t alive_bytes(const std::vector<Buffer>& alive, const std::string& what) {
  int64_t n = 0;
  for (const Buffer& b : alive)
    if (b.what.compare(0, what.size(), what) == 0) n += b.bytes;
  return n;
}

// A model whose sharded state outweighs what one group gathers: a small root and eight blocks
// of 64 x 16 and 64 elements, with little activation, and the step's data on the host (256
// bytes) and the GPU (128).
ModelSpec state_heavy() {
  ModelSpec m;
  m.groups.push_back(GroupSpec{"", {{"emb", {8, 16}}}});
  StageSpec root;
  root.name = "emb";
  root.grads = {0};
  root.saved_bytes = 64;
  m.stages.push_back(root);
  for (int i = 0; i < 8; ++i) {
    const std::string name = "block" + std::to_string(i);
    m.groups.push_back(GroupSpec{name, {{name + ".w", {64, 16}}, {name + ".b", {64}}}});
    StageSpec s;
    s.name = name;
    s.group = i + 1;
    s.grads = {0, 1};
    s.saved_bytes = 64;
    m.stages.push_back(s);
  }
  m.input_bytes = 256;
  m.device_input_bytes = 128;
  return m;
}

TEST(PlanCuda, WithoutOffloadTheGpuRunsTheCpusReplayAndNoStepTimeIsPredicted) {
  // One rank, no data, no collectives: the GPU holds exactly what the one memory held (3100).
  const Plan cpu = plan(one_group({100}), PlanOptions().constants(no_time()));
  const Plan gpu = plan(one_group({100}), on_gpu(1));
  EXPECT_EQ(gpu.ranks[0].peak_tensor_bytes, cpu.ranks[0].peak_tensor_bytes);
  EXPECT_EQ(gpu.ranks[0].peak_tensor_bytes, 3100);
  EXPECT_EQ(gpu.ranks[0].peak_at, cpu.ranks[0].peak_at);
  EXPECT_EQ(gpu.ranks[0].host_peak_tensor_bytes, 0);
  EXPECT_EQ(cpu.ranks[0].host_peak_tensor_bytes, 0);  // one memory: nothing apart
  EXPECT_TRUE(cpu.step_time_modeled);
  EXPECT_GT(cpu.step_time_s, 0);
  EXPECT_FALSE(gpu.step_time_modeled);  // CPU rates make no GPU step time
  EXPECT_EQ(gpu.step_time_s, 0);
  EXPECT_EQ(gpu.ranks[0].peak_rss_bytes, 0);  // the CUDA runtime's host memory is not planned
  EXPECT_EQ(gpu.ranks[0].collectives.size(), cpu.ranks[0].collectives.size());
}

TEST(PlanCuda, OffloadMovesTheShardsToTheHostAndTheGpuPeakFallsAsTheHostsRises) {
  const ModelSpec m = state_heavy();
  const RankPlan none = plan(m, on_gpu(2)).ranks[0];
  const RankPlan params = plan(m, on_gpu(2).offload(true).optimizer(Optimizer::kDeviceStateAdamW)).ranks[0];
  const RankPlan full = plan(m, on_gpu(2).offload(true)).ranks[0];
  EXPECT_GT(none.peak_tensor_bytes, params.peak_tensor_bytes);
  EXPECT_GT(params.peak_tensor_bytes, full.peak_tensor_bytes);
  EXPECT_LT(none.host_peak_tensor_bytes, params.host_peak_tensor_bytes);
  EXPECT_LT(params.host_peak_tensor_bytes, full.host_peak_tensor_bytes);
  // Without offload the host holds the step's data only; the GPU the micro-batch's copy.
  EXPECT_EQ(none.host_peak_tensor_bytes, 256);
  EXPECT_EQ(alive_bytes(none.at_peak, "the micro-batch's tokens"), 128);
  EXPECT_EQ(alive_bytes(none.at_peak, "collective scratch"), 0);  // NCCL's buffers are not tensors
  EXPECT_EQ(none.params_in, Memory::kDevice);
  EXPECT_EQ(none.optimizer_state_in, Memory::kDevice);
  EXPECT_EQ(params.params_in, Memory::kHost);
  EXPECT_EQ(params.grads_in, Memory::kHost);
  EXPECT_EQ(params.optimizer_state_in, Memory::kDevice);
  EXPECT_EQ(full.params_in, Memory::kHost);
  EXPECT_EQ(full.optimizer_state_in, Memory::kHost);
  // Under full offload AdamW steps on the host, with every sharded gradient there.
  EXPECT_NE(full.host_peak_at.find("optimizer step (on the host)"), std::string::npos) << full.host_peak_at;
  EXPECT_EQ(alive_bytes(full.host_at_peak, "sharded gradients (pinned)"), full.grads[0].bytes);
  EXPECT_EQ(alive_bytes(full.at_peak, "optimizer state"), 0);
}

TEST(PlanCuda, TheShardedStateIsTheOneMemorysSplitBetweenGpuAndHost) {
  const ModelSpec m = state_heavy();
  const RankPlan cpu = plan(m, PlanOptions().world(2).constants(no_time())).ranks[0];
  const std::vector<PlanOptions> placements = {
      on_gpu(2), on_gpu(2).offload(true).optimizer(Optimizer::kDeviceStateAdamW), on_gpu(2).offload(true)};
  for (const PlanOptions& o : placements) {
    const RankPlan r = plan(m, o).ranks[0];
    for (const char* what : {"sharded parameters", "optimizer state"})
      EXPECT_EQ(alive_bytes(r.at_peak, what) + alive_bytes(r.host_at_peak, what), alive_bytes(cpu.at_peak, what))
          << what << ", offload " << o.offload_;
    EXPECT_EQ(r.params[0].bytes, cpu.params[0].bytes);
    EXPECT_EQ(r.grads[0].bytes, cpu.grads[0].bytes);
    EXPECT_EQ(r.optimizer_state[0].bytes, cpu.optimizer_state[0].bytes);
  }
}

TEST(PlanCuda, FullOffloadCopiesTheShardUpForTheAllGatherAndStepsOnTheHost) {
  // One rank, fp16 compute, fp32 reduce: the GPU peaks in backward with the fp16 unsharded
  // parameters (200), the activations (1000 + 500) and the fp16 gradients (200); the host at the
  // step with the pinned shards (400) and gradients (400), AdamW's state (800) and its two
  // temporaries (800).
  const RankPlan r =
      plan(one_group({100}), on_gpu(1).offload(true).param_dtype(Dtype::kFloat16).reduce_dtype(Dtype::kFloat32))
          .ranks[0];
  EXPECT_EQ(r.peak_tensor_bytes, 200 + 1500 + 200);
  EXPECT_NE(r.peak_at.find("backward of body"), std::string::npos) << r.peak_at;
  EXPECT_EQ(r.host_peak_tensor_bytes, 400 + 400 + 800 + 800);
  EXPECT_EQ(alive_bytes(r.host_at_peak, "sharded parameters (pinned)"), 400);
  EXPECT_EQ(alive_bytes(r.host_at_peak, "optimizer temporaries"), 800);
  // FusedAdamW's one pass on the host makes no temporaries.
  const RankPlan fused = plan(one_group({100}), on_gpu(1).offload(true).optimizer(Optimizer::kFusedAdamW)).ranks[0];
  EXPECT_EQ(alive_bytes(fused.host_at_peak, "optimizer temporaries"), 0);
  // Two ranks: each group's shard is copied to the GPU (fp16) beside the all-gather's output.
  const RankPlan two = plan(one_group({100}), on_gpu(2).offload(true).param_dtype(Dtype::kFloat16)).ranks[0];
  const RankPlan two_cpu =
      plan(one_group({100}), PlanOptions().world(2).param_dtype(Dtype::kFloat16).constants(no_time())).ranks[0];
  EXPECT_EQ(alive_bytes(two.at_peak, "sharded parameters"), 0);
  EXPECT_GT(alive_bytes(two_cpu.at_peak, "sharded parameters"), 0);
}

TEST(PlanCuda, DeviceStateAdamWHoldsTwoParametersCopiesBesideItsStateOnTheGpu) {
  // One rank, parameters a (400 elements) then b (100). At a's update the GPU holds AdamW's
  // state of both (2 x 500 x 4), a's and b's shard and gradient copies (2 x 500 x 4) and a's
  // update's two temporaries (2 x 400 x 4): above backward's 4000 + 2000 + 2000.
  ModelSpec m;
  m.groups.push_back(GroupSpec{"", {{"a", {400}}, {"b", {100}}}});
  StageSpec s;
  s.name = "body";
  s.grads = {0, 1};
  m.stages.push_back(s);
  const PlanOptions o = on_gpu(1).offload(true).optimizer(Optimizer::kDeviceStateAdamW);
  const RankPlan r = plan(m, o).ranks[0];
  EXPECT_NE(r.peak_at.find("DeviceStateAdamW, a"), std::string::npos) << r.peak_at;
  EXPECT_EQ(alive_bytes(r.at_peak, "DeviceStateAdamW copies"), 2 * 500 * 4);
  EXPECT_EQ(alive_bytes(r.at_peak, "optimizer temporaries"), 2 * 400 * 4);
  EXPECT_EQ(alive_bytes(r.at_peak, "optimizer state"), 2 * 500 * 4);
  EXPECT_EQ(r.peak_tensor_bytes, 4000 + 4000 + 3200);
  EXPECT_EQ(r.host_peak_tensor_bytes, 500 * 4 + 500 * 4);  // the pinned shards and gradients
  // b first: its update has a's copies beside it (4 x (2 x 100 + 2 x 400 + 2 x 100)), a's own
  // update alone is higher (4 x (2 x 400 + 2 x 400)).
  m.stages[0].grads = {1, 0};
  EXPECT_NE(plan(m, o).ranks[0].peak_at.find("DeviceStateAdamW, a"), std::string::npos);
  EXPECT_EQ(alive_bytes(plan(m, o).ranks[0].at_peak, "DeviceStateAdamW copies"), 2 * 400 * 4);
  // A background save stages every piece in host memory, the GPU's state too: the GPU's peak
  // does not move.
  const RankPlan saving = plan(m, PlanOptions(o).background_checkpoints(true)).ranks[0];
  EXPECT_EQ(saving.checkpoint_staging_bytes, 3 * 500 * 4 + 16 + 5056);
  EXPECT_EQ(saving.peak_tensor_bytes_after_save, saving.peak_tensor_bytes);
  EXPECT_EQ(saving.host_peak_tensor_bytes_after_save, saving.host_peak_tensor_bytes + 3 * 500 * 4 + 16 + 5056);
}

TEST(PlanCuda, RefusesPlacementsTheTrainerDoesNotRun) {
  try {
    plan(one_group({100}), PlanOptions().offload(true).optimizer(Optimizer::kDeviceStateAdamW));
    FAIL() << "DeviceStateAdamW on device cpu was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("kDeviceStateAdamW"), std::string::npos) << e.what();
  }
  EXPECT_THROW(plan(one_group({100}), on_gpu(1).optimizer(Optimizer::kDeviceStateAdamW)), std::invalid_argument);
  EXPECT_THROW(plan(one_group({100}), on_gpu(2).no_shard(true)), std::invalid_argument);
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
  // One piece's logits' gradient (a quarter of the sequence, fp32) and x's whole gradient; the
  // weight's gradient is an fp32 accumulator from the first piece on.
  EXPECT_DOUBLE_EQ(chunked.stages.back().backward_extra_bytes, 4 * (4 * 4) * 8 + 4 * 64 * 16);
  EXPECT_TRUE(chunked.stages.back().grads_accumulated_in_fp32);
  // Below fp32 also the logits' gradient cast, one piece's weight-gradient product, and the fp32
  // copy of the block of it being added (here all 8 rows).
  a.compute = Dtype::kBFloat16;
  EXPECT_DOUBLE_EQ(transformer_spec(t, a).stages.back().backward_extra_bytes,
                   4 * 16 * 8 + 2 * 64 * 16 + 2 * 16 * 8 + 2 * 8 * 16 + 4 * 8 * 16);
}

TEST(PlanTransformer, TensorParallelBlocksHoldTheirPiecesAndAllReduceTheirActivations) {
  TransformerShape t;
  t.n_layers = 2, t.vocab_size = 50, t.max_seq_len = 20, t.dim = 8, t.n_heads = 2;
  ActivationOptions a{2, 10};
  TransformerSharding tp;
  tp.tensor_parallel = 2;
  const ModelSpec m = transformer_spec(t, a, tp);
  EXPECT_EQ(m.tensor_parallel, 2);
  int64_t block = 0;
  for (const ParamSpec& p : m.groups[1].params) block += p.numel();
  // wq, wk, wv, wo: D^2 / 2 each; w1, w2: 4 D^2 / 2 each; w1's bias 4 D / 2; w2's bias and the
  // two norms' weights and biases whole (5 D).
  EXPECT_EQ(block, 4 * 64 / 2 + 2 * 4 * 64 / 2 + 4 * 8 / 2 + 5 * 8);
  auto root_numel = [](const ModelSpec& spec) {
    int64_t n = 0;
    for (const ParamSpec& p : spec.groups[0].params) n += p.numel();
    return n;
  };
  // The token embedding and the head split by vocabulary (25 rows each), the positions and the
  // final norm whole.
  EXPECT_EQ(root_numel(m), 2 * 25 * 8 + 20 * 8 + 2 * 8);
  // N = 20 rows: 4 N D whole and 12 N D / 2 split, the probabilities B H T^2 / 2, fp32; the mask
  // and the norms' statistics.
  const double N = 20;
  const StageSpec& s = m.stages[1];
  EXPECT_DOUBLE_EQ(s.saved_bytes, 4 * (4 * N * 8 + 6 * N * 8 + 2 * 2 * 10 * 10 / 2) + 10 * 10 + 2 * 2 * N * 4);
  // Two all-reduces of the [N, D] activations in forward (wo, w2), two of their gradients in
  // backward (the shared input of wq, wk and wv; w1's).
  ASSERT_EQ(s.tp_all_reduces.size(), 1u);
  EXPECT_EQ(s.tp_all_reduces[0].forward, 2);
  EXPECT_EQ(s.tp_all_reduces[0].backward, 2);
  EXPECT_DOUBLE_EQ(s.tp_all_reduces[0].bytes, 4 * N * 8);
  // The embedding all-reduces its output; the head its input's gradient and the loss its rows'
  // maximum (4 bytes) and sum of exponentials with the target's logit (8 bytes).
  ASSERT_EQ(m.stages[0].tp_all_reduces.size(), 1u);
  EXPECT_EQ(m.stages[0].tp_all_reduces[0].forward, 1);
  EXPECT_DOUBLE_EQ(m.stages[0].tp_all_reduces[0].bytes, 4 * N * 8);
  const StageSpec& head = m.stages.back();
  ASSERT_EQ(head.tp_all_reduces.size(), 3u);
  EXPECT_EQ(head.tp_all_reduces[0].backward, 1);
  EXPECT_DOUBLE_EQ(head.tp_all_reduces[1].bytes + head.tp_all_reduces[2].bytes, 12 * N);
  // The slice's fp32 logits kept ([N, 25]), one gradient of them in backward.
  EXPECT_DOUBLE_EQ(head.saved_bytes, 4 * N * 8 + 4 * N * 25 + 2 * N * 4 + 4 * N);
  EXPECT_DOUBLE_EQ(head.backward_extra_bytes, 4 * N * 25);
  EXPECT_DOUBLE_EQ(head.forward_flops, 2 * N * 8 * 25);
  // Per micro-batch on the tp group: 2 + 2 per block, 1 at the embedding, 3 at the head.
  const Plan p = plan(m, PlanOptions().world(2).constants(no_time()));
  int64_t tp_all_reduces = 0;
  for (const Collectives& x : p.ranks[0].collectives)
    if (x.mesh == "tp") tp_all_reduces += x.count;
  EXPECT_EQ(tp_all_reduces, 2 * 4 + 1 + 3);

  tp.vocab_parallel = false;  // the embeddings and the head whole, no all-reduce outside the blocks
  const ModelSpec whole = transformer_spec(t, a, tp);
  EXPECT_EQ(root_numel(whole), 2 * 50 * 8 + 20 * 8 + 2 * 8);
  EXPECT_TRUE(whole.stages[0].tp_all_reduces.empty());
  EXPECT_TRUE(whole.stages.back().tp_all_reduces.empty());
  tp.tensor_parallel = 4;  // does not divide n_heads 2
  EXPECT_THROW(transformer_spec(t, a, tp), std::invalid_argument);
  t.n_heads = 4;
  t.vocab_size = 50;  // 4 does not divide it: refused only with the vocabulary split
  EXPECT_NO_THROW(transformer_spec(t, a, tp));
  tp.vocab_parallel = true;
  EXPECT_THROW(transformer_spec(t, a, tp), std::invalid_argument);
}

TEST(PlanTransformer, AnOutputHeadGroupHoldsTheFinalNormAndTheHead) {
  TransformerShape t;
  t.n_layers = 2, t.vocab_size = 50, t.max_seq_len = 20, t.dim = 8, t.n_heads = 2;
  TransformerSharding head;
  head.output_head_group = true;
  const ModelSpec m = transformer_spec(t, ActivationOptions{2, 10}, head);
  ASSERT_EQ(m.groups.size(), 4u);            // the root, two blocks, the head
  EXPECT_EQ(m.groups[0].params.size(), 2u);  // the embeddings
  EXPECT_EQ(m.groups[3].name, "norm+output");
  EXPECT_FALSE(m.groups[3].reshard_after_forward);
  EXPECT_EQ(m.stages.back().group, 3);
  EXPECT_EQ(m.stages.back().grads, (std::vector<int>{0, 1, 2}));
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

// configs/llama/config.json's shape: GQA (4 query heads, 2 key/value heads of 32), SwiGLU of 352, tied.
LlamaShape shipped_llama() {
  LlamaShape l;
  l.n_layers = 4, l.vocab_size = 256, l.hidden_size = 128, l.intermediate_size = 352, l.n_heads = 4, l.n_kv_heads = 2,
  l.head_dim = 32, l.max_position_embeddings = 256, l.tie_word_embeddings = true;
  return l;
}

int64_t parameters_of(const ModelSpec& m) {
  int64_t n = 0;
  for (const GroupSpec& g : m.groups)
    for (const ParamSpec& p : g.params) n += p.numel();
  return n;
}

TEST(PlanLlama, GroupsHoldEveryParameterTheTiedHeadOnceAndTheBiasesWhenAsked) {
  LlamaShape l = shipped_llama();
  const ModelSpec tied = llama_spec(l, ActivationOptions{2, 10});
  ASSERT_EQ(tied.groups.size(), 5u);  // the root and four decoder layers
  // V D (tied) + D + L (2 D + D (2 Q + 2 K) + 3 D I), Q = 128, K = 64
  EXPECT_EQ(parameters_of(tied), 256 * 128 + 128 + 4 * (2 * 128 + 128 * (2 * 128 + 2 * 64) + 3 * 128 * 352));
  EXPECT_EQ(tied.groups[0].params.size(), 2u);  // embed_tokens (the head's too) and the final norm
  l.tie_word_embeddings = false;
  l.attention_bias = true;
  const ModelSpec untied = llama_spec(l, ActivationOptions{2, 10});
  EXPECT_EQ(parameters_of(untied), parameters_of(tied) + 256 * 128 + 4 * (128 + 2 * 64));
  EXPECT_EQ(untied.groups[0].params.back().name, "lm_head.weight");
  EXPECT_EQ(untied.groups[1].params.size(), 12u);  // nine weights and q/k/v's biases
  ASSERT_EQ(untied.stages.size(), 6u);             // embedding, four layers, the head
  // The tied weight's gradient is the head's (its backward comes first), not the embedding's too.
  EXPECT_TRUE(tied.stages[0].grads.empty());
  EXPECT_EQ(tied.stages[5].grads, (std::vector<int>{0, 1}));
  EXPECT_EQ(untied.stages[0].grads, (std::vector<int>{0}));
}

TEST(PlanLlama, ALayerKeepsItsNormsRotatedQueriesRepeatedKeysAndValuesAndSwiGlu) {
  const LlamaShape l = shipped_llama();
  const ModelSpec m = llama_spec(l, ActivationOptions{2, 10});
  const double N = 2 * 10, D = 128, Q = 128, I = 352;
  // fp32: two norms (2 N D + N each), q, k and v repeated to Q, the output (4 N Q),
  // the log-sum-exp (B H T), the residual and the output (2 N D), SwiGLU (4 N I).
  EXPECT_DOUBLE_EQ(m.stages[1].saved_bytes, 4 * (4 * N * D + 2 * N + 4 * N * Q + 2 * 4 * 10 + 2 * N * D + 4 * N * I));
  // Without grouped-query attention the keys and values stay at n_kv_heads x head_dim.
  LlamaShape mha = l;
  mha.n_kv_heads = 4;
  EXPECT_DOUBLE_EQ(m.stages[1].saved_bytes - llama_spec(mha, ActivationOptions{2, 10}).stages[1].saved_bytes, 0);
  mha.n_heads = 8;  // 8 query heads over 4 key/value heads of 32: Q = 256, K = 128, repeated to 256
  const double q8 = 256;
  EXPECT_DOUBLE_EQ(llama_spec(mha, ActivationOptions{2, 10}).stages[1].saved_bytes,
                   4 * (4 * N * D + 2 * N + 4 * N * q8 + 2 * 8 * 10 + 2 * N * D + 4 * N * I));
}

TEST(PlanLlama, RefusesSizesTheModelRefusesAndSplitsWhatItsPlanSplits) {
  LlamaShape l = shipped_llama();
  l.n_kv_heads = 3;
  EXPECT_THROW(llama_spec(l, ActivationOptions{1, 8}), std::invalid_argument);
  EXPECT_THROW(llama_spec(shipped_llama(), ActivationOptions{1, 257}), std::invalid_argument);
  TransformerSharding tp;
  tp.tensor_parallel = 3;  // divides neither n_kv_heads 2 nor intermediate_size 352
  try {
    llama_spec(shipped_llama(), ActivationOptions{1, 8}, tp);
    ADD_FAILURE() << "tensor_parallel 3 accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("tensor_parallel 3"), std::string::npos) << e.what();
  }
  tp.tensor_parallel = 2;
  tp.vocab_parallel = true;  // a tied head cannot be split by vocabulary
  EXPECT_THROW(llama_spec(shipped_llama(), ActivationOptions{1, 8}, tp), std::invalid_argument);
  tp.vocab_parallel = false;
  const ModelSpec split = llama_spec(shipped_llama(), ActivationOptions{2, 10}, tp);
  const ModelSpec whole = llama_spec(shipped_llama(), ActivationOptions{2, 10});
  EXPECT_EQ(split.tensor_parallel, 2);
  // Each tp rank holds half of every projection of a layer, and the norms whole.
  const int64_t layer_whole = [&] {
    int64_t n = 0;
    for (const ParamSpec& p : whole.groups[1].params) n += p.numel();
    return n;
  }();
  int64_t layer_split = 0;
  for (const ParamSpec& p : split.groups[1].params) layer_split += p.numel();
  EXPECT_EQ(layer_split, (layer_whole - 2 * 128) / 2 + 2 * 128);
  ASSERT_EQ(split.stages[1].tp_all_reduces.size(), 1u);  // two in forward, two in backward
  EXPECT_EQ(split.stages[1].tp_all_reduces[0].forward, 2);
  // A head of its own: untied only, the last group, kept gathered from its forward.
  TransformerSharding head;
  head.output_head_group = true;
  EXPECT_THROW(llama_spec(shipped_llama(), ActivationOptions{1, 8}, head), std::invalid_argument);
  LlamaShape untied = shipped_llama();
  untied.tie_word_embeddings = false;
  const ModelSpec grouped = llama_spec(untied, ActivationOptions{2, 10}, head);
  ASSERT_EQ(grouped.groups.size(), 6u);
  EXPECT_FALSE(grouped.groups.back().reshard_after_forward);
  EXPECT_EQ(grouped.groups[0].params.size(), 1u);  // the root keeps the embedding alone
  EXPECT_EQ(grouped.stages.back().group, 5);
  EXPECT_EQ(parameters_of(grouped), parameters_of(llama_spec(untied, ActivationOptions{2, 10})));
}

TEST(PlanConstants, BuiltInConstantsParseAndAMissingKeyIsNamed) {
  const Constants c = measured_constants();
  EXPECT_GT(c.one_thread.matmul_flops_fp32, 0);
  EXPECT_GT(c.single_rank.elementwise_bytes_per_s_bf16, 0);
  EXPECT_FALSE(c.source.empty());
  try {
    constants_from_json(R"({"cpu_cores": 2})");
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("one_thread"), std::string::npos) << e.what();
  }
}

// Round rates: a rank alone twice as fast as one thread; 1 ms per ring step (3 ms with two ranks
// per core), 1 GB/s, 10 ms of overhead per stage and micro-batch (30 in bf16).
Constants round_rates() {
  Constants c = no_time();
  c.cpu_cores = 2;
  c.one_thread = ComputeRates{1e10, 1e10, 1e9, 1e9};
  c.single_rank = ComputeRates{2e10, 2e10, 2e9, 2e9};
  c.collective_latency_s = 1e-3;
  c.collective_latency_s_oversubscribed = 3e-3;
  c.collective_bytes_per_s = 1e9;
  c.stage_overhead_s = 0.01;
  c.bf16_stage_overhead_s = 0.03;  // the parameters' casts too
  c.checkpointed_stage_overhead_s = 0;
  return c;
}

TEST(PlanStepTime, ThreadsAndRanksPerCoreSetTheRates) {
  // One stage of 1 GFLOP and 100 MB of elementwise work per forward: 3 passes of each.
  ModelSpec m = one_group({100});
  m.stages[0].forward_flops = 1e9;
  m.stages[0].other_bytes_moved = 1e8;
  // W=1: the rank alone, its libraries' threads: 3 x (0.05 + 0.05).
  const Plan alone = plan(m, PlanOptions().constants(round_rates()));
  EXPECT_NEAR(alone.compute_s, 0.3, 1e-12);
  EXPECT_NEAR(alone.overhead_s, 0.01, 1e-12);
  EXPECT_EQ(alone.communication_s, 0);
  // W=2 on 2 cores, a thread each: 3 x (0.1 + 0.1); the root's all-gather and reduce-scatter of
  // 2 x 50 fp32 elements, each a ring of one step: 1 ms + 400 B x 1/2 / 1 GB/s.
  const Plan two = plan(m, PlanOptions().world(2).constants(round_rates()));
  EXPECT_NEAR(two.compute_s, 0.6, 1e-12);
  EXPECT_NEAR(two.communication_s, 2 * (1e-3 + 200 / 1e9), 1e-12);
  // W=4 on 2 cores: half a core each, so twice the compute and overhead; rings of 3 steps at
  // 3 ms, the bytes at half the bandwidth: 4 x 25 elements x 3/4 / 0.5 GB/s.
  const Plan four = plan(m, PlanOptions().world(4).constants(round_rates()));
  EXPECT_NEAR(four.compute_s, 1.2, 1e-12);
  EXPECT_NEAR(four.overhead_s, 0.02, 1e-12);
  EXPECT_NEAR(four.communication_s, 2 * (3 * 3e-3 + 400 * 0.75 / 0.5e9), 1e-12);
  EXPECT_NEAR(plan(m, PlanOptions().param_dtype(Dtype::kBFloat16).constants(round_rates())).overhead_s, 0.03, 1e-12);
  // 2 ms more for a checkpointed stage, per micro-batch.
  Constants checkpointing = round_rates();
  checkpointing.checkpointed_stage_overhead_s = 2e-3;
  m.stages[0].checkpointed = true;
  EXPECT_NEAR(plan(m, PlanOptions().micro_batches(2).constants(checkpointing)).overhead_s, 2 * 0.012, 1e-12);
  m.stages[0].checkpointed = false;
  // Told the ranks run apart (--local-world 1 each), W=4 computes as W=1 does.
  EXPECT_NEAR(plan(m, PlanOptions().world(4).local_world(1).constants(round_rates())).compute_s, 0.3, 1e-12);
}

}  // namespace
