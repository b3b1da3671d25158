// PyTorch Distributed Checkpoint interop (fsdp/dcp.h), with real processes on both sides:
// Python's FSDP2 + AdamW dcp.save at W=2 loads in C++ at W=3 and W=1; save_dcp at W=2 loads in
// Python at W=3 into FSDP2 + AdamW (the Python script asserts); and a fuzzer mutates real
// .metadata files (C++- and Python-written) to check that every load either returns exactly
// the saved data or throws c10::Error, and that foreign GLOBALs are refused by name.
#include "harness/multiprocess.h"
#include "python_path.h"

#include <fsdp/checkpoint.h>
#include <fsdp/dcp.h>
#include <fsdp/distributed.h>
#include <fsdp/dtensor.h>
#include <fsdp/fully_shard.h>
#include <fsdp/memory.h>
#include <fsdp/optim_state_dict.h>
#include <fsdp/state_dict.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>

namespace fs = std::filesystem;
using fsdp::testing::run_distributed;

namespace {

// The model both sides build: odd dim-0 sizes (7 and 5 rows) shard unevenly at every W > 1,
// and at W=4 the last rank of the second layer holds no row.
const char* kPythonModel = R"PY(
import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

def build(lr):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.ReLU(), torch.nn.Linear(7, 5, bias=False))
    for layer in (m[0], m[2]):
        fully_shard(layer)
    fully_shard(m)
    opt = torch.optim.AdamW(m.parameters(), lr=lr, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.05)
    return m, opt

def full(v):
    return v.full_tensor() if hasattr(v, "full_tensor") else v

def flat(msd, osd):
    out = {"model." + k: full(v) for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        for name, v in st.items():
            out["optimizer.state.%s.%s" % (fqn, name)] = full(v).float()
    return out

def spawn(fn, world, *args):
    port = str(29000 + os.getpid() % 2000)
    def run(rank):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        fn(rank, *args)
        dist.destroy_process_group()
    mp.start_processes(run, nprocs=world, start_method="fork")
)PY";

// Trains 2 AdamW steps at W=2, saves the DCP checkpoint and, on rank 0, ref.pt: every value whole.
const char* kPythonSave = R"PY(
def save(rank, out):
    m, opt = build(1e-3)
    torch.manual_seed(1)
    x = torch.randn(4, 6)
    for _ in range(2):
        m(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(m, opt)
    sd = {"model": msd, "optimizer": osd, "train_state": {"step": torch.tensor(2)}}
    dcp.save(sd, checkpoint_id=out + "/ckpt")
    # One file per item, written by two threads: __<rank>_<n>.distcp for several n.
    from torch.distributed.checkpoint import FileSystemWriter
    dcp.save(sd, storage_writer=FileSystemWriter(out + "/ckpt_multi", single_file_per_rank=False, thread_count=2))
    ref = flat(msd, osd)
    if rank == 0:
        torch.save(ref, out + "/ref.pt")

spawn(save, 2, sys.argv[1])
)PY";

// Loads the C++ checkpoint at W=3 into FSDP2 + AdamW with plain dcp.load, and checks every value
// against ref.pt, the step and the options; then takes one more step.
const char* kPythonLoad = R"PY(
def load(rank, out):
    m, opt = build(0.5)  # another lr: the checkpoint's must win
    msd, osd = get_state_dict(m, opt)
    sd = {"model": msd, "optimizer": osd, "train_state": {"step": torch.tensor(0)}}
    dcp.load(sd, checkpoint_id=out + "/ckpt")
    set_state_dict(m, opt, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
    assert int(sd["train_state"]["step"]) == 5, sd["train_state"]
    ref = torch.load(out + "/ref.pt")
    got = flat(*get_state_dict(m, opt))
    assert set(got) == set(ref), (sorted(got), sorted(ref))
    for k in ref:
        assert torch.equal(got[k], ref[k].to(got[k].dtype)), (k, got[k], ref[k])
    g = opt.param_groups[0]
    assert g["lr"] == 0.25 and g["betas"] == (0.75, 0.9) and g["eps"] == 1e-6 and g["weight_decay"] == 0.125, g
    assert len(opt.param_groups) == 1 and g["decoupled_weight_decay"]
    m(torch.ones(2, 6)).sum().backward()
    opt.step()
    if rank == 0:
        # Without a state dict to load into, DCP rebuilds the nesting from planner_data.
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        dcp_to_torch_save(out + "/ckpt", out + "/whole.pt")
        whole = torch.load(out + "/whole.pt", weights_only=False)
        assert int(whole["train_state"]["step"]) == 5, whole["train_state"]
        assert whole["optimizer"]["param_groups"][0]["params"] == ["0.weight", "0.bias", "2.weight"], whole["optimizer"]
        assert whole["optimizer"]["param_groups"][0]["initial_lr"] == 0.25
        assert torch.equal(whole["model"]["0.weight"], ref["model.0.weight"])
        open(out + "/python_ok", "w").write("ok")

spawn(load, 3, sys.argv[1])
)PY";

// A DCP checkpoint for the fuzzer: distinct shapes and dtypes (a misdirected storage record
// cannot pass for another item), uneven shards, a replicated value; saved by Python at W=2.
const char* kPythonFuzzSave = R"PY(
from torch.distributed.tensor import distribute_tensor, init_device_mesh, Shard, Replicate
def save(rank, out):
    mesh = init_device_mesh("cpu", (2,))
    v = values()
    sd = {"model": {"w": distribute_tensor(v["w"], mesh, [Shard(0)]), "b": distribute_tensor(v["b"], mesh, [Shard(0)]),
                    "r": distribute_tensor(v["r"], mesh, [Replicate()])},
          "train_state": {"step": torch.tensor(42)}}
    dcp.save(sd, checkpoint_id=out + "/py_fuzz")

def values():
    return {"w": torch.arange(15, dtype=torch.float32).reshape(5, 3), "b": torch.arange(7, dtype=torch.bfloat16),
            "r": torch.arange(4, dtype=torch.float64).reshape(2, 2)}

spawn(save, 2, sys.argv[1])
)PY";

// The same path in the test process and its children (only the parent creates and removes it).
std::string temp_dir(const std::string& name) { return fsdp::testing::shared_temp_path("dcp_" + name); }

// Runs a Python script (the shared model code, then `body`) with argument `dir`.
int run_python(const std::string& dir, const char* body) {
  const std::string script = dir + "/script.py";
  std::ofstream(script) << kPythonModel << body;
  const std::string cmd = fsdp_test::python() + " " + script + " " + dir;
  return std::system(cmd.c_str());
}

// The C++ twin of the Python model, sharded like it (each Linear, then the root).
struct Model {
  torch::nn::Sequential net{torch::nn::Linear(6, 7), torch::nn::ReLU(),
                            torch::nn::Linear(torch::nn::LinearOptions(7, 5).bias(false))};
  std::unique_ptr<torch::optim::AdamW> opt;

  explicit Model(double lr) {
    fsdp::fully_shard(net->ptr(0));
    fsdp::fully_shard(net->ptr(2));
    fsdp::fully_shard(net.ptr());
    opt = std::make_unique<torch::optim::AdamW>(
        net->parameters(), torch::optim::AdamWOptions(lr).betas({0.8, 0.95}).eps(1e-7).weight_decay(0.05));
    fsdp::init_optimizer_state(*opt);
  }
  fsdp::ShardedStateDict model_sd() { return fsdp::sharded_state_dict(*net); }
  fsdp::ShardedStateDict optim_sd() { return fsdp::sharded_optimizer_state_dict(*net, *opt); }
};

// A distinct, exactly representable value for every element of `key`.
at::Tensor pattern(const std::string& key, c10::IntArrayRef shape) {
  const double base = static_cast<double>(std::hash<std::string>()(key) % 61);
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return (at::arange(n, at::kFloat) * 0.25 + base).reshape(shape);
}

}  // namespace

// Python FSDP2 + AdamW at W=2 -> C++ at W=3 and W=1: model, exp_avg, exp_avg_sq, step, options.
TEST(Dcp, PythonSavesAtTwoCppLoadsAtThreeAndOne) {
  FSDP_SKIP_WITHOUT_PYTHON();
  const std::string dir = temp_dir("py_to_cpp");
  if (!fsdp::testing::is_child()) {
    fs::remove_all(dir);
    fs::create_directories(dir);
    ASSERT_EQ(run_python(dir, kPythonSave), 0);
  }
  for (int world : {3, 1}) {
    run_distributed(world, [dir] {
      Model m(0.5);
      fsdp::DcpState s = fsdp::load_dcp(dir + "/ckpt", m.model_sd(), m.optim_sd());
      EXPECT_EQ(s.step, 2);
      fsdp::load_sharded_state_dict(*m.net, s.model);
      fsdp::load_sharded_optimizer_state_dict(*m.net, *m.opt, s.optimizer);
      const fsdp::TensorStateDict ref = fsdp::load_pytorch_state_dict(dir + "/ref.pt");
      int checked = 0;
      for (const auto& item : m.model_sd()) {
        const at::Tensor got = item.value().full_tensor();
        ASSERT_NE(ref.find("model." + item.key()), nullptr) << item.key();
        EXPECT_TRUE(got.equal(ref["model." + item.key()])) << item.key();
        ++checked;
      }
      for (const auto& item : m.optim_sd()) {
        const std::string key = item.key();
        if (key.rfind("state.", 0) == 0) {
          const at::Tensor got = item.value().full_tensor().to(at::kFloat);
          ASSERT_NE(ref.find("optimizer." + key), nullptr) << key;
          EXPECT_TRUE(got.equal(ref["optimizer." + key])) << key;
          ++checked;
        }
      }
      EXPECT_EQ(checked, 3 + 3 * 3);  // 3 parameters; exp_avg, exp_avg_sq, step of each
      const auto& o = static_cast<torch::optim::AdamWOptions&>(m.opt->param_groups()[0].options());
      EXPECT_DOUBLE_EQ(o.lr(), 1e-3);
      EXPECT_DOUBLE_EQ(std::get<0>(o.betas()), 0.8);
      EXPECT_DOUBLE_EQ(std::get<1>(o.betas()), 0.95);
      EXPECT_DOUBLE_EQ(o.eps(), 1e-7);
      EXPECT_DOUBLE_EQ(o.weight_decay(), 0.05);
      // The same state in one file per item loads the same.
      const fsdp::DcpState multi = fsdp::load_dcp(dir + "/ckpt_multi", m.model_sd(), m.optim_sd());
      EXPECT_EQ(multi.step, 2);
      for (const auto& item : s.model) EXPECT_TRUE(item.value().to_local().equal(multi.model[item.key()].to_local()));
      for (const auto& item : s.optimizer) {
        EXPECT_TRUE(item.value().to_local().equal(multi.optimizer[item.key()].to_local())) << item.key();
      }
      // Loaded into Adam, the AdamW state is refused, naming the key that says so.
      try {
        fsdp::load_dcp(dir + "/ckpt", m.model_sd(), m.optim_sd(), fsdp::DcpOptions().adamw(false));
        ADD_FAILURE() << "AdamW state loaded as Adam's";
      } catch (const c10::Error& e) {
        EXPECT_NE(std::string(e.what()).find("decoupled_weight_decay"), std::string::npos) << e.what();
      }
    });
  }
  if (!fsdp::testing::is_child()) fs::remove_all(dir);
}

// C++ at W=2 -> Python FSDP2 + AdamW at W=3 with plain dcp.load and set_state_dict.
TEST(Dcp, CppSavesAtTwoPythonLoadsAtThree) {
  FSDP_SKIP_WITHOUT_PYTHON();
  const std::string dir = temp_dir("cpp_to_py");
  if (!fsdp::testing::is_child()) {
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  run_distributed(2, [dir] {
    Model m(0.25);
    auto& o = static_cast<torch::optim::AdamWOptions&>(m.opt->param_groups()[0].options());
    o.betas({0.75, 0.9}).eps(1e-6).weight_decay(0.125);
    // Known values everywhere: parameters, and the optimizer state at step 5.
    fsdp::TensorStateDict full;
    for (const auto& item : m.model_sd()) full.insert(item.key(), pattern("model." + item.key(), item.value().sizes()));
    fsdp::load_full_state_dict(*m.net, full);
    fsdp::ShardedStateDict osd;
    for (const auto& item : m.optim_sd()) {
      const fsdp::DTensor& d = item.value();
      const bool step = item.key().size() > 5 && item.key().compare(item.key().size() - 5, 5, ".step") == 0;
      const at::Tensor v = step                                 ? at::scalar_tensor(5, at::kLong)
                           : item.key().rfind("state.", 0) == 0 ? pattern("optimizer." + item.key(), d.sizes())
                                                                : d.to_local().clone();
      osd.insert(item.key(), fsdp::distribute_tensor(v, d.device_mesh(), d.placements()));
    }
    fsdp::load_sharded_optimizer_state_dict(*m.net, *m.opt, osd);
    fsdp::save_dcp(dir + "/ckpt", m.model_sd(), m.optim_sd(), 5, fsdp::DcpOptions().initial_lr(0.25));
    // The reference, whole: what Python must find.
    fsdp::TensorStateDict ref;
    for (const auto& item : m.model_sd()) ref.insert("model." + item.key(), item.value().full_tensor());
    for (const auto& item : m.optim_sd()) {
      if (item.key().rfind("state.", 0) == 0) {
        ref.insert("optimizer." + item.key(), item.value().full_tensor().to(at::kFloat));
      }
    }
    if (fsdp::get_rank() == 0) fsdp::save_pytorch_state_dict(ref, dir + "/ref.pt");
    EXPECT_EQ(fsdp::dcp_step(dir + "/ckpt"), 5);
  });
  if (fsdp::testing::is_child()) return;
  std::string why;
  EXPECT_TRUE(fsdp::is_complete_dcp(dir + "/ckpt", &why)) << why;
  ASSERT_EQ(run_python(dir, kPythonLoad), 0);
  EXPECT_TRUE(fs::exists(dir + "/python_ok"));
  fs::remove_all(dir);
}

// C++ to C++ across world sizes: saved at W=4 (the last rank holds no row of the 5-row layer),
// loaded at W=1, 2 and 3 with every value, the step and the options intact.
TEST(Dcp, CppSavesAtFourLoadsAtOneTwoAndThree) {
  const std::string dir = temp_dir("cpp_w4");
  if (!fsdp::testing::is_child()) fs::remove_all(dir);
  run_distributed(4, [dir] {
    Model m(0.125);
    fsdp::TensorStateDict full;
    for (const auto& item : m.model_sd()) full.insert(item.key(), pattern("model." + item.key(), item.value().sizes()));
    fsdp::load_full_state_dict(*m.net, full);
    fsdp::save_dcp(dir + "/ckpt", m.model_sd(), m.optim_sd(), 7, fsdp::DcpOptions());
  });
  for (int world : {1, 2, 3}) {
    run_distributed(world, [dir] {
      Model m(0.5);
      const fsdp::DcpState s = fsdp::load_dcp(dir + "/ckpt", m.model_sd(), m.optim_sd());
      EXPECT_EQ(s.step, 7);
      for (const auto& item : s.model) {
        EXPECT_TRUE(item.value().full_tensor().equal(pattern("model." + item.key(), item.value().sizes())))
            << item.key();
      }
      for (const auto& item : s.optimizer) {
        const at::Tensor v = item.value().full_tensor();
        if (item.key().find(".lr") != std::string::npos) {
          EXPECT_EQ(v.item<double>(), 0.125) << item.key();
        }
        if (item.key().find(".step") != std::string::npos) {
          EXPECT_EQ(v.item<int64_t>(), 1) << item.key();
        }
        if (item.key().find(".exp_avg") != std::string::npos) {
          EXPECT_TRUE(v.eq(0).all().item<bool>()) << item.key();
        }
      }
    });
  }
  if (!fsdp::testing::is_child()) fs::remove_all(dir);
}

namespace {

// The fuzzer's checkpoint values (kPythonFuzzSave's values() in C++).
std::map<std::string, at::Tensor> fuzz_values() {
  return {{"w", at::arange(15, at::kFloat).reshape({5, 3})},
          {"b", at::arange(7, at::kFloat).to(at::kBFloat16)},
          {"r", at::arange(4, at::kDouble).reshape({2, 2})}};
}

fsdp::ShardedStateDict fuzz_layout(const fsdp::DeviceMesh& mesh) {
  fsdp::ShardedStateDict sd;
  for (const auto& [key, v] : fuzz_values()) {
    sd.insert(key, fsdp::distribute_tensor(v, mesh, {key == "r" ? fsdp::Replicate() : fsdp::Shard(0)}));
  }
  return sd;
}

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

constexpr const char* kDifferent = "LOADED DATA THAT DIFFERS FROM WHAT WAS SAVED";

// "" when `dir` loads exactly the saved data, the message of the c10::Error it throws, or kDifferent.
std::string load_outcome(const std::string& dir, const fsdp::ShardedStateDict& like) {
  fsdp::DcpState s;
  try {
    s = fsdp::load_dcp(dir, like, fsdp::ShardedStateDict());
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  if (s.step != 42 || s.model.size() != 3) return kDifferent;
  for (const auto& [key, v] : fuzz_values()) {
    const fsdp::DTensor* d = s.model.find(key);
    if (!d || d->to_local().scalar_type() != v.scalar_type() || !d->to_local().equal(v)) return kDifferent;
  }
  return "";
}

// One mutation of a .metadata pickle.
std::string mutate(const std::string& original, std::mt19937_64& rng, std::string* what) {
  std::string m = original;
  auto pick = [&](size_t n) { return static_cast<size_t>(rng() % n); };
  static const std::vector<std::string> foreign = {"cos\nsystem\n",
                                                   "cbuiltins\neval\n",
                                                   "\x8c\x02os\x94\x8c\x06system\x94\x93",
                                                   "cbuiltins\ngetattr\n",
                                                   "c__builtin__\nexec\n",
                                                   "ctorch\nload\n",
                                                   "cnumpy\nndarray\n",
                                                   "ctorch._utils\n_rebuild_tensor_v2\n"};
  static const std::vector<std::string> huge = {
      std::string("X\xff\xff\xff\x7f", 5), std::string("\x8d\xff\xff\xff\xff\xff\xff\xff\x7f", 9),
      std::string("\x8a\xff", 2),          std::string("j\xff\xff\xff\xff", 5),
      std::string("r\xff\xff\xff\xff", 5), std::string("\x95\xff\xff\xff\xff\xff\xff\xff\xff", 9),
      std::string("J\xff\xff\xff\x7f", 5)};
  switch (pick(7)) {
    case 0: {
      const size_t at = pick(m.size());
      m[at] = static_cast<char>(rng());
      *what = "byte " + std::to_string(at) + " set";
      break;
    }
    case 1: {
      const size_t at = pick(m.size());
      m[at] = static_cast<char>(m[at] ^ (1 << pick(8)));
      *what = "bit flip at " + std::to_string(at);
      break;
    }
    case 2: {
      m.resize(pick(m.size()));
      *what = "truncated to " + std::to_string(m.size());
      break;
    }
    case 3: {
      const size_t a = pick(m.size()), b = pick(m.size());
      std::swap(m[a], m[b]);
      *what = "bytes " + std::to_string(a) + " and " + std::to_string(b) + " swapped";
      break;
    }
    case 4: {
      const std::string& g = foreign[pick(foreign.size())];
      const size_t at = 2 + pick(m.size() - 2);
      m.insert(at, g + ")R");  // the foreign callable, called with no arguments
      *what = "foreign GLOBAL inserted at " + std::to_string(at);
      break;
    }
    case 5: {
      const std::string& h = huge[pick(huge.size())];
      const size_t at = 2 + pick(m.size() - 2);
      m.insert(at, h);
      *what = "huge length inserted at " + std::to_string(at);
      break;
    }
    default: {
      // A whole foreign pickle in place of the metadata.
      m = std::string("\x80\x04", 2) + foreign[pick(foreign.size())] + "(X\x02\x00\x00\x00idtR.";
      *what = "a foreign pickle";
      break;
    }
  }
  return m;
}

void fuzz(const std::string& good, const std::string& work, const char* name, uint64_t seed) {
  const fsdp::ShardedStateDict like = fuzz_layout(fsdp::init_device_mesh("cpu", {1}));
  ASSERT_EQ(load_outcome(good, like), "") << name;
  fs::remove_all(work);
  fs::copy(good, work, fs::copy_options::recursive);
  const std::string original = read_all(good + "/.metadata");
  std::mt19937_64 rng(seed);
  int loaded = 0, rejected = 0;
  for (int i = 0; i < 300; ++i) {
    std::string what;
    const std::string mutated = mutate(original, rng, &what);
    std::ofstream(work + "/.metadata", std::ios::binary | std::ios::trunc) << mutated;
    const std::string outcome = load_outcome(work, like);  // a raw std exception fails the test
    ASSERT_NE(outcome, kDifferent) << name << " mutation " << i << ": " << what;
    if (outcome.empty()) {
      ++loaded;
      continue;
    }
    ++rejected;
    EXPECT_NE(outcome.find(work), std::string::npos) << name << " mutation " << i << ": " << what << ": " << outcome;
    if (what == "a foreign pickle") {
      EXPECT_NE(outcome.find("refused, never imported"), std::string::npos) << outcome;
    }
  }
  std::printf("%s: %d mutations loaded the saved data, %d rejected\n", name, loaded, rejected);
  EXPECT_GT(rejected, 150) << name;
}

}  // namespace

// The metadata reader under 300 mutations each of a C++-written and a Python-written .metadata.
TEST(Dcp, FuzzedMetadataLoadsTheSavedDataOrThrows) {
  const std::string dir = temp_dir("fuzz");
  if (!fsdp::testing::is_child()) {
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  run_distributed(2, [dir] {
    fsdp::save_dcp(dir + "/cpp_fuzz", fuzz_layout(fsdp::init_device_mesh("cpu", {2})), fsdp::ShardedStateDict(), 42);
  });
  if (fsdp::testing::is_child()) return;
  fsdp::init_process_group();
  fuzz(dir + "/cpp_fuzz", dir + "/work", "C++-written .metadata", 20261203);
  if (!std::string(FSDP_TEST_PYTHON).empty()) {
    ASSERT_EQ(run_python(dir, kPythonFuzzSave), 0);
    fuzz(dir + "/py_fuzz", dir + "/work", "Python-written .metadata", 20261204);
  }
  fsdp::destroy_process_group();
  fs::remove_all(dir);
}

// A foreign GLOBAL in a BYTE_IO item's archive is refused too, naming the file, the key and the class.
TEST(Dcp, ForeignGlobalInAnItemIsRefused) {
  const std::string dir = temp_dir("item");
  if (!fsdp::testing::is_child()) {
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  run_distributed(1, [dir] {
    fsdp::save_dcp(dir + "/ckpt", fuzz_layout(fsdp::init_device_mesh("cpu", {1})), fsdp::ShardedStateDict(), 42);
  });
  if (fsdp::testing::is_child()) return;
  // train_state.step's archive: rewrite the GLOBAL of its rebuild function in place (same length).
  const std::string file = dir + "/ckpt/__0_0.distcp";
  std::string bytes = read_all(file);
  const std::string rebuild = "torch._utils\n_rebuild_tensor_v2\n";
  size_t at = 0, last = std::string::npos;
  while ((at = bytes.find(rebuild, at)) != std::string::npos) last = at++;
  ASSERT_NE(last, std::string::npos);
  const std::string evil = "posix\nsystem\n";
  bytes.replace(last, rebuild.size(), evil + std::string(rebuild.size() - evil.size() - 1, 'x') + "\n");
  std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  fsdp::init_process_group();
  try {
    fsdp::load_dcp(dir + "/ckpt", fuzz_layout(fsdp::init_device_mesh("cpu", {1})), fsdp::ShardedStateDict());
    ADD_FAILURE() << "loaded an item naming a foreign GLOBAL";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find(file), std::string::npos) << msg;
    EXPECT_NE(msg.find("posix.system"), std::string::npos) << msg;
    EXPECT_NE(msg.find("never imported"), std::string::npos) << msg;
  }
  fsdp::destroy_process_group();
  fs::remove_all(dir);
}

namespace {

// The message of the c10::Error `f` throws ("" when it throws none).
template <typename F>
std::string error_of(F f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

}  // namespace

// Damage outside .metadata, and keys or shapes that do not match: each error names the file
// and the key. An optimizer other than Adam/AdamW is refused when saving.
TEST(Dcp, ErrorsNameTheFileAndTheKey) {
  const std::string dir = temp_dir("errors");
  if (!fsdp::testing::is_child()) fs::remove_all(dir);
  run_distributed(1, [dir] {
    const fsdp::DeviceMesh mesh = fsdp::init_device_mesh("cpu", {1});
    const std::string ckpt = dir + "/ckpt";
    fsdp::save_dcp(ckpt, fuzz_layout(mesh), fsdp::ShardedStateDict(), 42);
    const std::string data = ckpt + "/__0_0.distcp";
    const std::string original = read_all(data);
    auto load = [&](const fsdp::ShardedStateDict& like) {
      return error_of([&] { fsdp::load_dcp(ckpt, like, fsdp::ShardedStateDict()); });
    };
    // A key the checkpoint lacks, and a shape that differs.
    fsdp::ShardedStateDict more = fuzz_layout(mesh);
    more.insert("zz", fsdp::distribute_tensor(at::zeros({2}), mesh, {fsdp::Replicate()}));
    std::string e = load(more);
    EXPECT_NE(e.find("has no key 'model.zz'"), std::string::npos) << e;
    EXPECT_NE(e.find(ckpt + "/.metadata"), std::string::npos) << e;
    fsdp::ShardedStateDict other;
    for (const auto& item : fuzz_layout(mesh)) {
      const at::Tensor v = item.key() == "w" ? at::zeros({3, 5}) : item.value().full_tensor();
      other.insert(item.key(), fsdp::distribute_tensor(v, mesh, item.value().placements()));
    }
    e = load(other);
    EXPECT_NE(e.find("key 'model.w' has shape [5, 3]"), std::string::npos) << e;
    // A truncated data file: named with its size and a key stored past the end.
    std::ofstream(data, std::ios::binary | std::ios::trunc) << original.substr(0, original.size() / 2);
    e = load(fuzz_layout(mesh));
    EXPECT_NE(e.find(data), std::string::npos) << e;
    EXPECT_NE(e.find("truncated?"), std::string::npos) << e;
    // An item that is no torch.save archive (e.g. DCP's safetensors serialization).
    std::string garbled = original;
    garbled[0] = 'X';
    std::ofstream(data, std::ios::binary | std::ios::trunc) << garbled;
    e = load(fuzz_layout(mesh));
    EXPECT_NE(e.find(data), std::string::npos) << e;
    EXPECT_NE(e.find("not a torch.save archive"), std::string::npos) << e;
    EXPECT_NE(e.find("SAFETENSORS"), std::string::npos) << e;
    // No .metadata: not a complete checkpoint.
    fs::remove(ckpt + "/.metadata");
    std::string why;
    EXPECT_FALSE(fsdp::is_complete_dcp(ckpt, &why));
    EXPECT_NE(why.find(".metadata' does not exist"), std::string::npos) << why;
    // An SGD-shaped optimizer dict is refused before anything is written.
    fsdp::ShardedStateDict sgd;
    sgd.insert("param_groups.w.momentum",
               fsdp::distribute_tensor(at::scalar_tensor(0.9, at::kDouble), mesh, {fsdp::Replicate()}));
    e = error_of([&] { fsdp::save_dcp(dir + "/sgd", fuzz_layout(mesh), sgd, 1); });
    EXPECT_NE(e.find("'param_groups.w.momentum' is no Adam/AdamW option"), std::string::npos) << e;
    EXPECT_FALSE(fs::exists(dir + "/sgd/.metadata"));
  });
  if (!fsdp::testing::is_child()) fs::remove_all(dir);
}

// Both checkpoint formats write a rank's file a piece at a time from the live tensors: saving
// 256 MiB of state grows the resident memory by far less than the state (a file assembled in
// memory first would add all of it, and up to twice that while its buffer grows). Written
// pages go to the page cache, which is not the process's resident memory.
TEST(Dcp, SavesWriteFromTheLiveTensorsWithoutACopyOfTheState) {
  const std::string dir = temp_dir("streamed");
  if (!fsdp::testing::is_child()) {
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  run_distributed(1, [dir] {
    const fsdp::DeviceMesh mesh = fsdp::init_device_mesh("cpu", {1});
    fsdp::ShardedStateDict sd;
    for (int i = 0; i < 4; ++i) {  // 4 x 64 MiB of fp32
      sd.insert("w" + std::to_string(i), fsdp::distribute_tensor(at::rand({16, 1 << 20}), mesh, {fsdp::Shard(0)}));
    }
    const int64_t state = int64_t{256} << 20, allowed = int64_t{64} << 20;
    auto growth_of = [](const std::function<void()>& save) {
      fsdp::memory::empty_cache();
      std::string error;
      EXPECT_TRUE(fsdp::memory::reset_peak_rss(&error)) << error;
      const int64_t before = fsdp::memory::current_rss_bytes();
      save();
      return fsdp::memory::peak_rss_bytes() - before;
    };
    const int64_t native = growth_of([&] { fsdp::save_checkpoint(dir + "/native", sd); });
    EXPECT_LT(native, allowed) << "save_checkpoint of " << state << " bytes grew the peak RSS by " << native;
    const int64_t dcp = growth_of([&] { fsdp::save_dcp(dir + "/dcp", sd, fsdp::ShardedStateDict(), 1); });
    EXPECT_LT(dcp, allowed) << "save_dcp of " << state << " bytes grew the peak RSS by " << dcp;
    const fsdp::ShardedStateDict back = fsdp::load_checkpoint(dir + "/native", sd);
    EXPECT_TRUE(back["w3"].to_local().equal(sd["w3"].to_local()));
  });
  if (!fsdp::testing::is_child()) fs::remove_all(dir);
}
