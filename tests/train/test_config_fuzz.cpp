// test_config_fuzz.cpp — the config loader fed with mutated copies of the shipped configs and
// mutated command-line overrides, generated from a fixed seed (the same cases on every run).
// Every input must either load (and then pass or fail validation with ConfigError) or fail
// with the loader's ConfigError naming the file (or the command line): no crash, no hang, no
// other exception. Meant to run under ASan/UBSan too; a few seconds in a Release build.
#include "config/config.h"

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

using namespace fsdp::train;

namespace {

constexpr uint64_t kSeed = 20240601;
constexpr int kFileCases = 300;
constexpr int kOverrideCases = 150;

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  return lines;
}

std::string text_of(const std::vector<std::string>& lines) {
  std::string s;
  for (const auto& l : lines) s += l + "\n";
  return s;
}

// Values of every kind a key might wrongly get.
const std::vector<std::string> kOddValues = {"1e308",
                                             "-1e308",
                                             ".nan",
                                             "-.inf",
                                             ".inf",
                                             "99999999999999999999999",
                                             "-9223372036854775808",
                                             "9223372036854775807",
                                             "-1",
                                             "0",
                                             "0x10",
                                             "1_000",
                                             "[1, 2]",
                                             "{a: 1}",
                                             "abc",
                                             "true",
                                             "",
                                             "~",
                                             "null",
                                             "\"\"",
                                             "''",
                                             "[]",
                                             "{}",
                                             "&a 3",
                                             "*a",
                                             "!!binary aGVsbG8=",
                                             "!!str 5",
                                             "2.5",
                                             "-0.0",
                                             "1e-320",
                                             "|",
                                             ">",
                                             "\"\\x00\\uffff\"",
                                             "[0.9, 0.95, 0.99]",
                                             "[[[1]]]",
                                             "- 1",
                                             "? x",
                                             "@",
                                             "`",
                                             "%"};

class Mutator {
 public:
  explicit Mutator(uint64_t seed) : rng_(seed) {}

  size_t below(size_t n) { return n == 0 ? 0 : std::uniform_int_distribution<size_t>(0, n - 1)(rng_); }
  const std::string& pick(const std::vector<std::string>& v) { return v[below(v.size())]; }

  // One to three mutations of the config text; `what` says which, for a failure's message.
  std::string mutate(const std::string& text, std::string* what) {
    std::vector<std::string> lines = lines_of(text);
    const size_t n = 1 + below(3);
    for (size_t i = 0; i < n && !lines.empty(); ++i) {
      const size_t kind = below(kMutations.size());
      *what += std::string(*what == "" ? "" : ", ") + kMutations[kind].first;
      kMutations[kind].second(*this, lines, below(lines.size()));
    }
    return text_of(lines);
  }

  std::string random_bytes(size_t n) {
    std::string s;
    for (size_t i = 0; i < n; ++i) s.push_back(static_cast<char>(below(256)));
    return s;
  }

 private:
  using Mutation = std::function<void(Mutator&, std::vector<std::string>&, size_t)>;
  static void set_value(std::vector<std::string>& lines, size_t i, const std::string& v) {
    const size_t colon = lines[i].find(':');
    lines[i] = colon == std::string::npos ? lines[i] + " " + v : lines[i].substr(0, colon + 1) + " " + v;
  }
  static const std::vector<std::pair<std::string, Mutation>> kMutations;

  std::mt19937_64 rng_;
};

const std::vector<std::pair<std::string, Mutator::Mutation>> Mutator::kMutations = {
    {"delete a line", [](Mutator&, auto& l, size_t i) { l.erase(l.begin() + static_cast<long>(i)); }},
    {"duplicate a line", [](Mutator&, auto& l, size_t i) { l.insert(l.begin() + static_cast<long>(i), l[i]); }},
    {"rename a key",
     [](Mutator& m, auto& l, size_t i) {
       const size_t colon = l[i].find(':');
       if (colon != std::string::npos && colon > 0) l[i].insert(m.below(colon), 1, "abz_."[m.below(5)]);
     }},
    {"odd value", [](Mutator& m, auto& l, size_t i) { set_value(l, i, m.pick(kOddValues)); }},
    {"indent", [](Mutator& m, auto& l, size_t i) { l[i] = std::string(m.below(6), m.below(4) ? ' ' : '\t') + l[i]; }},
    {"dedent",
     [](Mutator&, auto& l, size_t i) {
       const size_t first = l[i].find_first_not_of(' ');
       if (first != std::string::npos) l[i] = l[i].substr(first);
     }},
    {"quote", [](Mutator& m, auto& l, size_t i) { l[i].insert(m.below(l[i].size() + 1), 1, m.below(2) ? '"' : '\''); }},
    {"random bytes",
     [](Mutator& m, auto& l, size_t i) { l[i].insert(m.below(l[i].size() + 1), m.random_bytes(1 + m.below(40))); }},
    {"deep nesting",
     [](Mutator& m, auto& l, size_t i) {
       const size_t depth = 1 + m.below(3000);
       set_value(
           l, i, m.below(2) ? std::string(depth, '[') : [&] {
             std::string s;
             for (size_t d = 0; d < depth; ++d) s += "{a: ";
             return s;
           }());
     }},
    {"long string", [](Mutator& m, auto& l, size_t i) { set_value(l, i, std::string(1 + m.below(200000), 'x')); }},
    {"long key", [](Mutator& m, auto& l, size_t i) { l[i] = "  " + std::string(1 + m.below(5000), 'k') + ": 1"; }},
    {"yaml syntax",
     [](Mutator& m, auto& l, size_t i) {
       static const std::vector<std::string> bits = {"---", "...", "%YAML 1.2", "- x", "? a", ": b",
                                                     "&x",  "*x",  "!tag",      "#",   "[",   "]",
                                                     "{",   "}",   ",",         "|-",  ">+",  "<<: *x"};
       l.insert(l.begin() + static_cast<long>(i), std::string(m.below(4), ' ') + m.pick(bits));
     }},
};

// Runs one input through the loader and the validation; returns "" when it behaved, else what
// went wrong. `where` is what a loader error must name.
std::string check_one(const std::function<TrainConfig()>& load, const std::string& where, bool* loaded) {
  TrainConfig c;
  try {
    c = load();
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    return msg.find(where) == std::string::npos ? "loader error without '" + where + "': " + msg : "";
  } catch (const std::exception& e) {
    return std::string("raw exception: ") + e.what();
  } catch (...) {
    return "unknown exception";
  }
  *loaded = true;
  try {
    check_supported(c);
    check_against_launcher(c, 2, 0);
    (void)reshard_after_forward(c);
  } catch (const ConfigError&) {
  } catch (const std::exception& e) {
    return std::string("raw exception from validation: ") + e.what();
  }
  if (c.training.steps < 1 || c.training.micro_batch_size < 1 || !(c.optimizer.lr > 0) || c.optimizer.beta1 >= 1)
    return "loaded a value outside its range";
  return "";
}

// Beside the test program, in the build folder (found at run time, as in test_config.cpp).
std::string scratch(const std::string& name) {
  return (std::filesystem::read_symlink("/proc/self/exe").parent_path() / name).string();
}

}  // namespace

TEST(TrainConfigFuzz, MutatedShippedConfigsLoadOrFailWithConfigErrorNamingTheFile) {
  std::vector<std::string> bases;
  for (const char* name : {"tiny", "small", "medium", "gpl3", "seed002"})
    bases.push_back(read_text(std::string(FSDP_TRAIN_CONFIGS_DIR) + "/" + name + ".yaml"));
  Mutator m(kSeed);
  const auto start = std::chrono::steady_clock::now();
  int loaded_count = 0;
  for (int i = 0; i < kFileCases; ++i) {
    std::string what;
    const std::string text = m.mutate(bases[m.below(bases.size())], &what);
    const std::string path = scratch("fuzz_" + std::to_string(i) + ".yaml");
    std::ofstream(path, std::ios::binary) << text;
    bool loaded = false;
    const std::string problem = check_one([&] { return load_config(path, {}); }, path, &loaded);
    EXPECT_EQ(problem, "") << "case " << i << " (" << what << "), input kept in " << path;
    if (problem.empty()) std::remove(path.c_str());
    loaded_count += loaded;
  }
  // Both outcomes occur: the mutations are neither all harmless nor all fatal.
  EXPECT_GT(loaded_count, kFileCases / 20);
  EXPECT_LT(loaded_count, kFileCases - kFileCases / 5);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 30.0);
}

TEST(TrainConfigFuzz, MutatedOverridesLoadOrFailWithConfigErrorNamingTheCommandLine) {
  static const std::vector<std::string> keys = {"training.steps",
                                                "training.seed",
                                                "optimizer.lr",
                                                "optimizer.betas",
                                                "model.dim",
                                                "model.dropout_p",
                                                "fsdp_config.collective_timeout_s",
                                                "fsdp_config.sharding_strategy",
                                                "logging.jsonl",
                                                "sample.temperature",
                                                "training.resume",
                                                "training.export",
                                                "nosuch.key",
                                                "training.nosuch",
                                                "training",
                                                ".",
                                                ""};
  Mutator m(kSeed + 1);
  int loaded_count = 0;
  for (int i = 0; i < kOverrideCases; ++i) {
    std::string value = m.below(4) ? m.pick(kOddValues) : m.random_bytes(m.below(30));
    if (m.below(10) == 0) value = std::string(1 + m.below(3000), '[');
    const std::string arg = (m.below(10) ? "--" : "-") + m.pick(keys) + (m.below(10) ? "=" : "") + value;
    bool loaded = false;
    const std::string problem = check_one([&] { return load_config("", {arg}); }, "command line", &loaded);
    EXPECT_EQ(problem, "") << "override case " << i << ": " << arg.substr(0, 200);
    loaded_count += loaded;
  }
  EXPECT_GT(loaded_count, 0);
}
