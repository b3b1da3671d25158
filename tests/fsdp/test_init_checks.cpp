// What fully_shard and the first forward refuse, each named by its message: parameters FSDP
// cannot shard (0-dim, not owning a contiguous storage), applying it twice, tied parameters in
// two groups, a child's forward before the root's first one, and a module->to(dtype) after
// fully_shard that leaves one group in two dtypes (converting before fully_shard trains).
#include "harness/multiprocess.h"

#include <fsdp/call.h>
#include <fsdp/distributed.h>
#include <fsdp/dtensor.h>
#include <fsdp/fully_shard.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <functional>
#include <string>
#include <vector>

using fsdp::testing::run_distributed;

namespace {

// Runs `f`, which must throw a c10::Error whose message contains every one of `parts`.
void expect_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "expected an error containing '" << parts.front() << "'";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    for (const auto& part : parts) EXPECT_NE(msg.find(part), std::string::npos) << "'" << part << "' not in: " << msg;
  }
}

struct WithParamImpl : torch::nn::Module {
  explicit WithParamImpl(const at::Tensor& p) { w = register_parameter("w", p); }
  at::Tensor forward(const at::Tensor& x) { return x * w.sum(); }
  at::Tensor w;
};
TORCH_MODULE(WithParam);

// Two layers and a head, each layer its own FSDP module under the root.
struct StackImpl : torch::nn::Module {
  StackImpl() {
    torch::manual_seed(2);
    l0 = register_module("l0", torch::nn::Linear(6, 6));
    l1 = register_module("l1", torch::nn::Linear(6, 6));
    head = register_module("head", torch::nn::Linear(6, 1));
  }
  at::Tensor forward(const at::Tensor& x) {
    return fsdp::call(head, at::tanh(fsdp::call(l1, at::tanh(fsdp::call(l0, x)))));
  }
  torch::nn::Linear l0{nullptr}, l1{nullptr}, head{nullptr};
};
TORCH_MODULE(Stack);

void shard(Stack& m, const fsdp::DeviceMesh& mesh) {
  auto opts = fsdp::FullyShardOptions().mesh(mesh);
  fsdp::fully_shard(m->l0, opts);
  fsdp::fully_shard(m->l1, opts);
  fsdp::fully_shard(m, opts);
}

// b's weight is a's (tied): b computes x @ a.weight^T.
struct SharedWeightImpl : torch::nn::Module {
  explicit SharedWeightImpl(const at::Tensor& shared) { weight = register_parameter("weight", shared); }
  at::Tensor forward(const at::Tensor& x) { return x.matmul(weight.t()); }
  at::Tensor weight;
};
TORCH_MODULE(SharedWeight);

struct TiedImpl : torch::nn::Module {
  TiedImpl() {
    torch::manual_seed(4);
    a = register_module("a", torch::nn::Linear(6, 6));
    b = register_module("b", SharedWeight(a->weight));
    head = register_module("head", torch::nn::Linear(6, 1));
  }
  at::Tensor forward(const at::Tensor& x) {
    return fsdp::call(head, at::tanh(fsdp::call(b, at::tanh(fsdp::call(a, x)))));
  }
  torch::nn::Linear a{nullptr};
  SharedWeight b{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Tied);

at::Tensor batch(int64_t step, int64_t rows) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(40 + step);
  return at::randn({rows, 6}, gen);
}

template <typename Model>
at::Tensor loss_of(Model& m, const at::Tensor& x) {
  return (fsdp::call(m, x) - x.sum(1, true)).pow(2).mean();
}

}  // namespace

TEST(InitChecks, ParametersFsdpCannotShardAreRefusedByName) {
  run_distributed(2, [] {
    auto opts = fsdp::FullyShardOptions().mesh(fsdp::init_device_mesh("cpu", {2}));
    expect_error([&] { fsdp::fully_shard(WithParam(at::ones({})), opts); },
                 {"parameter 'w' is a scalar (0-dim)", "Make it shape [1]"});
    expect_error(
        [&] {
          fsdp::fully_shard(WithParam(at::randn({4, 3}).t()), opts);
        },
        {"parameter 'w' does not own a contiguous storage", "clone()"});
    expect_error([&] { fsdp::fully_shard(WithParam(at::randn({8}).narrow(0, 2, 4)), opts); },
                 {"parameter 'w' does not own a contiguous storage"});
    expect_error(
        [&] {
          fsdp::fully_shard(WithParam(at::empty({4, 3}, at::TensorOptions().device(at::kMeta))), opts);
        },
        {"parameter 'w' is on the meta device", "not supported yet", "to_empty()"});
    // A refused call leaves the module unmanaged: a fixed parameter then shards.
    WithParam m(at::ones({}));
    expect_error([&] { fsdp::fully_shard(m, opts); }, {"0-dim"});
    EXPECT_FALSE(fsdp::is_fsdp_module(*m));
  });
}

TEST(InitChecks, ApplyingFullyShardTwiceIsRefused) {
  run_distributed(1, [] {
    torch::nn::Linear lin(3, 3);
    fsdp::fully_shard(lin);
    expect_error([&] { fsdp::fully_shard(lin); }, {"fully_shard was already applied", "apply it once per module"});
  });
}

// A parameter tied between two modules must be in one group: sharding them in two calls is
// refused at the second; one call for both trains like the unsharded tied model.
TEST(InitChecks, TiedParametersInTwoGroupsAreRefusedAndTrainInOne) {
  for (int world : {1, 2, 3}) {
    run_distributed(world, [] {
      const int64_t W = fsdp::get_world_size(), r = fsdp::get_rank();
      auto mesh = fsdp::init_device_mesh("cpu", {W});
      auto opts = fsdp::FullyShardOptions().mesh(mesh);
      {
        Tied m;
        fsdp::fully_shard(m->a, opts);
        expect_error([&] { fsdp::fully_shard(m->b, opts); },
                     {"parameter 'weight' is shared with a parameter already managed by another FSDP group",
                      "fully_shard({module_a, module_b})"});
      }
      Tied model, ref;
      fsdp::fully_shard(std::vector<std::shared_ptr<torch::nn::Module>>{model->a.ptr(), model->b.ptr()}, opts);
      fsdp::fully_shard(model, opts);
      EXPECT_TRUE(model->a->named_parameters()["weight"].is_same(model->b->named_parameters()["weight"]))
          << "one shard, registered in both modules";
      EXPECT_EQ(model->parameters().size(), ref->parameters().size());
      torch::optim::Adam opt(model->parameters(), 1e-2), ref_opt(ref->parameters(), 1e-2);
      for (int64_t step = 0; step < 3; ++step) {
        const at::Tensor global = batch(step, 2 * W);
        opt.zero_grad();
        ref_opt.zero_grad();
        loss_of(model, global.slice(0, 2 * r, 2 * r + 2)).backward();
        loss_of(ref, global).backward();
        opt.step();
        ref_opt.step();
      }
      auto ref_params = ref->named_parameters();
      for (const auto& item : model->named_parameters()) {
        const at::Tensor full = fsdp::as_dtensor(item.value()).full_tensor();
        EXPECT_LT((full - ref_params[item.key()]).abs().max().item<double>(), 1e-5) << item.key();
      }
    });
  }
}

TEST(InitChecks, AChildsForwardBeforeTheRootsFirstForwardIsRefused) {
  run_distributed(2, [] {
    Stack m;
    shard(m, fsdp::init_device_mesh("cpu", {2}));
    fsdp::call(m->l0, batch(0, 2));  // l0 becomes a root of its own
    expect_error([&] { fsdp::call(m, batch(0, 2)); }, {"FSDP module 'l0' was already initialised as a root of its own",
                                                       "Run the first forward through the root module"});
  });
}

// Converting after fully_shard is supported (test_to_dtype.cpp); a conversion that leaves one
// group in two dtypes is refused at its next unshard or forward, naming the parameters; converting
// before fully_shard trains in that dtype.
TEST(InitChecks, APartOfAGroupConvertedIsRefusedAndConvertingBeforeFullyShardTrainsInThatDtype) {
  for (int world : {1, 2, 3, 4}) {
    run_distributed(world, [] {
      const int64_t W = fsdp::get_world_size(), r = fsdp::get_rank();
      auto mesh = fsdp::init_device_mesh("cpu", {W});
      const std::vector<std::string> what = {"FSDP expects one dtype for the parameters of FSDP module '(root)'",
                                             "Convert the whole FSDP module"};
      {
        Stack m;
        fsdp::fully_shard(m, fsdp::FullyShardOptions().mesh(mesh));  // one group
        m->l1->to(at::kDouble);
        auto parts = what;
        parts.push_back("'l1.weight' (Double), 'l1.bias' (Double), 'head.weight' (Float)");
        expect_error([&] { fsdp::get_fsdp_module(*m).unshard(); }, parts);
        expect_error([&] { fsdp::call(m, batch(1, 2)); }, what);
      }
      // Converted before fully_shard: trains in fp64, like the fp64 unsharded model.
      Stack model, ref;
      model->to(at::kDouble);
      ref->to(at::kDouble);
      shard(model, mesh);
      torch::optim::Adam opt(model->parameters(), 1e-2), ref_opt(ref->parameters(), 1e-2);
      for (int64_t step = 0; step < 3; ++step) {
        const at::Tensor global = batch(step, 2 * W).to(at::kDouble);
        opt.zero_grad();
        ref_opt.zero_grad();
        loss_of(model, global.slice(0, 2 * r, 2 * r + 2)).backward();
        loss_of(ref, global).backward();
        opt.step();
        ref_opt.step();
      }
      auto ref_params = ref->named_parameters();
      for (const auto& item : model->named_parameters()) {
        EXPECT_EQ(item.value().scalar_type(), at::kDouble) << item.key();
        EXPECT_EQ(item.value().grad().scalar_type(), at::kDouble) << item.key();
        const at::Tensor full = fsdp::as_dtensor(item.value()).full_tensor();
        EXPECT_LT((full - ref_params[item.key()]).abs().max().item<double>(), 1e-12) << item.key();
      }
    });
  }
}
