// Model state dicts across real processes: sharded views without communication, full state dicts,
// loading back in place, bad input, and PyTorch's file format (read back by Python's torch.load).
#include "harness/multiprocess.h"
#include "test_models.h"

#include "python_path.h"
#include <fsdp/call.h>
#include <fsdp/distributed.h>
#include <fsdp/fully_shard.h>
#include <fsdp/models/transformer.h>
#include <fsdp/optim_state_dict.h>
#include <fsdp/state_dict.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

using fsdp::testing::make_sharded;
using fsdp::testing::run_distributed;
using fsdp::testing::WithBuffer;

namespace {

std::string temp_path(const std::string& name) {
  const char* dir = std::getenv("TMPDIR");
  return std::string(dir ? dir : "/tmp") + "/fsdp_sd_" + std::to_string(::getpid()) + "_" + name;
}

void expect_equal_dicts(const fsdp::TensorStateDict& a, const fsdp::TensorStateDict& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& item : a) {
    const at::Tensor* other = b.find(item.key());
    ASSERT_NE(other, nullptr) << item.key();
    EXPECT_TRUE(item.value().equal(*other)) << item.key();
  }
}

}  // namespace

TEST(StateDict, ShardedViewsShareStorageAndNeedNoCommunication) {
  for (int world : {1, 2, 3}) {
    run_distributed(world, [] {
      auto m = make_sharded(1);
      auto pg = fsdp::as_dtensor(m->net->output->weight).device_mesh().get_group(0);
      pg->reset_stats();
      auto sd = fsdp::sharded_state_dict(*m);
      EXPECT_EQ(pg->stats().total_calls(), 0);
      EXPECT_EQ(sd.size(), m->named_parameters().size() + m->named_buffers().size());
      for (const auto& item : m->named_parameters()) {
        const fsdp::DTensor& d = sd[item.key()];
        EXPECT_EQ(d.placements()[0], fsdp::Shard(0)) << item.key();
        EXPECT_EQ(d.to_local().data_ptr(), item.value().data_ptr()) << item.key();
      }
      EXPECT_EQ(sd["scale"].placements()[0], fsdp::Replicate());
      EXPECT_EQ(sd["scale"].to_local().data_ptr(), m->scale.data_ptr());
    });
  }
}

TEST(StateDict, FullStateDictMatchesTheUnshardedModelAndLoadsBack) {
  for (int world : {1, 2, 4}) {
    run_distributed(world, [] {
      WithBuffer reference(1);
      auto ref_sd = reference->named_parameters();
      auto m = make_sharded(1);
      auto full = fsdp::full_state_dict(*m);
      for (const auto& item : ref_sd) EXPECT_TRUE(full[item.key()].equal(item.value())) << item.key();
      EXPECT_TRUE(full["scale"].equal(reference->scale));

      // A model initialised differently takes the full state dict, and then the sharded one.
      auto other = make_sharded(2);
      fsdp::load_full_state_dict(*other, full);
      expect_equal_dicts(fsdp::full_state_dict(*other), full);
      auto third = make_sharded(3);
      fsdp::load_sharded_state_dict(*third, fsdp::sharded_state_dict(*m));
      expect_equal_dicts(fsdp::full_state_dict(*third), full);

      // rank0_only: the others get nothing but still take part in the gathers.
      auto only0 = fsdp::full_state_dict(*m, fsdp::FullStateDictOptions().rank0_only(true));
      EXPECT_EQ(only0.size(), fsdp::get_rank() == 0 ? full.size() : 0u);
    });
  }
}

TEST(StateDict, ReplicatedDTensorsAreChunkedOnLoad) {
  run_distributed(2, [] {
    auto m = make_sharded(1);
    auto full = fsdp::full_state_dict(*m);
    auto mesh = fsdp::as_dtensor(m->net->output->weight).device_mesh();
    fsdp::ShardedStateDict replicated;
    for (const auto& item : full)
      replicated.insert(item.key(), fsdp::DTensor::from_local(item.value(), mesh, {fsdp::Replicate()}));
    auto other = make_sharded(5);
    fsdp::load_sharded_state_dict(*other, replicated);
    expect_equal_dicts(fsdp::full_state_dict(*other), full);
  });
}

TEST(StateDict, BadInputNamesTheKeyAndLoadsNothing) {
  run_distributed(2, [] {
    auto m = make_sharded(1);
    const auto before = fsdp::full_state_dict(*m);
    auto good = fsdp::full_state_dict(*make_sharded(2));
    auto expect_rejected = [&](fsdp::TensorStateDict sd, const std::string& needle) {
      try {
        fsdp::load_full_state_dict(*m, sd);
        ADD_FAILURE() << "expected an error containing " << needle;
      } catch (const c10::Error& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      }
      expect_equal_dicts(fsdp::full_state_dict(*m), before);  // unchanged
    };
    auto missing = good;
    missing.erase("net.norm.weight");
    expect_rejected(missing, "missing key 'net.norm.weight'");
    auto unexpected = good;
    unexpected.insert("net.extra", at::zeros({2}));
    expect_rejected(unexpected, "unexpected key 'net.extra'");
    auto wrong_shape = good;
    wrong_shape["net.output.weight"] = at::zeros({8, 15});
    expect_rejected(wrong_shape, "key 'net.output.weight' has shape [8, 15]");
    auto wrong_dtype = good;
    wrong_dtype["scale"] = at::zeros({3}, at::kDouble);
    expect_rejected(wrong_dtype, "key 'scale' has dtype Double");
  });
}

TEST(StateDict, PyTorchFileFormatRoundTripsAndPythonReadsIt) {
  FSDP_SKIP_WITHOUT_PYTHON();
  run_distributed(2, [] {
    auto m = make_sharded(1);
    auto full = fsdp::full_state_dict(*m);
    const std::string path = temp_path("rank" + std::to_string(fsdp::get_rank()) + ".pt");
    fsdp::save_pytorch_state_dict(full, path);
    expect_equal_dicts(fsdp::load_pytorch_state_dict(path), full);

    // Python's torch.load returns a dict of FQN -> tensor with the full shapes and the same values.
    if (fsdp::get_rank() == 0) {
      const std::string check = temp_path("check.txt");
      const std::string cmd =
          fsdp_test::python() +
          " -c \"import sys, torch; sd = torch.load(sys.argv[1]); "
          "open(sys.argv[2], 'w').write(''.join('%s %s %.9g\\n' % (k, list(v.shape), v.double().sum().item()) "
          "for k, v in sd.items()))\" " +
          path + " " + check;
      ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
      std::ifstream in(check);
      std::string key;
      int seen = 0;
      while (in >> key) {
        std::string rest;
        std::getline(in, rest);
        const at::Tensor* t = full.find(key);
        ASSERT_NE(t, nullptr) << key;
        std::ostringstream shape;
        shape << t->sizes();
        EXPECT_NE(rest.find(shape.str()), std::string::npos) << key << ":" << rest;  // the full shape
        const double sum = std::stod(rest.substr(rest.rfind(' ') + 1));
        EXPECT_NEAR(sum, t->to(at::kDouble).sum().item<double>(), 1e-6 * std::max(1.0, std::abs(sum))) << key;
        ++seen;
      }
      EXPECT_EQ(seen, static_cast<int>(full.size()));
      std::remove(check.c_str());
    }
    std::remove(path.c_str());

    EXPECT_THROW(fsdp::load_pytorch_state_dict(temp_path("does-not-exist.pt")), c10::Error);
  });
}

namespace {

at::Tensor train_step(WithBuffer& m, torch::optim::Optimizer& opt, int64_t step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(50 + step + 100 * fsdp::get_rank());
  at::Tensor toks = at::randint(0, 8, {2, 16}, gen);
  opt.zero_grad();
  at::Tensor logits = fsdp::call(m, toks);
  at::Tensor loss = torch::nn::functional::cross_entropy(logits.reshape({-1, 8}), toks.roll(-1, 1).reshape({-1}));
  loss.backward();
  opt.step();
  return loss.detach();
}

template <typename Opt, typename Options>
void expect_resume_is_exact(Options options) {
  auto a = make_sharded(1);
  Opt opt_a(a->parameters(), options);
  for (int s = 0; s < 3; ++s) train_step(a, opt_a, s);
  // Capture, then load into a differently initialised model and a fresh optimizer.
  auto b = make_sharded(7);
  Opt opt_b(b->parameters(), Options(0.5));
  fsdp::load_sharded_state_dict(*b, fsdp::sharded_state_dict(*a));
  fsdp::load_sharded_optimizer_state_dict(*b, opt_b, fsdp::sharded_optimizer_state_dict(*a, opt_a));
  for (int s = 3; s < 6; ++s) {
    at::Tensor la = train_step(a, opt_a, s);
    at::Tensor lb = train_step(b, opt_b, s);
    EXPECT_TRUE(la.equal(lb)) << "step " << s << ": " << la.item<double>() << " vs " << lb.item<double>();
  }
  expect_equal_dicts(fsdp::full_state_dict(*a), fsdp::full_state_dict(*b));
}

}  // namespace

TEST(StateDict, OptimizerStateResumesTrainingBitwise) {
  run_distributed(2, [] {
    expect_resume_is_exact<torch::optim::Adam>(torch::optim::AdamOptions(1e-2).amsgrad(true));
    expect_resume_is_exact<torch::optim::AdamW>(torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    expect_resume_is_exact<torch::optim::SGD>(torch::optim::SGDOptions(1e-2).momentum(0.9));

    auto m = make_sharded(1);
    torch::optim::Adam opt(m->parameters(), 1e-2);
    train_step(m, opt, 0);
    auto osd = fsdp::sharded_optimizer_state_dict(*m, opt);
    EXPECT_EQ(osd["state.net.output.weight.exp_avg"].placements()[0], fsdp::Shard(0));
    EXPECT_EQ(osd["state.net.output.weight.exp_avg"].sizes(), (std::vector<int64_t>{8, 16}));
    EXPECT_EQ(osd["state.net.output.weight.step"].to_local().item<int64_t>(), 1);
    EXPECT_DOUBLE_EQ(osd["param_groups.net.output.weight.lr"].to_local().item<double>(), 1e-2);
    auto bad = osd;
    bad.insert("state.no.such.param.exp_avg", osd["state.net.output.weight.exp_avg"]);
    try {
      fsdp::load_sharded_optimizer_state_dict(*m, opt, bad);
      ADD_FAILURE() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("unexpected key 'state.no.such.param.exp_avg'"), std::string::npos)
          << e.what();
    }
  });
}
