// End-to-end tests of resuming past a damaged checkpoint, in both checkpoint formats: a
// checkpoint whose save finished but that fails a check stops the run (training.resume: auto
// and a training.resume path alike), with one message that names the checkpoint, what is wrong
// (the file, the key or the check), and the older complete checkpoint with the steps it is
// behind; nothing is started, saved or pruned. Moving the damaged one aside, as the message
// says, continues from the older one and leaves the damaged one where it was moved. Real
// processes: two ranks under fsdprun.
#include "process_harness.h"
#include "trainer_runs.h"

#include "../python_path.h"
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

using namespace process_test;
using namespace trainer_test;
namespace fs = std::filesystem;

namespace {

// The formats: fsdp-train's own (metadata.json, rank_<r>.data) and PyTorch's DCP layout
// (.metadata, __<r>_0.distcp).
enum class Format { kFsdp, kDcp };

std::vector<std::string> run_args(Format f, const std::string& dir, int steps, const std::vector<std::string>& more) {
  std::vector<std::string> a = with(base_args(dir, steps), more);
  if (f == Format::kDcp) a.push_back("--fsdp_config.checkpoint_format=dcp");
  return a;
}

// 10 steps at W=2, every checkpoint kept: ckpt/step_5 and ckpt/step_10, saved once per format.
const std::string& pristine(Format f) {
  static TempDir root;
  static std::map<Format, std::string> done;
  auto it = done.find(f);
  if (it != done.end()) return it->second;
  const std::string dir = root / (f == Format::kDcp ? "dcp" : "fsdp");
  RunResult r = fsdprun.run(under_fsdprun(2, run_args(f, dir, 10, {})), {}, 180);
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  return done.emplace(f, dir).first->second;
}

// Every file under `dir` with its size and a hash of its content: what a run that stops must
// leave as it was. The directory's lock file names the latest run to hold it, whatever it did.
std::map<std::string, std::string> snapshot(const std::string& dir) {
  std::map<std::string, std::string> files;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    const std::string name = fs::relative(e.path(), dir).string();
    if (!e.is_regular_file() || name == ".fsdp-train.lock") continue;
    const std::string bytes = read_file(e.path().string());
    files[name] = std::to_string(bytes.size()) + " bytes, hash " + std::to_string(std::hash<std::string>{}(bytes));
  }
  return files;
}

// The line of `r`'s output that holds `start`, from `start` to its end ("" when none).
std::string line_from(const RunResult& r, const std::string& start) {
  for (const std::string* text : {&r.out, &r.err}) {
    const size_t at = text->find(start);
    if (at != std::string::npos) return text->substr(at, text->find('\n', at) - at);
  }
  return "";
}

void write_json(const std::string& path, const nlohmann::json& j) { write_text(path, j.dump()); }

// The model keys of a metadata.json, sorted; the first is the one the damage below changes.
std::string first_model_key(const nlohmann::json& meta) {
  for (const auto& [key, entry] : meta.at("entries").items())
    if (key.rfind("model.", 0) == 0) return key;
  return "";
}

// Rewrites a DCP .metadata with Python's own pickle and DCP classes; writes the key it changed
// to key_file.
const char* kEditDcpMetadata =
    "import dataclasses, pickle, sys, torch\n"
    "from torch.distributed.checkpoint.filesystem import _StorageInfo\n"
    "path, mode, key_file = sys.argv[1:4]\n"
    "with open(path + '/.metadata', 'rb') as f:\n"
    "    md = pickle.load(f)\n"
    "key = sorted(k for k in md.state_dict_metadata if k.startswith('model.'))[0]\n"
    "if mode == 'huge':\n"
    "    m = md.state_dict_metadata[key]\n"
    "    m.size = torch.Size([2 ** 40] + list(m.size)[1:])\n"
    "elif mode == 'offsets':\n"
    "    md.storage_data = {i: _StorageInfo(s.relative_path, s.offset + 2 ** 40, s.length)\n"
    "                       for i, s in md.storage_data.items()}\n"
    "elif mode == 'rename':\n"
    "    new = key + '_renamed'\n"
    "    md.state_dict_metadata[new] = md.state_dict_metadata.pop(key)\n"
    "    md.storage_data = {(dataclasses.replace(i, fqn=new) if i.fqn == key else i): s\n"
    "                       for i, s in md.storage_data.items()}\n"
    "with open(path + '/.metadata', 'wb') as f:\n"
    "    pickle.dump(md, f)\n"
    "open(key_file, 'w').write(key)\n";

// A pickle whose reduce runs `touch <witness>` when Python's pickle loads it.
std::string reduce_pickle(const std::string& witness) {
  const std::string cmd = "touch " + witness;
  std::string length(4, '\0');
  for (int b = 0; b < 4; ++b) length[b] = static_cast<char>((cmd.size() >> (8 * b)) & 0xff);
  return std::string("\x80\x04", 2) + "cos\nsystem\n(X" + length + cmd + "tR.";
}

struct Damage {
  std::string name;
  // Damages ckpt/step_10 under `run` in format f; returns what the stop must name (a file or key).
  std::string (*apply)(Format f, const std::string& run);
};

std::string truncate(const std::string& path) {
  const std::string bytes = read_file(path);
  write_text(path, bytes.substr(0, bytes.size() / 2));
  return fs::path(path).filename().string();
}

// Python's edit of a .metadata; the key it changed.
std::string edit_dcp(const std::string& run, const std::string& mode) {
  write_text(run + "/edit.py", kEditDcpMetadata);
  EXPECT_EQ(run_python(run + "/edit.py", {run + "/ckpt/step_10", mode, run + "/key"}), 0);
  return read_file(run + "/key");
}

// The same edit of a metadata.json, by JSON.
std::string edit_fsdp(const std::string& run, const std::string& mode) {
  const std::string path = run + "/ckpt/step_10/metadata.json";
  nlohmann::json meta = nlohmann::json::parse(read_file(path));
  const std::string key = first_model_key(meta);
  nlohmann::json& entries = meta.at("entries");
  if (mode == "huge") entries.at(key).at("shape")[0] = int64_t{1} << 40;
  if (mode == "offsets") {
    for (auto& [k, entry] : entries.items())
      for (auto& chunk : entry.at("chunks"))
        chunk["byte_offset"] = chunk.at("byte_offset").get<int64_t>() + (1LL << 40);
  }
  if (mode == "rename") {
    entries[key + "_renamed"] = entries.at(key);
    entries.erase(key);
  }
  write_json(path, meta);
  return key;
}

const std::vector<Damage> kDamages = {
    {"ReducePickleMetadata",
     [](Format f, const std::string& run) -> std::string {
       const std::string file = f == Format::kDcp ? ".metadata" : "metadata.json";
       write_text(run + "/ckpt/step_10/" + file, reduce_pickle(run + "/pwned"));
       return file;
     }},
    {"TwoToTheFortyRows",
     [](Format f, const std::string& run) {
       return f == Format::kDcp ? edit_dcp(run, "huge") : edit_fsdp(run, "huge");
     }},
    {"TruncatedDataFile",
     [](Format f, const std::string& run) {
       return truncate(run + "/ckpt/step_10/" + (f == Format::kDcp ? "__0_0.distcp" : "rank_0.data"));
     }},
    {"OffsetsPastTheEnd",
     [](Format f, const std::string& run) {
       return f == Format::kDcp ? edit_dcp(run, "offsets") : edit_fsdp(run, "offsets");
     }},
    {"RenamedModelKey",
     [](Format f, const std::string& run) {
       return f == Format::kDcp ? edit_dcp(run, "rename") : edit_fsdp(run, "rename");
     }},
};

// The stop every damaged checkpoint gets: the checkpoint, the damage, the older one and the
// steps lost, and the way to continue by hand; nothing of the run's directory changed.
void expect_stopped(const RunResult& r, const std::string& run, const std::string& setting, const std::string& names) {
  const std::string ckpt = run + "/ckpt";
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_TRUE(contains(r, "exited with code 1")) << describe(r);
  EXPECT_FALSE(contains(r, "resumed from")) << describe(r);
  EXPECT_FALSE(contains(r, "frame #")) << describe(r);
  const std::string line = line_from(r, setting + "cannot resume from " + ckpt + "/step_10: its save finished");
  ASSERT_FALSE(line.empty()) << describe(r);
  EXPECT_NE(line.find(names), std::string::npos) << names << " is not named: " << line;
  EXPECT_NE(line.find("nothing pruned or deleted"), std::string::npos) << line;
  EXPECT_NE(line.find("The older complete checkpoint " + ckpt + "/step_5 is 5 steps behind it"), std::string::npos)
      << line;
  EXPECT_NE(line.find("(mv " + ckpt + "/step_10 " + ckpt + "/damaged-step_10)"), std::string::npos) << line;
  EXPECT_FALSE(fs::exists(run + "/pwned")) << "the pickle's reduce ran";
}

class DamagedCheckpoint : public ::testing::TestWithParam<std::tuple<Format, size_t>> {};

}  // namespace

// resume: auto stops on the damaged step_10 rather than taking step_5; resume: step_10 stops with
// the same message; neither run changes a file (keep_checkpoints: 1 would prune step_5).
TEST_P(DamagedCheckpoint, StopsNamingItAndTheOlderOneAndPrunesNothing) {
  const auto [format, which] = GetParam();
  const Damage& damage = kDamages[which];
  const bool python =
      format == Format::kDcp &&
      (damage.name == "TwoToTheFortyRows" || damage.name == "OffsetsPastTheEnd" || damage.name == "RenamedModelKey");
  if (python) {
    FSDP_SKIP_WITHOUT_PYTHON();
  }
  TempDir tmp;
  const std::string run = tmp / "run";
  fs::copy(pristine(format), run, fs::copy_options::recursive);
  const std::string names = damage.apply(format, run);
  ASSERT_FALSE(names.empty());
  const std::map<std::string, std::string> before = snapshot(run + "/ckpt");
  const std::string metrics = read_file(run + "/m0.jsonl");

  RunResult automatic =
      fsdprun.run(under_fsdprun(2, run_args(format, run, 15, {"--training.keep_checkpoints=1"})), {}, 180);
  expect_stopped(automatic, run, "training.resume: auto: ", names);
  EXPECT_EQ(snapshot(run + "/ckpt"), before) << "a file of the checkpoint directory changed";
  EXPECT_EQ(read_file(run + "/m0.jsonl"), metrics);

  RunResult by_path = fsdprun.run(
      under_fsdprun(2, run_args(format, run, 15,
                                {"--training.keep_checkpoints=1", "--training.resume=" + run + "/ckpt/step_10"})),
      {}, 180);
  expect_stopped(by_path, run, "training.resume: ", names);
  const std::string from = "cannot resume from " + run + "/ckpt/step_10";
  EXPECT_EQ(line_from(by_path, from), line_from(automatic, from)) << "not the same message";
  EXPECT_EQ(snapshot(run + "/ckpt"), before) << "a file of the checkpoint directory changed";
}

INSTANTIATE_TEST_SUITE_P(BothFormats, DamagedCheckpoint,
                         ::testing::Combine(::testing::Values(Format::kFsdp, Format::kDcp),
                                            ::testing::Range<size_t>(0, kDamages.size())),
                         [](const ::testing::TestParamInfo<DamagedCheckpoint::ParamType>& info) {
                           return std::string(std::get<0>(info.param) == Format::kDcp ? "Dcp" : "Fsdp") +
                                  kDamages[std::get<1>(info.param)].name;
                         });

// The way on that the message gives: moved aside, the damaged checkpoint is neither read nor
// pruned nor overwritten, and resume: auto continues from step_5 (the run saves step_10 and
// step_15 anew and keeps one).
TEST(DamagedCheckpointMovedAside, ResumesFromTheOlderOneAndKeepsTheDamagedOneWhereItWasMoved) {
  for (Format format : {Format::kFsdp, Format::kDcp}) {
    SCOPED_TRACE(format == Format::kDcp ? "dcp" : "fsdp");
    TempDir tmp;
    const std::string run = tmp / "run";
    fs::copy(pristine(format), run, fs::copy_options::recursive);
    truncate(run + "/ckpt/step_10/" + (format == Format::kDcp ? "__0_0.distcp" : "rank_0.data"));
    fs::rename(run + "/ckpt/step_10", run + "/ckpt/damaged-step_10");
    const std::map<std::string, std::string> damaged = snapshot(run + "/ckpt/damaged-step_10");
    RunResult r = fsdprun.run(under_fsdprun(2, run_args(format, run, 15, {"--training.keep_checkpoints=1"})), {}, 180);
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    EXPECT_TRUE(contains(r, "resumed from " + run + "/ckpt/step_5 at step 5")) << describe(r);
    EXPECT_TRUE(fs::exists(run + "/ckpt/step_15"));
    EXPECT_FALSE(fs::exists(run + "/ckpt/step_5")) << "keep_checkpoints: 1 prunes the older ones";
    EXPECT_EQ(snapshot(run + "/ckpt/damaged-step_10"), damaged);
  }
}

// Checkpoints Python's dcp.save wrote that fsdp-train cannot read: another optimizer's state
// (SGD's momentum buffers), and no train_state. As ckpt/step_15 beside fsdp-train's step_10,
// resume: auto stops naming it rather than taking step_10, and so does a path to it.
TEST(DamagedCheckpointFromPython, AnUnknownOptimizerOrNoTrainStateStopsNamingIt) {
  FSDP_SKIP_WITHOUT_PYTHON();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"sgd", "has no key 'optimizer.param_groups.0.amsgrad' (was it saved by another optimizer than Adam/AdamW?)"},
      {"no_train_state", "train_state.step"}};
  for (const auto& [mode, names] : cases) {
    SCOPED_TRACE(mode);
    TempDir tmp;
    const std::string run = tmp / "run";
    fs::copy(pristine(Format::kDcp), run, fs::copy_options::recursive);
    write_text(run + "/resave.py",
               "import sys, torch, torch.distributed.checkpoint as dcp\n"
               "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
               "src, dst, mode = sys.argv[1:4]\n"
               "dcp_to_torch_save(src, dst + '.pt')\n"
               "sd = torch.load(dst + '.pt', weights_only=False)\n"
               "if mode == 'no_train_state':\n"
               "    del sd['train_state']\n"
               "else:\n"
               "    opt = sd['optimizer']\n"
               "    opt['state'] = {k: {'momentum_buffer': v['exp_avg']} for k, v in opt['state'].items()}\n"
               "    opt['param_groups'] = [{'lr': 0.1, 'momentum': 0.9, 'dampening': 0.0, 'weight_decay': 0.0,\n"
               "                            'nesterov': False, 'params': g['params']} for g in opt['param_groups']]\n"
               "dcp.save(sd, checkpoint_id=dst)\n");
    ASSERT_EQ(run_python(run + "/resave.py", {run + "/ckpt/step_10", run + "/ckpt/step_15", mode}), 0);
    fs::remove(run + "/ckpt/step_15.pt");
    const std::map<std::string, std::string> before = snapshot(run + "/ckpt");
    for (const std::string& setting : {std::string("auto"), run + "/ckpt/step_15"}) {
      RunResult r = fsdprun.run(
          under_fsdprun(
              2, run_args(Format::kDcp, run, 20, {"--training.keep_checkpoints=1", "--training.resume=" + setting})),
          {}, 180);
      EXPECT_EQ(r.exit_code, 1) << describe(r);
      const std::string line = line_from(r, "cannot resume from " + run + "/ckpt/step_15: its save finished");
      ASSERT_FALSE(line.empty()) << describe(r);
      EXPECT_NE(line.find(names), std::string::npos) << line;
      EXPECT_NE(line.find("The older complete checkpoint " + run + "/ckpt/step_10 is 5 steps behind it"),
                std::string::npos)
          << line;
      EXPECT_EQ(snapshot(run + "/ckpt"), before);
    }
  }
}
