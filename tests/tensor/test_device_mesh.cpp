// DeviceMesh across real processes: layout, sub-meshes, and groups that talk only within their dim.
#include "harness/multiprocess.h"

#include <fsdp/device_mesh.h>
#include <fsdp/distributed.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

using fsdp::CollectiveKind;
using fsdp::testing::run_distributed;

TEST(DeviceMesh, OneDimensional) {
  for (int world : {1, 2, 3, 4}) {
    run_distributed(world, [] {
      const int W = fsdp::get_world_size(), r = fsdp::get_rank();
      auto mesh = fsdp::init_device_mesh("cpu", {W}, {"dp"});
      EXPECT_EQ(mesh.ndim(), 1);
      EXPECT_EQ(mesh.size(), W);
      EXPECT_EQ(mesh.coordinate(), std::vector<int64_t>{r});
      EXPECT_EQ(mesh.get_local_rank("dp"), r);
      auto g = mesh.get_group("dp");
      EXPECT_EQ(g->size(), W);
      EXPECT_EQ(g->rank(), r);
      at::Tensor t = at::full({5}, static_cast<float>(r));
      g->all_reduce(t)->wait();
      EXPECT_TRUE(t.equal(at::full({5}, W * (W - 1) / 2.0f)));
      EXPECT_EQ(mesh["dp"], mesh);
    });
  }
}

TEST(DeviceMesh, TwoDimensionalGroupsStayWithinTheirDim) {
  run_distributed(4, [] {
    const int r = fsdp::get_rank();
    auto mesh = fsdp::init_device_mesh("cpu", {2, 2}, {"replicate", "shard"});
    // Row-major: rank = 2 * replicate + shard.
    const std::vector<int64_t> coord = {r / 2, r % 2};
    EXPECT_EQ(mesh.coordinate(), coord);
    EXPECT_TRUE(mesh.mesh().equal(at::arange(4, at::kLong).view({2, 2})));

    auto shard = mesh.get_group("shard");          // {0,1} or {2,3}
    auto replicate = mesh.get_group("replicate");  // {0,2} or {1,3}
    EXPECT_EQ(shard->global_ranks(), (std::vector<int>{2 * (r / 2), 2 * (r / 2) + 1}));
    EXPECT_EQ(replicate->global_ranks(), (std::vector<int>{r % 2, r % 2 + 2}));
    EXPECT_EQ(shard->rank(), r % 2);
    EXPECT_EQ(replicate->rank(), r / 2);

    // Each rank contributes 10^rank: a sum shows exactly which ranks took part.
    at::Tensor s = at::full({3}, std::pow(10.0, r), at::kDouble);
    shard->all_reduce(s)->wait();
    const double row = std::pow(10.0, 2 * (r / 2)) + std::pow(10.0, 2 * (r / 2) + 1);
    EXPECT_TRUE(s.equal(at::full({3}, row, at::kDouble)));

    at::Tensor c = at::full({3}, std::pow(10.0, r), at::kDouble);
    replicate->all_reduce(c)->wait();
    const double col = std::pow(10.0, r % 2) + std::pow(10.0, r % 2 + 2);
    EXPECT_TRUE(c.equal(at::full({3}, col, at::kDouble)));

    // Each group counted only its own traffic.
    EXPECT_EQ(shard->stats()[CollectiveKind::kAllReduce].calls, 1);
    EXPECT_EQ(replicate->stats()[CollectiveKind::kAllReduce].calls, 1);
    EXPECT_EQ(fsdp::world()->stats().total_calls(), 0);

    // Sub-meshes share the groups.
    auto sub = mesh["shard"];
    EXPECT_EQ(sub.ndim(), 1);
    EXPECT_EQ(sub.size(), 2);
    EXPECT_EQ(sub.coordinate(), std::vector<int64_t>{r % 2});
    EXPECT_EQ(sub.get_group(0).get(), shard.get());
    EXPECT_TRUE(sub.mesh().equal(at::tensor(std::vector<int64_t>{2 * (r / 2), 2 * (r / 2) + 1}, at::kLong)));
  });
}

TEST(DeviceMesh, BadArgumentsSayWhatIsWrong) {
  run_distributed(2, [] {
    auto expect_error = [](const std::function<void()>& f, const std::string& needle) {
      try {
        f();
        ADD_FAILURE() << "expected an error containing '" << needle << "'";
      } catch (const c10::Error& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      }
    };
    expect_error([] { fsdp::init_device_mesh("cpu", {3}); }, "the world has 2");
    expect_error([] { fsdp::init_device_mesh("cuda", {2}); }, "cuda");
    expect_error([] { fsdp::init_device_mesh("cpu", {2}, {"a", "b"}); }, "dim names");
    auto mesh = fsdp::init_device_mesh("cpu", {1, 2}, {"rep", "shard"});
    expect_error([&] { mesh["nope"]; }, "'rep', 'shard'");
  });
}
