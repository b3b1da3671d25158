// Loading a checkpoint whose metadata.json is damaged: every problem is found before any data
// is read, and named (the metadata file, the key, the field); no raw JSON or std exception
// escapes. A fuzzer mutates a real checkpoint's metadata and checks that every load either
// returns exactly the saved data or throws c10::Error.
#include "harness/multiprocess.h"
#include "src/checkpoint/checkpoint_metadata.h"

#include <fsdp/checkpoint.h>
#include <fsdp/device_mesh.h>
#include <fsdp/distributed.h>
#include <fsdp/dtensor.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <random>

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

// The checkpoint's values, the same on every rank: uneven shards, bf16, a replicated value, a
// scalar, an empty tensor, and one whose chunks span several 1 MiB checksum blocks.
std::vector<std::pair<std::string, at::Tensor>> values() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  return {{"w", at::randn({5, 3}, gen)},
          {"b", at::randn({4}, gen).to(at::kBFloat16)},
          {"r", at::randn({2, 2}, gen).to(at::kDouble)},
          {"s", at::scalar_tensor(42, at::kLong)},
          {"e", at::zeros({0, 4})},
          {"big", at::randn({600000}, gen)}};
}

fsdp::ShardedStateDict layout(const fsdp::DeviceMesh& mesh) {
  fsdp::ShardedStateDict sd;
  for (const auto& [key, value] : values()) {
    const bool replicated = key == "r" || key == "s";
    sd.insert(key, fsdp::distribute_tensor(value, mesh, {replicated ? fsdp::Replicate() : fsdp::Shard(0)}));
  }
  return sd;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// A checkpoint saved by 2 processes, and a copy of it whose metadata a test rewrites, loaded in
// this (the test) process as a world of one.
class Bench {
 public:
  explicit Bench(const std::string& name) : root_(fsdp::testing::shared_temp_path(name)) {
    if (!fsdp::testing::is_child()) fs::remove_all(root_);
    const std::string good = root_ + "/good";
    fsdp::testing::run_distributed(2,
                                   [good] { fsdp::save_checkpoint(good, layout(fsdp::init_device_mesh("cpu", {2}))); });
    if (fsdp::testing::is_child()) return;
    work_ = root_ + "/work";
    fs::copy(good, work_, fs::copy_options::recursive);
    original_ = read_text(good + "/metadata.json");
    fsdp::init_process_group();
    like_ = layout(fsdp::init_device_mesh("cpu", {1}));
  }
  ~Bench() {
    if (fsdp::testing::is_child()) return;
    fsdp::destroy_process_group();
    fs::remove_all(root_);
  }
  bool in_child() const { return work_.empty(); }
  const std::string& work() const { return work_; }
  const std::string& original() const { return original_; }
  json metadata() const { return json::parse(original_); }
  // The saved metadata with `change` made to it.
  json metadata(const std::function<void(json&)>& change) const {
    json m = metadata();
    change(m);
    return m;
  }
  std::string metadata_path() const { return work_ + "/metadata.json"; }
  void write(const std::string& text) const {
    std::ofstream(metadata_path(), std::ios::binary | std::ios::trunc) << text;
  }
  void write(const json& meta) const { write(meta.dump(1)); }

  // Loads the work copy: "" when it returns exactly the saved data, the error message when it
  // throws c10::Error, and kDifferent when it returns anything else.
  static constexpr const char* kDifferent = "LOADED DATA THAT DIFFERS FROM WHAT WAS SAVED";
  std::string load() const {
    fsdp::ShardedStateDict loaded;
    try {
      loaded = fsdp::load_checkpoint(work_, like_);
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    }
    for (const auto& [key, value] : values()) {
      const fsdp::DTensor* d = loaded.find(key);
      if (!d || d->to_local().scalar_type() != value.scalar_type() || !d->to_local().equal(value)) return kDifferent;
    }
    return loaded.size() == values().size() ? "" : kDifferent;
  }

 private:
  std::string root_, work_, original_;
  fsdp::ShardedStateDict like_;
};

// Loads `meta` and expects an error naming the metadata file and containing every needle, and
// none of the raw exceptions of the JSON library or the standard library.
void expect_rejected(const Bench& bench, const json& meta, const std::vector<std::string>& needles) {
  bench.write(meta);
  const std::string error = bench.load();
  ASSERT_NE(error, "") << "loaded: " << meta.dump();
  EXPECT_NE(error.find(bench.metadata_path()), std::string::npos) << error;
  for (const auto& n : needles) EXPECT_NE(error.find(n), std::string::npos) << "no '" << n << "' in: " << error;
  EXPECT_EQ(error.find("json.exception"), std::string::npos) << error;
  EXPECT_EQ(error.find("basic_string"), std::string::npos) << error;
}

}  // namespace

// The one parser of data file names (the metadata reader and the cleanup of a killed save's
// temporaries both use it) accepts exactly what data_file_name writes.
TEST(CheckpointMetadata, DataFileNamesParseExactlyAsWritten) {
  for (int64_t r : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{123}, int64_t{999999999999999999}}) {
    EXPECT_EQ(fsdp::detail::rank_of_data_file(fsdp::detail::data_file_name(r)), r);
  }
  for (const char* name :
       {"rank_.data", "rank_01.data", "rank_-1.data", "rank_+1.data", "rank_1.data.tmp", "rank_1", "Rank_1.data",
        "rank_1x.data", "rank_ 1.data", "rank_1000000000000000000.data", "x/rank_1.data", ""}) {
    EXPECT_EQ(fsdp::detail::rank_of_data_file(name), -1) << name;
  }
}

TEST(CheckpointMetadata, ChunksMustTileEveryShapeExactly) {
  Bench bench("meta_tiling");
  if (bench.in_child()) return;
  ASSERT_EQ(bench.load(), "");  // the copy loads as saved
  const json good = bench.metadata();
  ASSERT_EQ(good["entries"]["w"]["chunks"].size(), 2u);  // rows [0, 3) and [3, 5)
  auto with = [&](const std::function<void(json&)>& change) { return bench.metadata(change); };
  expect_rejected(bench, with([](json& m) { m["entries"]["w"]["chunks"] = json::array(); }),
                  {"key 'w'", "no chunk for rows [0, 5)"});
  expect_rejected(bench, with([](json& m) { m["entries"]["w"]["chunks"].erase(1); }),
                  {"key 'w'", "no chunk for rows [3, 5)"});
  expect_rejected(bench, with([](json& m) { m["entries"]["w"]["chunks"][0]["offsets"][0] = -1; }),
                  {"key 'w'", "chunks[0].offsets[0]", "is -1"});
  expect_rejected(bench, with([](json& m) { m["entries"]["w"]["chunks"][1]["sizes"][0] = kMax; }),
                  {"key 'w'", "chunks[1]", "outside the 5 rows"});
  expect_rejected(bench, with([](json& m) { m["entries"]["w"]["chunks"][1]["offsets"][0] = 2; }),
                  {"key 'w'", "two chunks holding row 2"});
  // Chunks may split other dims too (parameters sharded along dim 1), but must still tile.
  expect_rejected(bench, with([](json& m) { m["entries"]["w"]["chunks"][1]["sizes"][1] = 2; }),
                  {"key 'w'", "has gaps", "13 of its 15 elements"});
  expect_rejected(bench, with([](json& m) { m["entries"]["w"]["chunks"][1]["offsets"][1] = 2; }),
                  {"key 'w'", "chunks[1]", "indices of dim 1 from index 2, outside the 3"});
  expect_rejected(bench, with([](json& m) {
                    auto& c = m["entries"]["w"]["chunks"];
                    c[1]["offsets"] = {2, 1};
                    c[1]["sizes"] = {3, 2};
                  }),
                  {"key 'w'", "overlapping chunks: chunks[0] and chunks[1]"});
  expect_rejected(bench, with([](json& m) { m["entries"]["w"]["chunks"][1]["offsets"].push_back(0); }),
                  {"key 'w'", "chunks[1]", "2 dims"});
  expect_rejected(bench, with([](json& m) { m["entries"]["s"]["chunks"].push_back(m["entries"]["s"]["chunks"][0]); }),
                  {"key 's'", "a scalar with 2 chunks"});
  expect_rejected(bench, with([](json& m) { m["entries"]["s"]["chunks"] = json::array(); }),
                  {"key 's'", "a scalar with 0 chunks"});
  expect_rejected(bench, with([](json& m) { m["entries"]["e"]["chunks"] = m["entries"]["r"]["chunks"]; }),
                  {"key 'e'", "holds no elements"});
  expect_rejected(bench, with([](json& m) {
                    m["entries"]["w"]["shape"] = {kMax, kMax};
                  }),
                  {"key 'w'", "field 'shape'", "64 bits"});
}

TEST(CheckpointMetadata, ByteRangesAndFilesAreCheckedBeforeAnyRead) {
  Bench bench("meta_bytes");
  if (bench.in_child()) return;
  const json good = bench.metadata();
  auto with = [&](const std::function<void(json&)>& change) { return bench.metadata(change); };
  const int64_t length = good["entries"]["w"]["chunks"][0]["byte_length"].get<int64_t>();
  expect_rejected(bench, with([&](json& m) { m["entries"]["w"]["chunks"][0]["byte_length"] = length + 4; }),
                  {"key 'w'", "chunks[0].byte_length", "take " + std::to_string(length) + " bytes"});
  expect_rejected(bench, with([](json& m) { m["entries"]["big"]["chunks"][0]["byte_offset"] = kMax - 10; }),
                  {"key 'big'", "chunks[0]", "lies outside 'rank_0.data'"});
  expect_rejected(bench, with([](json& m) { m["files"]["rank_1.data"] = 16; }), {"lies outside 'rank_1.data'"});
  expect_rejected(bench, with([](json& m) { m["entries"]["big"]["chunks"][0]["crc32"].erase(1); }),
                  {"key 'big'", "chunks[0].crc32", "has 1 checksums"});
  // Data files are plain rank_<r>.data names inside the checkpoint directory.
  for (const std::string evil : {"../../etc/passwd", "/etc/passwd", "rank_0.data/../rank_1.data", "rank_01.data",
                                 "rank_2.data", "metadata.json", ""}) {
    expect_rejected(bench, with([&](json& m) { m["entries"]["w"]["chunks"][0]["file"] = evil; }),
                    {"key 'w'", "chunks[0].file", "which field 'files' does not list"});
    expect_rejected(bench, with([&](json& m) {
                      m["files"][evil] = 1 << 20;
                      m["entries"]["w"]["chunks"][0]["file"] = evil;
                    }),
                    {"field 'files', entry '" + evil + "'", "is not a data file this build writes"});
  }
  // A data file that is a link to somewhere else is not read.
  const std::string outside = bench.work() + "/../outside.data";
  fs::copy_file(bench.work() + "/rank_1.data", outside);
  fs::rename(bench.work() + "/rank_1.data", bench.work() + "/rank_1.data.real");
  fs::create_symlink(fs::absolute(outside), bench.work() + "/rank_1.data");
  bench.write(good);
  EXPECT_NE(bench.load().find("rank_1.data' listed in '" + bench.metadata_path() + "' resolves outside"),
            std::string::npos)
      << bench.load();
  // The metadata is checked before the data files: damaged metadata is the error reported.
  fs::remove(bench.work() + "/rank_1.data");
  expect_rejected(bench, with([](json& m) { m["entries"]["w"]["chunks"][1]["offsets"][0] = 2; }),
                  {"two chunks holding row 2"});
  fs::rename(bench.work() + "/rank_1.data.real", bench.work() + "/rank_1.data");
  bench.write(good);
  EXPECT_EQ(bench.load(), "");
}

TEST(CheckpointMetadata, WrongStructureNamesTheField) {
  Bench bench("meta_structure");
  if (bench.in_child()) return;
  auto with = [&](const std::function<void(json&)>& change) { return bench.metadata(change); };
  expect_rejected(bench, with([](json& m) { m["entries"]["w"] = 5; }),
                  {"key 'w'", "is the number 5, expected an object"});
  expect_rejected(bench, with([](json& m) { m["entries"]["w"]["chunks"] = "abc"; }),
                  {"key 'w', field 'chunks'", "is a string, expected an array"});
  expect_rejected(bench, with([](json& m) { m.erase("files"); }), {"field 'files' is missing"});
  expect_rejected(bench, with([](json& m) { m["files"] = json::array(); }), {"field 'files' is an array"});
  expect_rejected(bench, with([](json& m) { m["entries"] = nullptr; }), {"field 'entries' is null"});
  expect_rejected(bench, with([](json& m) { m["world_size"] = "2"; }), {"field 'world_size' is a string"});
  expect_rejected(bench, with([](json& m) { m["entries"]["w"]["chunks"][0].erase("crc32"); }),
                  {"key 'w', field 'chunks[0].crc32' is missing"});
  expect_rejected(bench, with([](json& m) { m["entries"]["w"]["chunks"][0]["crc32"][0] = -1; }),
                  {"key 'w', field 'chunks[0].crc32[0]'", "is -1"});
  expect_rejected(bench, with([](json& m) { m["entries"]["w"]["chunks"][0]["byte_offset"] = 1.5; }),
                  {"field 'chunks[0].byte_offset' is the number 1.5, expected an integer"});
  expect_rejected(bench, with([](json& m) { m["entries"]["w"]["chunks"][0]["byte_length"] = 18446744073709551615u; }),
                  {"field 'chunks[0].byte_length'", "more than"});
  expect_rejected(bench, with([](json& m) { m["entries"]["w"]["dtype"] = "Float128"; }),
                  {"key 'w', field 'dtype'", "not a dtype this build reads"});
  expect_rejected(bench, with([](json& m) { m["entries"]["w"]["shape"] = {5, -3}; }), {"field 'shape[1]'"});
  expect_rejected(bench, with([](json& m) { m["block_bytes"] = 4096; }), {"field 'block_bytes' is 4096"});
  expect_rejected(bench, json::array(), {"the top level is an array"});
  bench.write(bench.original().substr(0, bench.original().size() / 2));
  const std::string error = bench.load();
  EXPECT_NE(error.find(bench.metadata_path() + "' is not valid JSON: parse error at line"), std::string::npos) << error;
  EXPECT_EQ(error.find("json.exception"), std::string::npos) << error;
}

namespace {

// One random change to a metadata file; `what` describes it.
class Mutator {
 public:
  Mutator(const std::string& original, uint64_t seed) : original_(original), meta_(json::parse(original)), rng_(seed) {
    collect(meta_, json::json_pointer());
  }

  std::string next(std::string* what) {
    const int kind = static_cast<int>(pick(10));
    if (kind == 0) return truncated(what);
    if (kind == 1) return random_bytes(what);
    json m = meta_;
    const int changes = 1 + static_cast<int>(pick(3));
    for (int i = 0; i < changes; ++i) change(m, kind, what);
    return m.dump(static_cast<int>(pick(2)));
  }

 private:
  uint64_t pick(uint64_t n) { return rng_() % n; }
  template <typename T>
  const T& any(const std::vector<T>& v) {
    return v[pick(v.size())];
  }

  void collect(const json& j, const json::json_pointer& pointer) {
    (j.is_object() || j.is_array() ? containers_ : leaves_).push_back(pointer);
    if (j.is_object()) {
      for (const auto& kv : j.items()) collect(kv.value(), pointer / kv.key());
    } else if (j.is_array()) {
      for (size_t i = 0; i < j.size(); ++i) collect(j[i], pointer / i);
    }
  }

  std::string truncated(std::string* what) {
    const size_t at = pick(original_.size());
    *what = "truncated at " + std::to_string(at);
    return original_.substr(0, at);
  }
  std::string random_bytes(std::string* what) {
    std::string text = original_;
    *what = "random bytes at";
    for (uint64_t i = 0, n = 1 + pick(8); i < n; ++i) {
      const size_t at = pick(text.size());
      text[at] = static_cast<char>(pick(256));
      *what += " " + std::to_string(at);
    }
    return text;
  }

  json odd_value() {
    const std::vector<json> odd = {nullptr,
                                   true,
                                   "x",
                                   3.5,
                                   json::array(),
                                   json::object(),
                                   -1,
                                   0,
                                   1,
                                   kMax,
                                   std::numeric_limits<int64_t>::min(),
                                   18446744073709551615u,
                                   1e300,
                                   "../../etc/passwd",
                                   json::array({0, 0}),
                                   json::array({-1})};
    return odd[pick(odd.size())];
  }
  json perturbed(const json& v) {
    if (!v.is_number_integer()) return odd_value();
    const int64_t i = v.get<int64_t>();
    const std::vector<int64_t> options = {i + 1, i - 1, i * 2, -i, 0, kMax, i + (1 << 20), i / 2};
    return options[pick(options.size())];
  }

  void change(json& m, int kind, std::string* what) {
    const json::json_pointer leaf = any(leaves_), container = any(containers_);
    if (!m.contains(leaf) || !m.contains(container)) return;  // an earlier change removed it
    switch (kind) {
      case 2:
        *what += " delete " + container.to_string();
        erase(m, container);
        break;
      case 3:
        *what += " delete " + leaf.to_string();
        erase(m, leaf);
        break;
      case 4:
        *what += " replace " + leaf.to_string();
        m[leaf] = odd_value();
        break;
      case 5:
        *what += " replace " + container.to_string();
        m[container] = odd_value();
        break;
      case 6:
        *what += " perturb " + leaf.to_string();
        m[leaf] = perturbed(m[leaf]);
        break;
      case 7:
        *what += " duplicate in " + container.to_string();
        duplicate(m[container]);
        break;
      case 8:
        *what += " evil file";
        evil_file(m);
        break;
      default:
        *what += " shuffle or overlap chunks";
        chunks(m);
        break;
    }
  }
  static void erase(json& m, const json::json_pointer& p) {
    if (p.empty()) return;
    json& parent = m[p.parent_pointer()];
    if (parent.is_object()) parent.erase(p.back());
    else parent.erase(static_cast<size_t>(std::stoul(p.back())));
  }
  void duplicate(json& c) {
    if (c.is_array() && !c.empty()) c.push_back(c[pick(c.size())]);
    if (c.is_object() && !c.empty()) c["copy_" + c.begin().key()] = c.begin().value();
  }
  void evil_file(json& m) {
    const std::vector<std::string> names = {"../../etc/passwd",
                                            "/etc/passwd",
                                            "rank_1.data/../rank_0.data",
                                            "rank_9.data",
                                            "rank_01.data",
                                            "",
                                            std::string("rank_1.data\0x", 13)};
    const std::string name = any(names);
    json& chunks = m["entries"][pick(2) ? "w" : "big"]["chunks"];
    chunks[pick(chunks.size())]["file"] = name;
    if (pick(2)) m["files"][name] = 1 << 20;
  }
  void chunks(json& m) {
    json& chunks = m["entries"][pick(2) ? "w" : "big"]["chunks"];
    if (!chunks.is_array() || chunks.size() < 2) return;
    if (pick(2)) {
      std::swap(chunks[0], chunks[1]);  // harmless: the order of chunks does not matter
    } else {
      chunks[1]["offsets"][0] = chunks[0]["offsets"][0].get<int64_t>() + static_cast<int64_t>(pick(2));
    }
  }

  std::string original_;
  json meta_;
  std::mt19937_64 rng_;
  std::vector<json::json_pointer> leaves_, containers_;
};

}  // namespace

TEST(CheckpointMetadata, FuzzedMetadataLoadsTheSavedDataOrThrows) {
  Bench bench("meta_fuzz");
  if (bench.in_child()) return;
  Mutator mutator(bench.original(), /*seed=*/20240611);
  int loaded = 0, rejected = 0;
  for (int i = 0; i < 400; ++i) {
    std::string what;
    bench.write(mutator.next(&what));
    const std::string outcome = bench.load();  // a raw std exception here fails the test
    ASSERT_NE(outcome, Bench::kDifferent) << "mutation " << i << ":" << what;
    if (outcome.empty()) {
      ++loaded;
      continue;
    }
    ++rejected;
    EXPECT_NE(outcome.find(bench.work()), std::string::npos) << "mutation " << i << ":" << what << ": " << outcome;
  }
  std::printf("fuzzed metadata: %d loaded the saved data, %d rejected\n", loaded, rejected);
  EXPECT_GT(rejected, 250);
  EXPECT_GT(loaded, 0);  // shuffled chunks, extra fields, duplicates of nothing that matters
}
