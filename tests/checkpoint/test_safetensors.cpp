// safetensors export across real processes: one file per rank plus the Hugging Face index, read
// back by our reader and by an independent Python reader (tests/checkpoint/read_safetensors.py), and the
// reader's rejection of malformed files.
#include "harness/multiprocess.h"
#include "test_models.h"

#include "python_path.h"
#include <fsdp/call.h>
#include <fsdp/distributed.h>
#include <fsdp/fully_shard.h>
#include <fsdp/models/transformer.h>
#include <fsdp/safetensors.h>
#include <fsdp/state_dict.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

using fsdp::testing::make_sharded;
using fsdp::testing::run_distributed;
using fsdp::testing::WithBuffer;
namespace fs = std::filesystem;

namespace {

// A directory name every rank agrees on: the ranks are children of the test process.
std::string test_dir(const std::string& name) {
  const char* tmp = std::getenv("TMPDIR");
  const int pid = fsdp::testing::is_child() ? ::getppid() : ::getpid();
  return std::string(tmp ? tmp : "/tmp") + "/fsdp_st_" + std::to_string(pid) + "_" + name;
}

// Removes the directory when the test body ends (on rank 0 only; the body ends with a barrier).
struct DirGuard {
  std::string dir;
  ~DirGuard() {
    if (!fsdp::is_initialized() || fsdp::get_rank() == 0) fs::remove_all(dir);
  }
};

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void spit(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

// The JSON header of a safetensors file, checking that the data starts 8-byte aligned.
nlohmann::json header_of(const std::string& path) {
  const std::string blob = slurp(path);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(static_cast<unsigned char>(blob.at(i))) << (8 * i);
  EXPECT_EQ((8 + n) % 8, 0u) << path;
  return nlohmann::json::parse(blob.substr(8, n));
}

int64_t nbytes(const at::Tensor& t) { return static_cast<int64_t>(t.nbytes()); }

// Checks the directory written by save_safetensors against `full` with our reader (every rank).
void check_with_our_reader(const std::string& dir, const std::string& prefix, const fsdp::TensorStateDict& full) {
  const int world = fsdp::get_world_size();
  const auto index = nlohmann::json::parse(slurp(dir + "/" + prefix + ".safetensors.index.json"));
  int64_t total = 0, largest = 0;
  for (const auto& item : full) total += nbytes(item.value()), largest = std::max(largest, nbytes(item.value()));
  EXPECT_EQ(index["metadata"]["total_size"].get<int64_t>(), total);
  EXPECT_EQ(index["weight_map"].size(), full.size());

  fsdp::TensorStateDict merged;
  std::vector<int64_t> file_bytes;
  for (int r = 0; r < world; ++r) {
    char file[96];
    std::snprintf(file, sizeof(file), "%s-%05d-of-%05d.safetensors", prefix.c_str(), r + 1, world);
    ASSERT_TRUE(fs::exists(dir + "/" + file)) << file;
    EXPECT_FALSE(fs::exists(dir + "/" + file + ".tmp")) << file;
    EXPECT_EQ(header_of(dir + "/" + file)["__metadata__"]["format"], "pt") << file;
    file_bytes.push_back(0);
    for (const auto& item : fsdp::load_safetensors_file(dir + "/" + file)) {
      EXPECT_EQ(index["weight_map"].value(item.key(), ""), file) << item.key();
      ASSERT_FALSE(merged.contains(item.key())) << item.key() << " is in two files";
      merged.insert(item.key(), item.value());
      file_bytes.back() += nbytes(item.value());
    }
  }
  // Greedy balancing: no file exceeds another by more than the largest tensor.
  const auto mm = std::minmax_element(file_bytes.begin(), file_bytes.end());
  EXPECT_LE(*mm.second - *mm.first, largest);

  ASSERT_EQ(merged.size(), full.size());
  for (const auto& item : full) {
    const at::Tensor* got = merged.find(item.key());
    ASSERT_NE(got, nullptr) << item.key();
    EXPECT_EQ(got->scalar_type(), item.value().scalar_type()) << item.key();
    EXPECT_TRUE(got->equal(item.value())) << item.key();
  }
}

// Rank 0: tests/checkpoint/read_safetensors.py decodes every file from the bytes and compares it with
// `full` as torch.save'd by save_pytorch_state_dict.
void check_with_python(const std::string& dir, const std::string& prefix, const fsdp::TensorStateDict& full) {
  if (fsdp::get_rank() != 0) return;
  const std::string script = std::string(FSDP_TESTS_SOURCE_DIR) + "/checkpoint/read_safetensors.py";
  ASSERT_TRUE(fs::exists(script)) << script << " (FSDP_TESTS_SOURCE_DIR, set by tests/CMakeLists.txt)";
  const std::string ref = dir + "/reference.pt", log = dir + "/python.log";
  fsdp::save_pytorch_state_dict(full, ref);
  const std::string cmd = fsdp_test::python() + " '" + script + "' '" + dir + "/" + prefix +
                          ".safetensors.index.json' '" + ref + "' > '" + log + "' 2>&1";
  const int rc = std::system(cmd.c_str());
  const std::string out = slurp(log);
  EXPECT_EQ(rc, 0) << cmd << "\n" << out;
  EXPECT_NE(out.find("OK: "), std::string::npos) << out;
}

}  // namespace

TEST(Safetensors, ShardedModelIsWrittenOneFilePerRankAndReadsBackExactly) {
  FSDP_SKIP_WITHOUT_PYTHON();
  for (int world : {1, 2, 3}) {
    run_distributed(world, [world] {
      DirGuard guard{test_dir("model_w" + std::to_string(world))};
      auto m = make_sharded(1);
      const auto options = fsdp::SafetensorsOptions().metadata({{"step", "7"}});
      auto pg = fsdp::as_dtensor(m->net->output->weight).device_mesh().get_group(0);
      pg->reset_stats();
      fsdp::save_safetensors(fsdp::sharded_state_dict(*m), guard.dir, options);
      // One gather per sharded parameter (to its owner), none for the buffer.
      EXPECT_EQ(pg->stats()[fsdp::CollectiveKind::kAllGather].calls, static_cast<int64_t>(m->parameters().size()));
      const auto full = fsdp::full_state_dict(*m);
      check_with_our_reader(guard.dir, "model", full);
      check_with_python(guard.dir, "model", full);
      const std::string first = guard.dir + "/model-00001-of-0000" + std::to_string(world) + ".safetensors";
      EXPECT_EQ(header_of(first)["__metadata__"], nlohmann::json({{"format", "pt"}, {"step", "7"}}));
      fsdp::world()->barrier()->wait();  // before rank 0 removes the directory
    });
  }
}

// Every dtype, uneven and empty shards, 0-d tensors, a custom prefix, and ranks left without
// any tensor (which still write a valid, empty file).
TEST(Safetensors, EveryDtypeAndEmptyRanks) {
  FSDP_SKIP_WITHOUT_PYTHON();
  run_distributed(3, [] {
    DirGuard guard{test_dir("dtypes")};
    auto mesh = fsdp::init_device_mesh("cpu", {3});
    torch::manual_seed(0);
    const std::vector<at::ScalarType> dtypes = {at::kDouble, at::kFloat, at::kHalf, at::kBFloat16, at::kLong,
                                                at::kInt,    at::kShort, at::kChar, at::kByte,     at::kBool};
    fsdp::ShardedStateDict sd;
    for (size_t i = 0; i < dtypes.size(); ++i) {
      const at::Tensor full = (at::randn({5, 3}) * 50).to(dtypes[i]);  // rows split 2, 2, 1
      const auto placement = i % 2 ? fsdp::Replicate() : fsdp::Shard(0);
      sd.insert("t" + std::to_string(i), fsdp::distribute_tensor(full, mesh, {placement}));
    }
    sd.insert("scalar", fsdp::distribute_tensor(at::tensor(2.5), mesh, {fsdp::Replicate()}));
    sd.insert("empty", fsdp::distribute_tensor(at::zeros({4, 0}), mesh, {fsdp::Shard(0)}));
    fsdp::TensorStateDict full;
    for (const auto& item : sd) full.insert(item.key(), item.value().full_tensor());

    fsdp::save_safetensors(sd, guard.dir, fsdp::SafetensorsOptions().prefix("dtypes"));
    check_with_our_reader(guard.dir, "dtypes", full);
    check_with_python(guard.dir, "dtypes", full);

    fsdp::ShardedStateDict one;
    one.insert("only", sd["t0"]);
    fsdp::save_safetensors(one, guard.dir, fsdp::SafetensorsOptions().prefix("one"));
    check_with_our_reader(guard.dir, "one", {{"only", full["t0"]}});
    EXPECT_TRUE(fsdp::load_safetensors_file(guard.dir + "/one-00003-of-00003.safetensors").is_empty());
    fsdp::world()->barrier()->wait();
  });
}

namespace {

// A safetensors file from a header and `data_len` data bytes (0, 1, 2, ...).
std::string file_bytes(const std::string& header, size_t data_len, uint64_t claimed_len = 0) {
  std::string out(8, '\0');
  const uint64_t n = claimed_len ? claimed_len : header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(n >> (8 * i));
  out += header;
  for (size_t i = 0; i < data_len; ++i) out += static_cast<char>(i);
  return out;
}

}  // namespace

TEST(Safetensors, MalformedFilesAreRejectedNamingTheFile) {
  DirGuard guard{test_dir("malformed")};
  fs::create_directories(guard.dir);
  // Anyone's valid file: no __metadata__, no padding, entries not in data order.
  const std::string good = R"({"b":{"dtype":"I16","shape":[2],"data_offsets":[8,12]},)"
                           R"("a":{"dtype":"F32","shape":[2,1],"data_offsets":[0,8]}})";
  spit(guard.dir + "/good.safetensors", file_bytes(good, 12));
  const auto loaded = fsdp::load_safetensors_file(guard.dir + "/good.safetensors");
  ASSERT_EQ(loaded.keys(), std::vector<std::string>({"a", "b"}));
  EXPECT_EQ(loaded["a"].sizes(), at::IntArrayRef({2, 1}));
  EXPECT_EQ(loaded["b"].scalar_type(), at::kShort);
  EXPECT_EQ(loaded["b"][1].item<int64_t>(), 11 * 256 + 10);  // little-endian bytes 10, 11

  auto expect_rejected = [&](const std::string& name, const std::string& bytes, const std::string& needle) {
    const std::string path = guard.dir + "/" + name + ".safetensors";
    spit(path, bytes);
    try {
      fsdp::load_safetensors_file(path);
      ADD_FAILURE() << name << ": expected an error containing " << needle;
    } catch (const c10::Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("'" + path + "'"), std::string::npos) << what;
      EXPECT_NE(what.find(needle), std::string::npos) << name << ": " << what;
    }
  };
  const std::string whole = file_bytes(good, 12);
  expect_rejected("short", whole.substr(0, 5), "too short");
  expect_rejected("truncated", whole.substr(0, whole.size() - 3), "run past the end");
  expect_rejected("long_header", file_bytes(good, 12, 1000), "header length 1000 exceeds");
  expect_rejected("bad_json", file_bytes(R"({"a": {"dtype": )", 0), "not valid JSON");
  expect_rejected("not_object", file_bytes("[1, 2]", 0), "not a JSON object");
  expect_rejected("unknown_dtype", file_bytes(R"({"a":{"dtype":"F8","shape":[1],"data_offsets":[0,1]}})", 1),
                  "unknown dtype \"F8\"");
  expect_rejected("wrong_length", file_bytes(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
                  "needs 12");
  expect_rejected("overlap",
                  file_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                             R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                             12),
                  "the data of tensor 'b' overlaps that of 'a'");
  expect_rejected("hole",
                  file_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                             R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                             12),
                  "belong to no tensor");
  expect_rejected("bad_shape", file_bytes(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4),
                  "bad shape");
  EXPECT_THROW(fsdp::load_safetensors_file(guard.dir + "/missing.safetensors"), c10::Error);
}

// Written over 2 ranks, read over 3 (and 1) into a model sharded there with other values: every
// rank reads only its own rows, and the model then holds exactly the written values. A model of
// other shapes is refused naming the tensor.
TEST(Safetensors, LoadsIntoAModelShardedOverAnotherWorldSize) {
  const std::string dir = fsdp::testing::shared_temp_path("st_reshard");
  if (!fsdp::testing::is_child()) fs::remove_all(dir);
  run_distributed(2, [dir] { fsdp::save_safetensors(fsdp::sharded_state_dict(*make_sharded(1)), dir); });
  for (int world : {3, 1}) {
    run_distributed(world, [dir] {
      const auto written = fsdp::full_state_dict(*make_sharded(1));
      auto m = make_sharded(2);
      fsdp::load_sharded_state_dict(*m, fsdp::load_safetensors(dir, fsdp::sharded_state_dict(*m)));
      const auto loaded = fsdp::full_state_dict(*m);
      ASSERT_EQ(loaded.size(), written.size());
      for (const auto& item : written) EXPECT_TRUE(loaded[item.key()].equal(item.value())) << item.key();

      torch::manual_seed(3);
      fsdp::models::ModelArgs other;
      other.dim = 8;
      auto wrong = fsdp::models::Transformer(other);
      for (auto& block : wrong->blocks()) fsdp::fully_shard(block);
      fsdp::fully_shard(wrong);
      // Its keys lack the "net." prefix and "scale": the first missing key is named.
      try {
        fsdp::load_safetensors(dir, fsdp::sharded_state_dict(*wrong));
        ADD_FAILURE() << "loaded a model with other keys";
      } catch (const c10::Error& e) {
        EXPECT_NE(std::string(e.what()).find("has no tensor 'tok_embeddings.weight'"), std::string::npos) << e.what();
      }
      // The same keys, one of another shape: named with both shapes.
      fsdp::ShardedStateDict like = fsdp::sharded_state_dict(*m);
      like["scale"] = fsdp::DTensor::from_local(at::zeros({4}, at::kFloat), like["scale"].device_mesh(),
                                                like["scale"].placements(), std::vector<int64_t>{4});
      try {
        fsdp::load_safetensors(dir, like);
        ADD_FAILURE() << "loaded a tensor of another shape";
      } catch (const c10::Error& e) {
        EXPECT_NE(std::string(e.what()).find("tensor 'scale': has shape [3] but the model's is [4]"), std::string::npos)
            << e.what();
      }
    });
  }
  if (!fsdp::testing::is_child()) fs::remove_all(dir);
}

// A file in bf16 (as Hugging Face checkpoints often are) read into an fp32 model sharded over two
// ranks: refused naming both dtypes, unless SafetensorsOptions::convert_float_dtypes, which reads
// each rank's rows as stored and converts them; an integer tensor is never converted.
TEST(Safetensors, FloatDtypesAreConvertedOnlyWhenAskedAndOnlyBetweenFloats) {
  const std::string dir = fsdp::testing::shared_temp_path("st_convert");
  if (!fsdp::testing::is_child()) fs::remove_all(dir);
  run_distributed(2, [dir] {
    auto m = make_sharded(1);
    fsdp::ShardedStateDict bf16;
    for (const auto& item : fsdp::sharded_state_dict(*m)) {
      const fsdp::DTensor& d = item.value();
      bf16.insert(item.key(), fsdp::DTensor::from_local(d.to_local().to(at::kBFloat16), d.device_mesh(), d.placements(),
                                                        d.sizes()));
    }
    fsdp::save_safetensors(bf16, dir);
    auto fresh = make_sharded(2);
    try {
      fsdp::load_safetensors(dir, fsdp::sharded_state_dict(*fresh));
      ADD_FAILURE() << "loaded bf16 into fp32 without being asked to convert";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("has dtype BFloat16 but the model's is Float"), std::string::npos)
          << e.what();
    }
    fsdp::ShardedStateDict loaded = fsdp::load_safetensors(dir, fsdp::sharded_state_dict(*fresh),
                                                           fsdp::SafetensorsOptions().convert_float_dtypes(true));
    for (const auto& item : bf16) {
      EXPECT_EQ(loaded[item.key()].scalar_type(), at::kFloat) << item.key();
      EXPECT_TRUE(loaded[item.key()].to_local().equal(item.value().to_local().to(at::kFloat))) << item.key();
    }
    fsdp::ShardedStateDict integer = fsdp::sharded_state_dict(*fresh);
    const fsdp::DTensor& scale = integer["scale"];
    integer["scale"] = fsdp::DTensor::from_local(at::zeros(scale.to_local().sizes(), at::kLong), scale.device_mesh(),
                                                 scale.placements(), scale.sizes());
    EXPECT_THROW(fsdp::load_safetensors(dir, integer, fsdp::SafetensorsOptions().convert_float_dtypes(true)),
                 c10::Error);
  });
  if (!fsdp::testing::is_child()) fs::remove_all(dir);
}

// What transformers tolerates on load, asked for by name: a tensor of the files that the model
// has not is skipped only when an ignore_unexpected expression matches it, and files that leave
// the base model's prefix out of every name load into the model's prefixed keys.
TEST(Safetensors, IgnoredTensorsAndALeftOutPrefixLoadOnlyWhenAskedFor) {
  const std::string dir = fsdp::testing::shared_temp_path("st_tolerances");
  if (!fsdp::testing::is_child()) {
    fs::remove_all(dir);
    fs::remove_all(dir + "_prefixed");
  }
  run_distributed(2, [dir] {
    auto m = make_sharded(1);
    const fsdp::ShardedStateDict sd = fsdp::sharded_state_dict(*m);
    const fsdp::DeviceMesh mesh = sd.begin()->value().device_mesh();
    auto expect_error = [](const std::function<void()>& load, const std::string& needle) {
      try {
        load();
        ADD_FAILURE() << "loaded; expected an error with: " << needle;
      } catch (const c10::Error& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "expected: " << needle << "\n" << e.what();
      }
    };
    // The files: the model's tensors without the prefix "base.", and a mask buffer it has not.
    fsdp::ShardedStateDict files;
    for (const auto& item : sd) files.insert(item.key(), item.value());
    files.insert("h.0.attn.bias", fsdp::DTensor::from_local(at::ones({2, 2}), mesh, {fsdp::Replicate()}));
    fsdp::save_safetensors(files, dir);
    auto fresh = make_sharded(2);
    fsdp::ShardedStateDict prefixed;
    for (const auto& item : fsdp::sharded_state_dict(*fresh)) prefixed.insert("base." + item.key(), item.value());
    const auto both = fsdp::SafetensorsOptions().optional_key_prefix("base.").ignore_unexpected({R"(\.attn\.bias$)"});
    expect_error([&] { fsdp::load_safetensors_into(dir, prefixed, fsdp::SafetensorsOptions()); },
                 "has no tensor 'base.");
    expect_error(
        [&] { fsdp::load_safetensors_into(dir, prefixed, fsdp::SafetensorsOptions().optional_key_prefix("base.")); },
        "has tensor 'h.0.attn.bias', which the model has not (unexpected key)");
    expect_error(
        [&] {
          fsdp::load_safetensors_into(
              dir, prefixed, fsdp::SafetensorsOptions().optional_key_prefix("base.").ignore_unexpected({"masked"}));
        },
        "has tensor 'h.0.attn.bias'");
    expect_error(
        [&] { fsdp::load_safetensors_into(dir, prefixed, fsdp::SafetensorsOptions().ignore_unexpected({"("})); },
        "ignore_unexpected: '(' is not a valid regular expression");
    fsdp::load_safetensors_into(dir, prefixed, both);
    for (const auto& item : sd)
      EXPECT_TRUE(prefixed["base." + item.key()].to_local().equal(item.value().to_local())) << item.key();
    // Files that do carry the prefix load as they are; the prefix is only ever left out whole.
    fsdp::ShardedStateDict files_prefixed;
    for (const auto& item : sd) files_prefixed.insert("base." + item.key(), item.value());
    fsdp::save_safetensors(files_prefixed, dir + "_prefixed");
    auto third = make_sharded(3);
    fsdp::ShardedStateDict third_prefixed;
    for (const auto& item : fsdp::sharded_state_dict(*third)) third_prefixed.insert("base." + item.key(), item.value());
    fsdp::load_safetensors_into(dir + "_prefixed", third_prefixed, both);
    for (const auto& item : sd)
      EXPECT_TRUE(third_prefixed["base." + item.key()].to_local().equal(item.value().to_local())) << item.key();
  });
  if (!fsdp::testing::is_child()) {
    fs::remove_all(dir);
    fs::remove_all(dir + "_prefixed");
  }
}
