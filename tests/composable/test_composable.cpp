// The composable registry (src/composable/registry.h): which API manages a module and a
// parameter, and how long its answers last. fully_shard and replicate ask it about each other
// (test_replicate.cpp, test_fully_shard.cpp); here its rules, in one process.
#include "src/composable/registry.h"

#include <fsdp/call.h>

#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include <memory>

namespace {

using fsdp::composable::Api;
using fsdp::composable::ParamRole;

// Counts the live states; shared, since the registry may release a state after its test ends.
struct CountingState : fsdp::composable::ModuleState {
  explicit CountingState(std::shared_ptr<int> alive) : alive(std::move(alive)) { ++*this->alive; }
  ~CountingState() override { --*alive; }
  std::shared_ptr<int> alive;
};

// A state whose forward hooks record the calls, as fully_shard's would run.
struct RecordingHooks : fsdp::composable::ModuleState, fsdp::detail::ForwardHooks {
  fsdp::detail::ForwardHooks* forward_hooks() override { return this; }
  std::vector<at::Tensor> pre_forward(const torch::nn::Module&, std::vector<at::Tensor> inputs) override {
    calls.push_back("pre");
    return inputs;
  }
  void post_forward(const torch::nn::Module&, std::vector<at::Tensor>& outputs) override {
    calls.push_back("post");
    outputs[0] = outputs[0] * 2;
  }
  void rethrow_forward_error() override {
    calls.push_back("error");
    throw;
  }
  std::vector<std::string> calls;
};

TEST(Composable, ModuleAndParametersAnswerWithTheirApi) {
  auto alive = std::make_shared<int>(0);
  auto linear = torch::nn::Linear(3, 2);
  auto state = std::make_shared<CountingState>(alive);
  fsdp::composable::register_modules(Api::kReplicate, {linear.ptr()}, state);
  fsdp::composable::register_parameters(state, {{linear->weight, ParamRole::kReplicated, 0}});

  auto managed = fsdp::composable::managed_module(*linear);
  ASSERT_TRUE(managed.has_value());
  EXPECT_EQ(managed->api, Api::kReplicate);
  EXPECT_EQ(managed->state, state);
  EXPECT_EQ(fsdp::composable::state_of(*linear, Api::kReplicate), state);
  EXPECT_EQ(fsdp::composable::state_of(*linear, Api::kFullyShard), nullptr);

  auto param = fsdp::composable::managed_parameter(linear->weight);
  ASSERT_TRUE(param.has_value());
  EXPECT_EQ(param->api, Api::kReplicate);
  EXPECT_EQ(param->role, ParamRole::kReplicated);
  EXPECT_EQ(param->slot, 0);
  EXPECT_FALSE(fsdp::composable::managed_parameter(linear->bias).has_value());
  EXPECT_FALSE(fsdp::composable::managed_parameter(at::Tensor()).has_value());
}

TEST(Composable, ASecondApiOnTheSameModuleIsAProgrammingError) {
  auto alive = std::make_shared<int>(0);
  auto linear = torch::nn::Linear(3, 2);
  fsdp::composable::register_modules(Api::kReplicate, {linear.ptr()}, std::make_shared<CountingState>(alive));
  try {
    fsdp::composable::register_modules(Api::kFullyShard, {linear.ptr()}, std::make_shared<CountingState>(alive));
    FAIL() << "a module registered twice";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("already managed by replicate"), std::string::npos) << e.what();
  }
}

TEST(Composable, AStateLivesAsLongAsItsModuleAndItsTensorsAnswerNoLonger) {
  auto alive = std::make_shared<int>(0);
  auto linear = torch::nn::Linear(3, 2);
  at::Tensor weight = linear->weight;  // outlives the module
  int64_t id = -1;
  {
    auto state = std::make_shared<CountingState>(alive);
    id = state->id();
    fsdp::composable::register_modules(Api::kFullyShard, {linear.ptr()}, state);
    fsdp::composable::register_parameters(state, {{weight, ParamRole::kSharded, 0}});
  }
  EXPECT_EQ(*alive, 1) << "the registry keeps the state while its module lives";
  ASSERT_TRUE(fsdp::composable::find_state_by_id(id).has_value());
  EXPECT_TRUE(fsdp::composable::managed_parameter(weight).has_value());

  linear = nullptr;  // the module goes
  EXPECT_FALSE(fsdp::composable::managed_parameter(weight).has_value())
      << "a tensor of a dead module is no longer managed";
  // The next registration drops the dead module's entry and releases its state.
  auto other = torch::nn::Linear(2, 2);
  fsdp::composable::register_modules(Api::kReplicate, {other.ptr()}, std::make_shared<CountingState>(alive));
  EXPECT_EQ(*alive, 1) << "the dead module's state went; the new one lives";
  EXPECT_FALSE(fsdp::composable::find_state_by_id(id).has_value());
}

TEST(Composable, AReusedAddressIsNotTheDeadModule) {
  auto alive = std::make_shared<int>(0);
  auto first = std::make_shared<torch::nn::LinearImpl>(3, 2);
  const torch::nn::Module* address = first.get();
  fsdp::composable::register_modules(Api::kFullyShard, {first}, std::make_shared<CountingState>(alive));
  first.reset();
  // Whether or not the allocator hands the same address out again, no new module is managed.
  bool reused = false;
  for (int i = 0; i < 16; ++i) {
    auto next = std::make_shared<torch::nn::LinearImpl>(3, 2);
    reused = reused || next.get() == address;
    EXPECT_FALSE(fsdp::composable::managed_module(*next).has_value()) << (next.get() == address ? "reused" : "new");
  }
  // A lookup that met the dead entry released its state; otherwise the next registration does.
  if (reused) {
    EXPECT_EQ(*alive, 0) << "the lookup that met the dead entry released its state";
  }
  auto other = std::make_shared<torch::nn::LinearImpl>(3, 2);
  fsdp::composable::register_modules(Api::kReplicate, {other}, std::make_shared<CountingState>(alive));
  EXPECT_EQ(*alive, 1) << "registering dropped the dead module's state; only the new one lives";
}

TEST(Composable, TheHookPointRunsTheHooksOfAManagedModuleOnly) {
  auto hooked = torch::nn::Linear(3, 2);
  auto plain = torch::nn::Linear(3, 2);
  auto hooks = std::make_shared<RecordingHooks>();
  fsdp::composable::register_modules(Api::kFullyShard, {hooked.ptr()}, hooks);
  at::Tensor x = at::ones({1, 3});

  at::Tensor y = fsdp::call(hooked, x);
  EXPECT_EQ(hooks->calls, (std::vector<std::string>{"pre", "post"}));
  EXPECT_TRUE(y.equal(hooked->forward(x) * 2)) << "post_forward's replacement is what the caller gets";
  EXPECT_TRUE(fsdp::call(plain, x).equal(plain->forward(x))) << "an unmanaged module runs its forward as is";

  EXPECT_THROW(fsdp::call(hooked, at::ones({1, 5})), c10::Error);  // a shape error in forward
  EXPECT_EQ(hooks->calls.back(), "error");
}

}  // namespace
