// The buffer layouts of fully_shard's collectives (src/fsdp/collectives.h), checked in one
// process: every rank's records are built side by side and the collectives are played by
// concatenating the ranks' buffers.
#include "src/fsdp/collectives.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <vector>

using fsdp::detail::AllGatherResult;
using fsdp::detail::FSDPParam;
using fsdp::detail::FSDPParams;
using fsdp::detail::RankMajorLayout;
using fsdp::detail::ReducedParams;
using fsdp::detail::ReduceScatterResult;

const fsdp::detail::GroupDevices kOnCpu{c10::Device(c10::kCPU), c10::Device(c10::kCPU), false, false};

namespace {

constexpr int64_t kWorld = 4;

// weight (5, 3) and bias (3): over 4 ranks the rows are 2, 2, 1, 0 and 1, 1, 1, 0, so the
// pieces are 6 and 1 elements and ranks 2 and 3 carry padding.
struct Model {
  at::Tensor weight = at::arange(15, at::kFloat).reshape({5, 3}) + 1;
  at::Tensor bias = at::arange(3, at::kFloat) + 100;
};

// The records of rank `rank`, over copies of the model's tensors.
FSDPParams params_of(const Model& m, int64_t rank) {
  FSDPParams params;
  params.push_back(std::make_unique<FSDPParam>("weight", m.weight.clone().set_requires_grad(true), kWorld, rank));
  params.push_back(std::make_unique<FSDPParam>("bias", m.bias.clone().set_requires_grad(true), kWorld, rank));
  return params;
}

std::vector<float> values(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}

// What an all-gather over the ranks returns: their flat shards, rank after rank.
at::Tensor gathered_flat_shards(const Model& m, const RankMajorLayout& layout, std::vector<FSDPParams>* keep) {
  std::vector<at::Tensor> rows;
  for (int64_t r = 0; r < kWorld; ++r) {
    keep->push_back(params_of(m, r));
    rows.push_back(fsdp::detail::init_flat_shard(keep->back(), layout));
  }
  return at::cat(rows);
}

}  // namespace

TEST(FsdpCollectives, ShardLayoutIsRankMajorOverPaddedPieces) {
  Model m;
  FSDPParams params = params_of(m, 0);
  const RankMajorLayout layout = fsdp::detail::shard_layout(params, kWorld);
  EXPECT_EQ(layout.parts, kWorld);
  EXPECT_EQ(layout.piece_numel, (std::vector<int64_t>{6, 1}));
  EXPECT_EQ(layout.offset, (std::vector<int64_t>{0, 6}));
  EXPECT_EQ(layout.row_numel, 7);
  EXPECT_EQ(layout.numel(), 28);

  // reshard_after_forward = 2: each of 2 ranks keeps half of every padded unsharded parameter.
  const RankMajorLayout half = fsdp::detail::post_forward_layout(params, 2);
  EXPECT_EQ(half.parts, 2);
  EXPECT_EQ(half.piece_numel, (std::vector<int64_t>{12, 2}));
  EXPECT_EQ(half.offset, (std::vector<int64_t>{0, 12}));
  EXPECT_EQ(half.row_numel, 14);
}

TEST(FsdpCollectives, FlatShardHoldsThisRanksRowsThenZeros) {
  Model m;
  const std::vector<std::vector<float>> expected = {
      {1, 2, 3, 4, 5, 6, 100},     // rank 0: weight rows 0-1, bias[0]
      {7, 8, 9, 10, 11, 12, 101},  // rank 1: weight rows 2-3, bias[1]
      {13, 14, 15, 0, 0, 0, 102},  // rank 2: weight row 4 and a padding row, bias[2]
      {0, 0, 0, 0, 0, 0, 0},       // rank 3: nothing real
  };
  const std::vector<std::vector<int64_t>> weight_shapes = {{2, 3}, {2, 3}, {1, 3}, {0, 3}};
  for (int64_t r = 0; r < kWorld; ++r) {
    FSDPParams params = params_of(m, r);
    const RankMajorLayout layout = fsdp::detail::shard_layout(params, kWorld);
    at::Tensor flat = fsdp::detail::init_flat_shard(params, layout);
    EXPECT_EQ(values(flat), expected[r]) << "rank " << r;
    // The leaves are views of the flat shard without the padding.
    EXPECT_EQ(params[0]->sharded().sizes().vec(), weight_shapes[r]) << "rank " << r;
    if (r < 3) {  // an empty view has no data pointer
      EXPECT_EQ(params[0]->sharded().data_ptr(), flat.data_ptr());
    }
    EXPECT_TRUE(params[0]->sharded().requires_grad());
  }
}

TEST(FsdpCollectives, AllGatherCopyOutRestoresEveryParameter) {
  Model m;
  FSDPParams params = params_of(m, 1);
  const RankMajorLayout layout = fsdp::detail::shard_layout(params, kWorld);
  fsdp::detail::init_flat_shard(params, layout);
  std::vector<FSDPParams> others;
  at::Tensor output = gathered_flat_shards(m, layout, &others);
  for (auto& p : params) {
    p->free_unsharded();
    p->alloc_unsharded();
  }
  const int64_t version = params[0]->unsharded()._version();
  fsdp::detail::foreach_all_gather_copy_out(AllGatherResult{nullptr, output, layout, std::nullopt, std::nullopt},
                                            params);
  EXPECT_TRUE(params[0]->unsharded().equal(m.weight));
  EXPECT_TRUE(params[1]->unsharded().equal(m.bias));
  EXPECT_EQ(params[0]->unsharded()._version(), version) << "autograd's saved views stay valid";
}

TEST(FsdpCollectives, PostForwardShardsGatherBackToTheParameters) {
  Model m;
  const int64_t k = 2;
  std::vector<FSDPParams> ranks;
  std::vector<at::Tensor> rows;
  for (int64_t j = 0; j < k; ++j) {  // the two ranks of one post-forward group, both unsharded
    ranks.push_back(params_of(m, j));
    for (auto& p : ranks.back()) {
      at::Tensor before = p->unsharded().clone();
      p->alloc_unsharded();  // padded_full_numel elements; the real data stays the prefix
      at::NoGradGuard no_grad;
      p->unsharded().copy_(before);
    }
    const RankMajorLayout half = fsdp::detail::post_forward_layout(ranks.back(), k);
    rows.push_back(fsdp::detail::copy_post_forward_shard(ranks.back(), half, j));
  }
  EXPECT_EQ(rows[0].numel(), 14);
  FSDPParams& params = ranks[0];
  for (auto& p : params) {
    p->free_unsharded();
    p->alloc_unsharded();
  }
  const RankMajorLayout half = fsdp::detail::post_forward_layout(params, k);
  fsdp::detail::foreach_all_gather_copy_out(AllGatherResult{nullptr, at::cat(rows), half, std::nullopt, std::nullopt},
                                            params);
  EXPECT_TRUE(params[0]->unsharded().equal(m.weight));
  EXPECT_TRUE(params[1]->unsharded().equal(m.bias));
}

TEST(FsdpCollectives, ReduceScatterInputIsTheAllGatherLayoutOfTheGradients) {
  Model m;
  Model grads;  // gradients with the same values as the parameters: the layouts must agree
  FSDPParams params = params_of(m, 0);
  const RankMajorLayout layout = fsdp::detail::shard_layout(params, kWorld);
  const ReducedParams both{0, 1};
  EXPECT_EQ(fsdp::detail::reduce_scatter_layout(params, both, kWorld).offset, layout.offset);
  params[0]->unsharded().mutable_grad() = grads.weight.clone();
  params[1]->unsharded().mutable_grad() = grads.bias.clone();
  at::Tensor input = fsdp::detail::foreach_reduce_copy_in(params, both, layout, at::kFloat);

  std::vector<FSDPParams> others;
  EXPECT_EQ(values(input), values(gathered_flat_shards(m, layout, &others)));
  EXPECT_FALSE(params[0]->unsharded_grad().defined()) << "the unsharded gradients are released";
  EXPECT_FALSE(params[1]->unsharded_grad().defined());

  // A reduced parameter without a gradient (set_reduce_scatter_unused_params) sends zeros.
  params[0]->unsharded().mutable_grad() = grads.weight.clone();
  at::Tensor no_bias =
      fsdp::detail::foreach_reduce_copy_in(params, both, layout, at::kFloat).reshape({kWorld, layout.row_numel});
  EXPECT_EQ(no_bias.select(1, 6).abs().sum().item<float>(), 0.0f);
  EXPECT_EQ(values(no_bias.slice(1, 0, 6).reshape({-1}).slice(0, 0, 15)), values(m.weight));
}

TEST(FsdpCollectives, ReduceScatterCarriesOnlyTheReducedParameters) {
  Model m;
  FSDPParams params = params_of(m, 0);
  const ReducedParams bias_only{1};
  const RankMajorLayout layout = fsdp::detail::reduce_scatter_layout(params, bias_only, kWorld);
  EXPECT_EQ(layout.piece_numel, (std::vector<int64_t>{1}));
  EXPECT_EQ(layout.offset, (std::vector<int64_t>{0}));
  EXPECT_EQ(layout.numel(), kWorld);
  params[1]->unsharded().mutable_grad() = m.bias.clone();
  at::Tensor input = fsdp::detail::foreach_reduce_copy_in(params, bias_only, layout, at::kFloat);
  EXPECT_EQ(values(input), (std::vector<float>{100, 101, 102, 0}));

  // The copy-out gives only the bias a gradient; the weight keeps none.
  fsdp::detail::init_flat_shard(params, fsdp::detail::shard_layout(params, kWorld));
  ReduceScatterResult result;
  result.output = at::full({1}, 7.0f);
  result.params = bias_only;
  result.layout = layout;
  fsdp::detail::foreach_reduce_copy_out(result, params, at::kFloat, kOnCpu);
  EXPECT_FALSE(params[0]->sharded().grad().defined());
  ASSERT_TRUE(params[1]->sharded().grad().defined());
  EXPECT_EQ(params[1]->sharded().grad().item<float>(), 7.0f);
}

TEST(FsdpCollectives, ReducedGradientsAreViewsWithoutPadding) {
  Model m;
  for (int64_t r : {0, 2, 3}) {
    FSDPParams params = params_of(m, r);
    const RankMajorLayout layout = fsdp::detail::shard_layout(params, kWorld);
    fsdp::detail::init_flat_shard(params, layout);
    at::Tensor reduced = at::arange(layout.row_numel, at::kFloat);
    ReduceScatterResult result;
    result.output = reduced;
    result.params = {0, 1};
    result.layout = layout;
    fsdp::detail::foreach_reduce_copy_out(result, params, at::kFloat, kOnCpu);
    const at::Tensor& wg = params[0]->sharded().grad();
    const at::Tensor& bg = params[1]->sharded().grad();
    ASSERT_TRUE(wg.defined() && bg.defined());
    EXPECT_EQ(wg.sizes(), params[0]->sharded().sizes()) << "rank " << r;
    const std::vector<float> all = values(reduced);
    EXPECT_EQ(values(wg), std::vector<float>(all.begin(), all.begin() + wg.numel()));
    EXPECT_EQ(bg.sizes(), params[1]->sharded().sizes());
    if (bg.numel() > 0) {
      EXPECT_EQ(bg.item<float>(), 6.0f);
    }
    if (wg.numel() > 0) {
      EXPECT_EQ(wg.data_ptr(), reduced.data_ptr()) << "shares the reduce-scatter output";
    }

    // A second reduction adds to the gradient already there.
    fsdp::detail::foreach_reduce_copy_out(result, params, at::kFloat, kOnCpu);
    if (bg.numel() > 0) {
      EXPECT_EQ(params[1]->sharded().grad().item<float>(), 12.0f);
    }
  }
}

// The copy-in lays out gradients of one dtype in one op (ATen's _chunk_cat) and falls back to a
// few copies per parameter for mixed dtypes or a missing gradient: both give the same buffer,
// cast to the reduce dtype, padded with zeros.
TEST(FsdpCollectives, ReduceScatterCopyInCastsAndPadsAlikeOnEveryPath) {
  Model m;
  FSDPParams params = params_of(m, 0);
  const RankMajorLayout layout = fsdp::detail::shard_layout(params, kWorld);
  const ReducedParams both{0, 1};
  std::vector<FSDPParams> others;
  const std::vector<float> expected = values(gathered_flat_shards(m, layout, &others));
  const std::vector<std::pair<at::ScalarType, at::ScalarType>> dtypes = {
      {at::kFloat, at::kFloat}, {at::kDouble, at::kDouble}, {at::kDouble, at::kFloat}};
  for (const auto& [weight_dtype, bias_dtype] : dtypes) {
    params[0]->unsharded().mutable_grad() = m.weight.to(weight_dtype);
    params[1]->unsharded().mutable_grad() = m.bias.to(bias_dtype);
    at::Tensor input = fsdp::detail::foreach_reduce_copy_in(params, both, layout, at::kFloat);
    EXPECT_EQ(values(input), expected) << weight_dtype << " and " << bias_dtype;
  }
  // Into a wider reduce dtype, as mixed precision reduces bf16 gradients in fp32.
  params[0]->unsharded().mutable_grad() = m.weight.to(at::kBFloat16);
  params[1]->unsharded().mutable_grad() = m.bias.to(at::kBFloat16);
  at::Tensor wide = fsdp::detail::foreach_reduce_copy_in(params, both, layout, at::kDouble);
  EXPECT_EQ(wide.scalar_type(), at::kDouble);
  EXPECT_EQ(values(wide.to(at::kFloat)), expected);
}
