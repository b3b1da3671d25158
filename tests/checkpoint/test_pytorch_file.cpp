// load_pytorch_state_dict on what Python users actually save: files written at test time by
// Python's torch.save (OrderedDicts of several, one and no entries, plain dicts, a real
// nn.Module's state_dict(), bf16/int64/bool tensors, tied and strided views of one storage,
// bundles with an optimizer and other Python objects), every value compared bitwise; and every
// kind of bad file, each named in its error.
#include "file_size_limit.h"
#include "python_path.h"

#include <fsdp/state_dict.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/jit/serialization/pickle.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>

#include <unistd.h>

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// Writes every test file into `dir`, and manifest.json: for each file, its expected state dict
// (key -> dtype, shape, hex of the row-major bytes) in order.
constexpr const char* kWriter = R"PY(
import argparse, collections, json, sys, torch, zipfile
out = sys.argv[1]
torch.manual_seed(0)
manifest = {}
def save(name, obj, expected=None, **kwargs):
    torch.save(obj, out + '/' + name + '.pt', **kwargs)
    if expected is not None:
        manifest[name] = [[k, str(v.dtype), list(v.shape),
                           v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes().hex()]
                          for k, v in expected.items()]
several = collections.OrderedDict([('a', torch.randn(2, 3)), ('b', torch.arange(5)),
                                   ('c', torch.randn(4).to(torch.bfloat16)), ('d', torch.tensor([True, False])),
                                   ('e', torch.tensor(3.5, dtype=torch.float64)),
                                   ('f', torch.tensor([2**40, -2**62, 7], dtype=torch.int64)),
                                   ('g', torch.zeros(0, 3)), ('h', torch.randn(3).half())])
save('several', several, several)
one = collections.OrderedDict(only=torch.randn(3))
save('one', one, one)
plain_one = {'x': torch.ones(2, dtype=torch.int64)}
save('plain_one', plain_one, plain_one)
save('empty', collections.OrderedDict(), {})
save('plain_empty', {}, {})
plain = {'p': torch.randn(2), 'q': torch.randn(3, 1)}
save('plain', plain, plain)
lin = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
lin(torch.randn(5, 4)).sum().backward()
save('module', lin.state_dict(), lin.state_dict())
opt = torch.optim.Adam(lin.parameters())
opt.step()
save('bundle_model', {'model': lin.state_dict(), 'optimizer': opt.state_dict(), 'epoch': 3}, lin.state_dict())
save('bundle_state_dict', {'state_dict': lin.state_dict(), 'args': argparse.Namespace(lr=0.1), 'step': 7,
                           'note': 'ok', 'history': [1.5, None, (2, 'x')]}, lin.state_dict())
save('bundle_params', {'model': dict(lin.named_parameters()), 'model_name': 'lin'}, dict(lin.named_parameters()))
w = torch.randn(6, 4)
tied = collections.OrderedDict(embed=w, head=w, wt=w.t(), row=w[2], col=w[:, 1], tail=w.view(-1)[5:])
save('tied', tied, tied)
save('ambiguous', {'model': one, 'state_dict': one})
save('no_state_dict', {'epoch': 3, 'lr': 0.1})
save('non_tensor', collections.OrderedDict(a=torch.ones(1), b=3))
save('nested_non_tensor', {'model': {'w': torch.ones(1), 'n': 'str'}, 'epoch': 1})
save('int_keys', {'model': {0: torch.ones(1)}, 'epoch': 1})
save('list', [torch.ones(1)])
save('legacy', one, _use_new_zipfile_serialization=False)
# The same archive with data.pkl changed: a tensor sized past its storage, and a truncated pickle.
def patched(name, change):
    src = zipfile.ZipFile(out + '/one.pt')
    with zipfile.ZipFile(out + '/' + name + '.pt', 'w') as dst:
        for info in src.infolist():
            data = src.read(info)
            dst.writestr(info, change(data) if info.filename.endswith('data.pkl') else data)
patched('past_storage', lambda d: d.replace(b'K\x03\x85', b'K\x63\x85', 1))
patched('cut_pickle', lambda d: d[:len(d) // 2])
json.dump(manifest, open(out + '/manifest.json', 'w'))
)PY";

class StateDictPyTorchFile : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    FSDP_SKIP_WITHOUT_PYTHON();
    const char* tmp = std::getenv("TMPDIR");
    dir_ = std::string(tmp && *tmp ? tmp : "/tmp") + "/fsdp_pt_" + std::to_string(::getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::ofstream(dir_ + "/writer.py") << kWriter;
    const std::string cmd = fsdp_test::python() + " " + dir_ + "/writer.py " + dir_;
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    std::ifstream in(dir_ + "/manifest.json");
    manifest_ = json::parse(in);
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }

  static std::string path(const std::string& name) { return dir_ + "/" + name + ".pt"; }

  // The error of loading `file`; "" when it loads.
  static std::string error_of(const std::string& file) {
    try {
      fsdp::load_pytorch_state_dict(file);
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    }
    return "";
  }
  static void expect_error(const std::string& file, const std::vector<std::string>& needles) {
    const std::string error = error_of(file);
    ASSERT_NE(error, "") << file << " loaded";
    EXPECT_NE(error.find("'" + file + "'"), std::string::npos) << error;
    for (const auto& n : needles) EXPECT_NE(error.find(n), std::string::npos) << "no '" << n << "' in: " << error;
  }

  static std::string dir_;
  static json manifest_;
};
std::string StateDictPyTorchFile::dir_;
json StateDictPyTorchFile::manifest_;

at::ScalarType dtype_of(const std::string& python) {
  static const std::map<std::string, at::ScalarType> table = {
      {"torch.float32", at::kFloat},     {"torch.float64", at::kDouble}, {"torch.float16", at::kHalf},
      {"torch.bfloat16", at::kBFloat16}, {"torch.int64", at::kLong},     {"torch.bool", at::kBool}};
  return table.at(python);
}

std::string hex_of(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  const auto* p = static_cast<const unsigned char*>(c.data_ptr());
  std::string out;
  char buf[3];
  for (int64_t i = 0; i < c.numel() * c.element_size(); ++i) {
    std::snprintf(buf, sizeof buf, "%02x", p[i]);
    out += buf;
  }
  return out;
}

}  // namespace

TEST_F(StateDictPyTorchFile, EveryStateDictPythonSavesLoadsBitwise) {
  ASSERT_EQ(manifest_.size(), 11u);
  for (const auto& [name, expected] : manifest_.items()) {
    SCOPED_TRACE(name);
    fsdp::TensorStateDict sd;
    ASSERT_NO_THROW(sd = fsdp::load_pytorch_state_dict(path(name)));
    ASSERT_EQ(sd.size(), expected.size());
    for (size_t i = 0; i < expected.size(); ++i) {
      const json& e = expected[i];
      const std::string key = e[0].get<std::string>();
      EXPECT_EQ(sd.keys()[i], key);  // the order torch.save wrote
      const at::Tensor& t = sd[key];
      EXPECT_EQ(t.scalar_type(), dtype_of(e[1].get<std::string>())) << key;
      EXPECT_EQ(t.sizes().vec(), e[2].get<std::vector<int64_t>>()) << key;
      EXPECT_EQ(hex_of(t), e[3].get<std::string>()) << key;
      EXPECT_TRUE(t.device().is_cpu());
    }
  }
}

// Why src/checkpoint/torch_load.cpp exists: LibTorch's own unpickler still turns Python's
// collections.OrderedDict (every nn.Module.state_dict()) into None, while a plain dict reads. When
// a LibTorch release reads it, this test fails, and the reader can give way to torch::pickle_load.
TEST_F(StateDictPyTorchFile, LibTorchsOwnUnpicklerStillCannotReadAModulesStateDict) {
  auto bytes_of = [&](const std::string& name) {
    std::ifstream in(path(name), std::ios::binary);
    return std::vector<char>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  EXPECT_TRUE(torch::jit::pickle_load(bytes_of("plain")).isGenericDict());
  try {
    c10::IValue v = torch::jit::pickle_load(bytes_of("module"));
    EXPECT_FALSE(v.isGenericDict()) << "torch::jit::pickle_load now reads an OrderedDict state dict: "
                                       "load_pytorch_state_dict could use it";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("GenericDict"), std::string::npos) << e.what();
  }
  // Ours reads both.
  EXPECT_EQ(fsdp::load_pytorch_state_dict(path("module")).size(), manifest_["module"].size());
}

TEST_F(StateDictPyTorchFile, ViewsOfOneStorageStayViewsOfOneStorage) {
  const fsdp::TensorStateDict sd = fsdp::load_pytorch_state_dict(path("tied"));
  EXPECT_TRUE(sd["embed"].is_same(sd["head"]) || sd["embed"].storage().is_alias_of(sd["head"].storage()));
  EXPECT_TRUE(sd["wt"].storage().is_alias_of(sd["embed"].storage()));
  EXPECT_FALSE(sd["wt"].is_contiguous());
  EXPECT_TRUE(sd["wt"].equal(sd["embed"].t()));
  EXPECT_TRUE(sd["col"].equal(sd["embed"].select(1, 1)));
  EXPECT_TRUE(sd["tail"].equal(sd["embed"].reshape({-1}).slice(0, 5)));
  // Parameters saved as such keep requires_grad; a state dict's tensors do not require it.
  EXPECT_TRUE(fsdp::load_pytorch_state_dict(path("bundle_params"))["0.weight"].requires_grad());
  EXPECT_FALSE(fsdp::load_pytorch_state_dict(path("module"))["0.weight"].requires_grad());
}

TEST_F(StateDictPyTorchFile, BundlesWithoutOneStateDictAreErrorsListingTheKeys) {
  expect_error(path("ambiguous"),
               {"ambiguous", "'state_dict' and 'model'", "top-level keys are 'model', 'state_dict'"});
  expect_error(path("no_state_dict"), {"holds no model state dict", "top-level keys are 'epoch', 'lr'"});
  expect_error(path("non_tensor"), {"key 'b' holds a value of type int, not a tensor"});
  expect_error(path("nested_non_tensor"), {"entry 'model': key 'n' holds a value of type str, not a tensor"});
  expect_error(path("int_keys"), {"entry 'model': a key is of type int"});
  expect_error(path("list"), {"holds a value of type list, not a dict of name -> tensor"});
}

TEST_F(StateDictPyTorchFile, BadFilesAreNamedInTheError) {
  expect_error(dir_ + "/missing.pt", {"does not exist"});
  expect_error(dir_, {"is not a regular file"});
  expect_error(path("legacy"), {"legacy format"});
  std::ofstream(dir_ + "/text.pt") << "not a zip archive at all";
  expect_error(dir_ + "/text.pt", {"not a zip archive"});
  std::ofstream(dir_ + "/empty_file.pt");
  expect_error(dir_ + "/empty_file.pt", {"not a zip archive"});
  for (double fraction : {0.9, 0.5, 0.1}) {
    const std::string cut = dir_ + "/cut.pt";
    fs::copy_file(path("several"), cut, fs::copy_options::overwrite_existing);
    fs::resize_file(cut, static_cast<uintmax_t>(fs::file_size(cut) * fraction));
    expect_error(cut, {});
  }
  expect_error(path("past_storage"), {"reaches element 98 of a storage of 3"});
  expect_error(path("cut_pickle"), {"the pickle is truncated"});
}

TEST_F(StateDictPyTorchFile, WhatThisLibrarySavesLoadsBack) {
  fsdp::TensorStateDict sd;
  sd.insert("f", at::randn({3, 4}));
  sd.insert("bf16", at::randn({5}).to(at::kBFloat16));
  sd.insert("long", at::arange(-3, 3, at::kLong));
  sd.insert("scalar", at::scalar_tensor(2.5, at::kDouble));
  sd.insert("view", sd["f"].t());
  fsdp::save_pytorch_state_dict(sd, dir_ + "/ours.pt");
  const fsdp::TensorStateDict back = fsdp::load_pytorch_state_dict(dir_ + "/ours.pt");
  ASSERT_EQ(back.keys(), sd.keys());
  for (const auto& item : sd) {
    EXPECT_EQ(back[item.key()].scalar_type(), item.value().scalar_type()) << item.key();
    EXPECT_EQ(hex_of(back[item.key()]), hex_of(item.value())) << item.key();
  }
  // A save that fails (here: a path under a regular file) names it and keeps what was saved.
  const std::string under_file = dir_ + "/ours.pt/sub.pt";
  try {
    fsdp::save_pytorch_state_dict(sd, under_file);
    ADD_FAILURE() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find(under_file), std::string::npos) << e.what();
  }
  EXPECT_EQ(fsdp::load_pytorch_state_dict(dir_ + "/ours.pt").size(), sd.size());

  // A save to the same path that fails partway (the disk fills up while it writes) names the
  // file, leaves the old ours.pt whole and no temporary behind.
  fsdp::TensorStateDict other;
  other.insert("f", at::randn({64, 64}));  // a different file, larger than ours.pt
  const uintmax_t old_size = fs::file_size(dir_ + "/ours.pt");
  try {
    fsdp_test::FileSizeLimit full(static_cast<rlim_t>(old_size / 2));
    fsdp::save_pytorch_state_dict(other, dir_ + "/ours.pt");
    ADD_FAILURE() << "expected the save to fail";
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    EXPECT_NE(what.find(dir_ + "/ours.pt.tmp"), std::string::npos) << what;
    EXPECT_NE(what.find("File too large"), std::string::npos) << what;
  }
  EXPECT_FALSE(fs::exists(dir_ + "/ours.pt.tmp"));
  EXPECT_EQ(fs::file_size(dir_ + "/ours.pt"), old_size);
  fsdp::TensorStateDict kept;
  ASSERT_NO_THROW(kept = fsdp::load_pytorch_state_dict(dir_ + "/ours.pt"));
  ASSERT_EQ(kept.keys(), sd.keys());
  for (const auto& item : sd) {
    EXPECT_EQ(kept[item.key()].scalar_type(), item.value().scalar_type()) << item.key();
    EXPECT_EQ(hex_of(kept[item.key()]), hex_of(item.value())) << item.key();
  }
}
