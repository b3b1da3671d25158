// LibTorch's containers under fully_shard: a torch::nn::Sequential of sharded children called
// through fsdp::call (each child gets its hooks), ModuleList and ModuleDict elements called
// through fsdp::call by typed pointer, fully_shard refusing the containers that have no forward,
// and a parent calling a non-forward method of an FSDP child through fsdp::call_method. Each
// trains in step with single-process training on the global batch.
#include "harness/multiprocess.h"
#include "parity_training.h"

#include <fsdp/call.h>
#include <fsdp/distributed.h>
#include <fsdp/fully_shard.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <string>
#include <utility>
#include <vector>

using fsdp::testing::expect_training_parity;
using fsdp::testing::run_distributed;

namespace {

// A Sequential that can be a child of another (LibTorch needs a non-templated forward there).
struct StackImpl : torch::nn::SequentialImpl {
  using SequentialImpl::SequentialImpl;
  at::Tensor forward(at::Tensor x) { return fsdp::sequential_forward(*this, x); }
};
TORCH_MODULE(Stack);

// Linear, ReLU, a Stack (Linear, Tanh), Linear: dims that do not divide W = 2.
torch::nn::Sequential make_sequential() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(5, 7), torch::nn::ReLU(),
                               Stack(torch::nn::Linear(7, 7), torch::nn::Tanh()), torch::nn::Linear(7, 1));
}

// Every Linear of the tree its own FSDP module, then the Sequential as the root.
void shard_sequential(const torch::nn::Sequential& seq) {
  for (const auto& m : seq->modules(/*include_self=*/false)) {
    if (m->as<torch::nn::Linear>() != nullptr) fsdp::fully_shard(m);
  }
  fsdp::fully_shard(seq);
}

}  // namespace

TEST(Containers, SequentialOfShardedChildrenMatchesSingleProcess) {
  for (int world : {1, 2, 3, 4}) {
    run_distributed(world, [] {
      torch::nn::Sequential reference = make_sequential();
      torch::nn::Sequential model = make_sequential();
      shard_sequential(model);
      auto forward = [](torch::nn::Module& m, const at::Tensor& x) {
        auto seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(m.shared_from_this());
        return fsdp::call(seq, x);  // the shared_ptr form; the holder form is below
      };
      expect_training_parity(reference.ptr(), model.ptr(), forward, "sequential");
      // The holder form, and ReturnType as in Sequential::forward<ReturnType>.
      at::Tensor x = at::ones({2, 5});
      EXPECT_TRUE(fsdp::call(model, x).equal(fsdp::call<at::Tensor>(model, x)));
      EXPECT_TRUE(fsdp::call(model, x).allclose(reference->forward(x), 1e-5, 1e-6));
      try {
        fsdp::call<std::vector<at::Tensor>>(model, x);
        ADD_FAILURE() << "expected the return type to be refused";
      } catch (const c10::Error& e) {
        EXPECT_NE(std::string(e.what()).find("but you asked for type"), std::string::npos) << e.what();
      }
    });
  }
}

TEST(Containers, SequentialWithoutFsdpCallsItsChildrenAsForwardDoes) {
  torch::nn::Sequential seq = make_sequential();
  at::Tensor x = at::randn({3, 5});
  EXPECT_TRUE(fsdp::call(seq, x).equal(seq->forward(x)));
  torch::nn::Sequential empty;
  EXPECT_THROW(fsdp::call(empty, x), c10::Error);
}

namespace {

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t in, int64_t out) { lin = register_module("lin", torch::nn::Linear(in, out)); }
  at::Tensor forward(const at::Tensor& x) { return at::tanh(lin->forward(x)); }
  torch::nn::Linear lin{nullptr};
};
TORCH_MODULE(Block);

// Blocks in a ModuleList (called by index in both pointer forms) and heads in a ModuleDict.
struct ListNetImpl : torch::nn::Module {
  ListNetImpl() {
    blocks = register_module("blocks", torch::nn::ModuleList(Block(5, 7), Block(7, 7), Block(7, 3)));
    heads = register_module("heads", torch::nn::ModuleDict(std::vector<std::pair<std::string, std::shared_ptr<Module>>>{
                                         {"main", Block(3, 1).ptr()}}));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = fsdp::call(blocks->ptr<BlockImpl>(0), x);
    for (size_t i = 1; i < blocks->size(); ++i) h = fsdp::call(blocks[i]->as<BlockImpl>(), h);
    return fsdp::call(heads["main"]->as<BlockImpl>(), h);
  }
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::ModuleDict heads{nullptr};
};
TORCH_MODULE(ListNet);

ListNet make_list_net() {
  torch::manual_seed(0);
  return ListNet();
}

}  // namespace

TEST(Containers, ModuleListAndModuleDictElementsMatchSingleProcess) {
  for (int world : {1, 2, 3}) {
    run_distributed(world, [] {
      ListNet reference = make_list_net();
      ListNet model = make_list_net();
      for (const auto& block : model->blocks->children()) fsdp::fully_shard(block);
      fsdp::fully_shard(model->heads["main"]);
      fsdp::fully_shard(model);
      auto forward = [](torch::nn::Module& m, const at::Tensor& x) {
        return fsdp::call(dynamic_cast<ListNetImpl*>(&m), x);
      };
      expect_training_parity(reference.ptr(), model.ptr(), forward, "module list");
    });
  }
}

TEST(Containers, FullyShardRefusesModuleListAndModuleDict) {
  run_distributed(1, [] {
    ListNet model = make_list_net();
    for (const std::shared_ptr<torch::nn::Module>& container :
         std::vector<std::shared_ptr<torch::nn::Module>>{model->blocks.ptr(), model->heads.ptr()}) {
      try {
        fsdp::fully_shard(container);
        ADD_FAILURE() << "expected " << container->name() << " to be refused";
      } catch (const c10::Error& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find("fully_shard does not support a torch::nn::Module"), std::string::npos) << msg;
        EXPECT_NE(msg.find("no forward"), std::string::npos) << msg;
      }
      EXPECT_FALSE(fsdp::is_fsdp_module(*container));
    }
  });
}

namespace {

// A child whose parent calls forward_features (not forward), as a classifier calls its
// backbone's features.
struct EncoderImpl : torch::nn::Module {
  EncoderImpl() {
    a = register_module("a", torch::nn::Linear(5, 7));
    b = register_module("b", torch::nn::Linear(7, 3));
  }
  at::Tensor forward_features(const at::Tensor& x) { return at::relu(b->forward(at::relu(a->forward(x)))); }
  at::Tensor forward(const at::Tensor& x) { return forward_features(x).sum(1, true); }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(Encoder);

struct ClassifierImpl : torch::nn::Module {
  ClassifierImpl() {
    encoder = register_module("encoder", Encoder());
    head = register_module("head", torch::nn::Linear(3, 1));
  }
  at::Tensor forward(const at::Tensor& x) {
    return fsdp::call(head, fsdp::call_method(encoder, &EncoderImpl::forward_features, x));
  }
  Encoder encoder{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Classifier);

Classifier make_classifier() {
  torch::manual_seed(0);
  return Classifier();
}

}  // namespace

TEST(Containers, ParentCallsAChildsMethodThroughCallMethod) {
  for (int world : {1, 2, 3}) {
    run_distributed(world, [] {
      Classifier reference = make_classifier();
      Classifier model = make_classifier();
      fsdp::fully_shard(model->encoder);
      fsdp::fully_shard(model);
      auto forward = [](torch::nn::Module& m, const at::Tensor& x) {
        return fsdp::call(dynamic_cast<ClassifierImpl*>(&m), x);
      };
      expect_training_parity(reference.ptr(), model.ptr(), forward, "call_method");
      // Resharded after its backward, as a non-root FSDP module called through its hooks is.
      EXPECT_EQ(fsdp::get_fsdp_module(*model->encoder).unsharded_parameter_bytes(), 0);
    });
  }
}
