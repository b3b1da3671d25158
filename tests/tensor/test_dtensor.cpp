// DTensor across real processes: torch.chunk layouts, round trips, redistribution, 2-D meshes.
#include "harness/multiprocess.h"

#include <fsdp/distributed.h>
#include <fsdp/dtensor.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

using fsdp::Replicate;
using fsdp::Shard;
using fsdp::testing::run_distributed;

namespace {

// The same "random" tensor on every rank.
at::Tensor reference(std::vector<int64_t> shape) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
  return at::randn(shape, gen);
}

}  // namespace

TEST(DTensor, ChunkBoundsFollowTorchChunk) {
  // torch.chunk(arange(5), 4) -> sizes 2, 2, 1, 0
  EXPECT_EQ(fsdp::chunk_bounds(5, 4, 0).length, 2);
  EXPECT_EQ(fsdp::chunk_bounds(5, 4, 2).offset, 4);
  EXPECT_EQ(fsdp::chunk_bounds(5, 4, 2).length, 1);
  EXPECT_EQ(fsdp::chunk_bounds(5, 4, 3).length, 0);
  EXPECT_EQ(fsdp::chunk_bounds(5, 4, 3).offset, 5);
  // torch.chunk(arange(6), 4) -> 2, 2, 2, 0
  EXPECT_EQ(fsdp::chunk_bounds(6, 4, 2).length, 2);
  EXPECT_EQ(fsdp::chunk_bounds(6, 4, 3).length, 0);
  EXPECT_EQ(fsdp::chunk_bounds(1, 3, 0).length, 1);
  EXPECT_EQ(fsdp::chunk_bounds(1, 3, 1).length, 0);
}

TEST(DTensor, RoundTripForDim0SmallerEqualAndNotDivisible) {
  for (int world : {1, 2, 3, 4}) {
    run_distributed(world, [] {
      const int W = fsdp::get_world_size(), r = fsdp::get_rank();
      auto mesh = fsdp::init_device_mesh("cpu", {W});
      for (int64_t rows : {int64_t(W - 1), int64_t(W), int64_t(W + 1), int64_t(2 * W + 1), int64_t(7)}) {
        if (rows == 0) continue;
        at::Tensor full = reference({rows, 3});
        auto d = fsdp::distribute_tensor(full, mesh, {Shard(0)});
        const auto b = fsdp::chunk_bounds(rows, W, r);
        EXPECT_EQ(d.to_local().sizes(), (std::vector<int64_t>{b.length, 3})) << "rows=" << rows;
        EXPECT_TRUE(d.to_local().equal(full.narrow(0, b.offset, b.length)));
        EXPECT_EQ(d.sizes(), (std::vector<int64_t>{rows, 3}));
        EXPECT_EQ(d.placements()[0], Shard(0));
        EXPECT_TRUE(d.full_tensor().equal(full)) << "rows=" << rows;

        // Shard along dim 1 too.
        auto c = fsdp::distribute_tensor(full.t().contiguous(), mesh, {Shard(1)});
        EXPECT_TRUE(c.full_tensor().equal(full.t())) << "dim 1, rows=" << rows;
      }
    });
  }
}

TEST(DTensor, RedistributeBetweenShardAndReplicate) {
  for (int world : {2, 3}) {
    run_distributed(world, [] {
      const int W = fsdp::get_world_size(), r = fsdp::get_rank();
      auto mesh = fsdp::init_device_mesh("cpu", {W}, {"dp"});
      at::Tensor full = reference({2 * W + 1, 4});
      auto sharded = fsdp::distribute_tensor(full, mesh, {Shard(0)});
      auto replicated = sharded.redistribute({Replicate()});
      EXPECT_TRUE(replicated.to_local().equal(full));
      EXPECT_EQ(replicated.placements()[0], Replicate());
      auto back = replicated.redistribute({Shard(0)});
      EXPECT_TRUE(back.to_local().equal(sharded.to_local()));
      auto other_dim = sharded.redistribute({Shard(1)});
      const auto b = fsdp::chunk_bounds(4, W, r);
      EXPECT_TRUE(other_dim.to_local().equal(full.narrow(1, b.offset, b.length)));
      EXPECT_TRUE(other_dim.full_tensor().equal(full));
    });
  }
}

TEST(DTensor, FromLocalEvenAndWithGlobalShape) {
  run_distributed(3, [] {
    const int r = fsdp::get_rank();
    auto mesh = fsdp::init_device_mesh("cpu", {3});
    auto even = fsdp::DTensor::from_local(at::full({2, 2}, static_cast<float>(r)), mesh, {Shard(0)});
    EXPECT_EQ(even.sizes(), (std::vector<int64_t>{6, 2}));
    EXPECT_TRUE(even.full_tensor().equal(at::arange(3, at::kFloat).repeat_interleave(2).view({6, 1}).expand({6, 2})));
    // 5 rows over 3 ranks: 2, 2, 1.
    const auto b = fsdp::chunk_bounds(5, 3, r);
    at::Tensor full = reference({5, 2});
    auto uneven = fsdp::DTensor::from_local(full.narrow(0, b.offset, b.length).clone(), mesh, {Shard(0)},
                                            std::vector<int64_t>{5, 2});
    EXPECT_TRUE(uneven.full_tensor().equal(full));
    EXPECT_THROW(fsdp::DTensor::from_local(at::zeros({4, 2}), mesh, {Shard(0)}, std::vector<int64_t>{5, 2}),
                 c10::Error);
  });
}

TEST(DTensor, SourceRankDataIsUsed) {
  run_distributed(3, [] {
    const int r = fsdp::get_rank();
    auto mesh = fsdp::init_device_mesh("cpu", {3});
    at::Tensor full = reference({4, 2});
    at::Tensor mine = r == 1 ? full : at::zeros({4, 2});  // only mesh rank 1 has the data
    auto d = fsdp::distribute_tensor(mine, mesh, {Shard(0)}, /*src_data_rank=*/1);
    EXPECT_TRUE(d.full_tensor().equal(full));
    if (r != 1) {
      EXPECT_TRUE(mine.equal(at::zeros({4, 2})));  // the caller's tensor is untouched
    }
  });
}

TEST(DTensor, TwoDimensionalMesh) {
  run_distributed(4, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {2, 2}, {"replicate", "shard"});
    const auto coord = mesh.coordinate();
    at::Tensor full = reference({5, 6});
    // HSDP layout: replicated across rows, sharded within a row.
    auto hsdp = fsdp::distribute_tensor(full, mesh, {Replicate(), Shard(0)});
    const auto b = fsdp::chunk_bounds(5, 2, coord[1]);
    EXPECT_TRUE(hsdp.to_local().equal(full.narrow(0, b.offset, b.length)));
    EXPECT_TRUE(hsdp.full_tensor().equal(full));
    // Two tensor dims over two mesh dims.
    auto grid = fsdp::distribute_tensor(full, mesh, {Shard(0), Shard(1)});
    const auto b0 = fsdp::chunk_bounds(5, 2, coord[0]);
    const auto b1 = fsdp::chunk_bounds(6, 2, coord[1]);
    EXPECT_TRUE(grid.to_local().equal(full.narrow(0, b0.offset, b0.length).narrow(1, b1.offset, b1.length)));
    EXPECT_TRUE(grid.full_tensor().equal(full));
    // Nested: dim 0 split over both mesh dims (7 rows: 4 | 3, then halves of those).
    at::Tensor tall = reference({7, 2});
    auto nested = fsdp::distribute_tensor(tall, mesh, {Shard(0), Shard(0)});
    EXPECT_TRUE(nested.full_tensor().equal(tall));
    EXPECT_TRUE(nested.redistribute({Replicate(), Shard(0)}).full_tensor().equal(tall));
  });
}
