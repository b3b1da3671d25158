// End-to-end tests of fsdp-train when something is wrong: broken checkpoints on resume, a rank
// that cannot read the chosen checkpoint, a non-finite step, a failed background save,
// init_from files as Python writes them, damaged token files, and the collective timeout. Real
// processes, mostly two ranks under fsdprun, since the faults are distributed.
#include "process_harness.h"
#include "trainer_runs.h"

#include "../file_size_limit.h"
#include "../python_path.h"
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <regex>
#include <string>
#include <vector>

using namespace process_test;
using namespace trainer_test;
namespace fs = std::filesystem;

namespace {

// fsdprun exits 1 when its group fails and names the first worker's exit code.
void expect_workers_exited(const RunResult& r, int code) {
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_TRUE(contains(r, "exited with code " + std::to_string(code))) << describe(r);
  EXPECT_FALSE(contains(r, "frame #")) << "a C++ backtrace was printed\n" << describe(r);
}

// 20 steps at W=2 with a checkpoint every 5 steps, keeping 2: ckpt/step_15 and ckpt/step_20.
std::vector<std::string> keep_two(const std::string& dir, int steps) {
  return with(base_args(dir, steps), {"--training.keep_checkpoints=2"});
}

const TempDir& twenty_steps() {
  static TempDir dir;
  static bool done = [] {
    RunResult r = fsdprun.run(under_fsdprun(2, keep_two(dir.path(), 20)), {}, 120);
    EXPECT_EQ(r.exit_code, 0) << describe(r);
    return true;
  }();
  (void)done;
  return dir;
}

// A copy of the 20-step run's directory (checkpoints and metrics) in `to`.
void copy_twenty_steps(const std::string& to) {
  fs::copy(twenty_steps().path(), to, fs::copy_options::recursive);
  ASSERT_TRUE(fs::exists(to + "/ckpt/step_15/metadata.json"));
  ASSERT_TRUE(fs::exists(to + "/ckpt/step_20/metadata.json"));
}

// ------------------------------------------------------------------ resume: auto with broken checkpoints

// The defect: this exited 0, restarted at step 1, truncated the metrics and pruned step_15.
TEST(TrainerFaults, ResumeAutoWithAnIncompleteLatestUsesTheNewestCompleteCheckpoint) {
  TempDir tmp;
  const std::string dir = tmp / "run";
  copy_twenty_steps(dir);
  fs::remove(dir + "/ckpt/step_20/metadata.json");
  RunResult r = fsdprun.run(under_fsdprun(2, keep_two(dir, 25)), {}, 120);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_TRUE(contains(r, "resume: found " + dir + "/ckpt/latest names 'step_20', which")) << describe(r);
  EXPECT_TRUE(contains(r, "resume: using " + dir + "/ckpt/step_15, the newest complete checkpoint")) << describe(r);
  EXPECT_TRUE(contains(r, "resumed from " + dir + "/ckpt/step_15 at step 15")) << describe(r);
  // The metrics are appended to: steps 1-20 of the first run, then 16-25.
  std::vector<int64_t> want;
  for (int64_t s = 1; s <= 20; ++s) want.push_back(s);
  for (int64_t s = 16; s <= 25; ++s) want.push_back(s);
  EXPECT_EQ(steps_in(dir + "/m0.jsonl"), want);
  EXPECT_TRUE(fs::exists(dir + "/ckpt/step_20/metadata.json"));  // saved again
  EXPECT_TRUE(fs::exists(dir + "/ckpt/step_25/metadata.json"));
  EXPECT_EQ(read_file(dir + "/ckpt/latest").substr(0, 7), "step_25");
}

TEST(TrainerFaults, ResumeAutoWithABrokenLatestFileUsesTheNewestCompleteCheckpoint) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"missing target", "step_99\n"}, {"empty", ""}, {"garbage", std::string("\x01\xff garbage\n\n", 12)}};
  for (const auto& [name, latest] : cases) {
    SCOPED_TRACE(name);
    TempDir tmp;
    const std::string dir = tmp / "run";
    copy_twenty_steps(dir);
    write_text(dir + "/ckpt/latest", latest);
    RunResult r = fsdprun.run(under_fsdprun(2, keep_two(dir, 22)), {}, 120);
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    EXPECT_TRUE(contains(r, "resume: found " + dir + "/ckpt/latest")) << describe(r);
    EXPECT_TRUE(contains(r, "resumed from " + dir + "/ckpt/step_20 at step 20")) << describe(r);
    EXPECT_EQ(steps_in(dir + "/m0.jsonl").size(), 22u);  // 20 kept + 21, 22
  }
}

// A `latest` that leads elsewhere is not read, and nothing of what it leads to is printed.
TEST(TrainerFaults, ALatestThatIsASymbolicLinkIsNotReadNorQuoted) {
  TempDir tmp;
  const std::string dir = tmp / "run";
  copy_twenty_steps(dir);
  fs::remove(dir + "/ckpt/latest");
  fs::create_symlink("/etc/passwd", dir + "/ckpt/latest");
  RunResult r = fsdprun.run(under_fsdprun(2, keep_two(dir, 22)), {}, 120);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_TRUE(contains(r, dir + "/ckpt/latest is a symbolic link, not the file a save writes; it is not read"))
      << describe(r);
  EXPECT_TRUE(contains(r, "resumed from " + dir + "/ckpt/step_20 at step 20")) << describe(r);
  EXPECT_FALSE(contains(r, "root:")) << describe(r);
}

// A checksum that fails is found only by loading: the run stops, naming the older checkpoint
// (test_trainer_damaged_checkpoints.cpp has every kind of damage, in both formats).
TEST(TrainerFaults, ACorruptedLatestCheckpointNamesTheOlderCompleteOne) {
  TempDir tmp;
  const std::string dir = tmp / "run";
  copy_twenty_steps(dir);
  for (const char* file : {"/ckpt/step_20/rank_0.data", "/ckpt/step_20/rank_1.data"}) {
    std::string bytes = read_file(dir + file);
    ASSERT_GT(bytes.size(), 100u);
    bytes[bytes.size() / 2] ^= 0x5a;  // same size: the scan sees a complete checkpoint
    write_text(dir + file, bytes);
  }
  RunResult r = fsdprun.run(under_fsdprun(2, keep_two(dir, 22)), {}, 120);
  expect_workers_exited(r, 1);
  EXPECT_TRUE(contains(r, "training.resume: auto: cannot resume from " + dir + "/ckpt/step_20: its save finished"))
      << describe(r);
  EXPECT_TRUE(contains(r, "rank 1: error: cannot load the checkpoint " + dir + "/ckpt/step_20")) << describe(r);
  EXPECT_TRUE(contains(r, "The older complete checkpoint " + dir + "/ckpt/step_15 is 5 steps behind it"))
      << describe(r);
  RunResult older =
      fsdprun.run(under_fsdprun(2, with(keep_two(dir, 17), {"--training.resume=" + dir + "/ckpt/step_15"})), {}, 120);
  ASSERT_EQ(older.exit_code, 0) << describe(older);
  EXPECT_TRUE(contains(older, "resumed from " + dir + "/ckpt/step_15 at step 15")) << describe(older);
}

TEST(TrainerFaults, ResumeAutoWithNoCompleteCheckpointStopsAndStartsNothingOver) {
  TempDir tmp;
  const std::string dir = tmp / "run";
  copy_twenty_steps(dir);
  fs::remove(dir + "/ckpt/step_15/metadata.json");
  fs::remove(dir + "/ckpt/step_20/metadata.json");
  const std::string metrics_before = read_file(dir + "/m0.jsonl");
  RunResult r = fsdprun.run(under_fsdprun(2, keep_two(dir, 25)), {}, 120);
  expect_workers_exited(r, 1);
  EXPECT_TRUE(contains(r, "training.resume: auto: " + dir + "/ckpt holds checkpoints but none is complete"))
      << describe(r);
  EXPECT_TRUE(contains(r, dir + "/ckpt/step_15")) << describe(r);
  EXPECT_TRUE(contains(r, "Nothing was started and nothing deleted")) << describe(r);
  EXPECT_TRUE(contains(r, "rank 1: error: rank 0 found no checkpoint to resume from")) << describe(r);
  EXPECT_EQ(read_file(dir + "/m0.jsonl"), metrics_before);  // not truncated
  for (const char* step : {"step_15", "step_20"})
    EXPECT_TRUE(fs::exists(dir + "/ckpt/" + step + "/rank_0.data")) << step << " was deleted";

  // Only a `latest` file, naming nothing usable, is still a trace of an earlier run.
  fs::remove_all(dir + "/ckpt/step_15");
  fs::remove_all(dir + "/ckpt/step_20");
  write_text(dir + "/ckpt/latest", "garbage\n");
  RunResult only_latest = trainer.run(keep_two(dir, 25), {}, 60);
  EXPECT_EQ(only_latest.exit_code, 1) << describe(only_latest);
  EXPECT_TRUE(contains(only_latest, "holds checkpoints but none is complete")) << describe(only_latest);
  // Described, not quoted: content that is not a step name may be any file's.
  EXPECT_TRUE(contains(only_latest, dir + "/ckpt/latest does not hold a step_<N> name (7 bytes, not shown)"))
      << describe(only_latest);
  EXPECT_FALSE(contains(only_latest, "garbage")) << describe(only_latest);
}

// A path that holds no finished save is the configuration's mistake; a damaged checkpoint's stop
// is test_trainer_damaged_checkpoints.cpp's.
TEST(TrainerFaults, ResumeFromAnIncompleteCheckpointPathIsAConfigurationError) {
  TempDir tmp;
  const std::string dir = tmp / "run";
  copy_twenty_steps(dir);
  fs::remove(dir + "/ckpt/step_20/metadata.json");
  RunResult r = trainer.run(with(keep_two(dir, 25), {"--training.resume=" + dir + "/ckpt/step_20"}), {}, 60);
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_TRUE(contains(r, "training.resume: not a complete checkpoint: " + dir + "/ckpt/step_20 has no metadata.json"))
      << describe(r);
}

// model.init_from decides the architecture: a path that does not exist is named first, by the
// trainer, its eval and the plan alike, not reported as a sequence longer than the default
// preset's model allows.
TEST(TrainerFaults, AnInitFromThatDoesNotExistIsNamedBeforeAnythingItWouldShape) {
  TempDir tmp;
  const std::string missing = tmp / "no_such_model";
  const std::vector<std::string> args =
      with(base_args(tmp.path(), 1), {"--model.init_from=" + missing, "--training.seq_len=4096"});
  std::vector<std::string> eval = {"eval"}, plan = {"plan"};
  eval.insert(eval.end(), args.begin(), args.end());
  plan.insert(plan.end(), args.begin(), args.end());
  plan.insert(plan.end(), {"--world", "1"});
  for (const auto& command : {args, eval, plan}) {
    SCOPED_TRACE(command[0]);
    const RunResult r = trainer.run(command, {}, 60);
    EXPECT_EQ(r.exit_code, 2) << describe(r);
    EXPECT_TRUE(contains(r, "model.init_from: " + missing + " does not exist")) << describe(r);
    EXPECT_FALSE(contains(r, "seq_len")) << describe(r);
  }
}

// Every destination the run writes is checked before the model is built: each case stops with a
// configuration error naming the key and the path, and no step is trained (before, an export
// that could not be written failed only after the whole run, its weights lost).
TEST(TrainerFaults, AnOutputThatCannotBeWrittenStopsTheRunBeforeTheFirstStep) {
  TempDir tmp;
  const std::string file = tmp / "a_file";
  write_text(file, "not a folder\n");
  fs::create_directories(tmp / "a_folder");
  const std::string llama_json = configs_dir() + "/llama/config.json";
  struct Case {
    std::string key, path;
    std::vector<std::string> args;
    std::string why;
  };
  const std::vector<Case> cases = {
      {"training.export", file, {"--training.export=hf:" + file}, file + " exists and is not a folder"},
      {"training.export",
       file + "/model.pt",
       {"--training.export=" + file + "/model.pt"},
       file + "/model.pt cannot be created: " + file + " is not a folder"},
      {"training.export",
       "/proc/fsdp-train-export",
       {"--training.export=/proc/fsdp-train-export/model.pt"},
       "cannot be written: writing in /proc fails"},
      {"training.export",
       tmp / "a_folder",
       {"--training.export=" + tmp / "a_folder"},
       tmp / "a_folder is a folder, not a file"},
      {"logging.jsonl", file, {"--logging.jsonl=" + file + "/m{rank}.jsonl"}, "is not a folder"},
      {"logging.tensorboard_dir", file, {"--logging.tensorboard_dir=" + file}, "exists and is not a folder"},
      {"logging.summary_json", tmp / "a_folder", {"--logging.summary_json=" + tmp / "a_folder"}, "is a folder"},
      {"logging.trace_dir", file, {"--logging.trace=true", "--logging.trace_dir=" + file}, "is not a folder"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args[0]);
    const std::string run = tmp / ("run" + std::to_string(&c - cases.data()));
    std::vector<std::string> args = with(base_args(run, 3), {"--fsdp_config.checkpoint_interval=0"});
    if (c.args[0].rfind("--training.export=hf:", 0) == 0) {
      args = {configs_dir() + "/llama.yaml",
              "--data.source=synthetic",
              "--model.hf_config=" + llama_json,
              "--training.steps=3",
              "--training.micro_batch_size=1",
              "--training.seq_len=32",
              "--fsdp_config.checkpoint_interval=0",
              "--fsdp_config.checkpoint_dir=" + run + "/ckpt",
              "--logging.jsonl=" + run + "/m{rank}.jsonl",
              "--logging.progress=off",
              "--sample.length=0"};
    }
    args = with(args, c.args);
    const RunResult r = fsdprun.run(under_fsdprun(2, args), {}, 120);
    EXPECT_NE(r.exit_code, 0) << describe(r);
    EXPECT_TRUE(contains(r, "configuration error: an output of the run cannot be written, found before the first step"))
        << describe(r);
    EXPECT_TRUE(contains(r, c.key + ": " + c.path)) << describe(r);
    EXPECT_TRUE(contains(r, c.why)) << describe(r);
    EXPECT_EQ(last_step_in(run + "/m0.jsonl"), 0) << describe(r);
  }
}

// A full disk at the end: the checkpoint of the last step (which checkpoint_interval 0 would not
// have written) goes first, the export then fails, and the error names the checkpoint, from
// which the export is made again without training. W = 4, so that each rank's checkpoint file
// (a quarter of the parameters and of AdamW's two moments) is smaller than the exported model;
// the "disk" is a limit on the size of any file the run writes.
TEST(TrainerFaults, AnExportThatFailsAtTheEndNamesTheCheckpointThatHoldsTheLastStep) {
  TempDir tmp;
  auto args = [&](const std::string& name) {
    return with(base_args(tmp / name, 3),
                {"--fsdp_config.checkpoint_interval=0", "--training.export=" + tmp / name + "/model.pt"});
  };
  const RunResult a = fsdprun.run(under_fsdprun(4, args("a")), {}, 240);
  ASSERT_EQ(a.exit_code, 0) << describe(a);
  const std::string step3 = tmp / "a/ckpt/step_3";
  ASSERT_TRUE(fs::exists(step3 + "/metadata.json")) << "no checkpoint of the last step before the export\n"
                                                    << describe(a);
  const uintmax_t exported = fs::file_size(tmp / "a/model.pt");
  uintmax_t largest = 0;
  for (const auto& entry : fs::directory_iterator(step3)) largest = std::max(largest, fs::file_size(entry.path()));
  ASSERT_LT(largest, exported * 85 / 100) << "the checkpoint's files must fit under the limit the export passes";

  std::unique_ptr<Process> b;
  {
    fsdp_test::FileSizeLimit full(static_cast<rlim_t>((largest + exported) / 2));
    b = std::make_unique<Process>(fsdprun.path(), under_fsdprun(4, args("b")));
  }
  const RunResult failed = b->wait(240);
  EXPECT_EQ(failed.exit_code, 1) << describe(failed);
  const std::string checkpoint = tmp / "b/ckpt/step_3";
  EXPECT_TRUE(contains(failed, "training.export " + tmp / "b/model.pt failed: ")) << describe(failed);
  EXPECT_TRUE(contains(failed, "nothing trained is lost: the checkpoint " + checkpoint + " holds step 3"))
      << describe(failed);
  EXPECT_TRUE(fs::exists(checkpoint + "/metadata.json")) << describe(failed);
  EXPECT_FALSE(fs::exists(tmp / "b/model.pt"));

  const RunResult again = fsdprun.run(under_fsdprun(4, with(args("b"), {"--training.resume=" + checkpoint})), {}, 240);
  ASSERT_EQ(again.exit_code, 0) << describe(again);
  EXPECT_TRUE(contains(again, "training already complete at step 3")) << describe(again);
  ASSERT_TRUE(fs::exists(tmp / "b/model.pt"));
  EXPECT_EQ(fs::file_size(tmp / "b/model.pt"), exported);
}

// Node-local disks: rank 1 runs in another directory, so the relative checkpoint_dir that rank
// 0 resumes from does not exist there. Every rank stops, naming rank 1 and the checkpoint.
TEST(TrainerFaults, ARankThatCannotReadTheChosenCheckpointStopsEveryRankNamingIt) {
  TempDir tmp;
  const std::string dir = tmp / "run";
  copy_twenty_steps(dir);
  fs::create_directories(tmp / "elsewhere");
  write_text(tmp / "rank1_elsewhere.sh",
             "#!/bin/sh\nif [ \"$LOCAL_RANK\" = 1 ]; then cd \"$ELSEWHERE\" || exit 99; fi\nexec \"$@\"\n", true);
  std::vector<std::string> args = {"--standalone", "--nproc-per-node", "2", tmp / "rank1_elsewhere.sh", trainer.path()};
  for (const auto& a : with(keep_two(dir, 25), {"--fsdp_config.checkpoint_dir=ckpt"})) args.push_back(a);
  RunResult r = fsdprun.run(args, {{"ELSEWHERE", tmp / "elsewhere"}}, 120, dir);
  expect_workers_exited(r, 1);
  for (const char* rank : {"rank 0", "rank 1"}) {
    EXPECT_TRUE(contains(r, std::string(rank) + ": error: cannot resume from ckpt/step_20, which rank 0 chose: rank 1: "
                                                "ckpt/step_20"))
        << rank << "\n"
        << describe(r);
  }
}

// ------------------------------------------------------------------ a non-finite step

// The defect, as reported: configs/gpl3.yaml at W=2 with lr 1e3 and a checkpoint every step
// saved a step whose gradient norm was not finite, and named it as the last checkpoint.
TEST(TrainerFaults, ANonFiniteStepIsNeitherAppliedNorSavedAndTheLastGoodCheckpointResumes) {
  FSDP_SKIP_WITHOUT_PYTHON();
  TempDir dir;
  RunResult tok = trainer.run({"tokenize", "/usr/share/common-licenses/GPL-3", dir / "gpl3.tokens"}, {}, 30);
  ASSERT_EQ(tok.exit_code, 0) << describe(tok);
  const auto args = [&](int steps, const std::string& lr) {
    return std::vector<std::string>{configs_dir() + "/gpl3.yaml",
                                    "--data.path=" + dir / "gpl3.tokens",
                                    "--optimizer.lr=" + lr,
                                    "--fsdp_config.checkpoint_interval=1",
                                    "--fsdp_config.checkpoint_dir=" + dir / "ckpt",
                                    "--training.keep_checkpoints=0",
                                    "--training.steps=" + std::to_string(steps),
                                    "--logging.jsonl=" + dir / "m{rank}.jsonl",
                                    "--logging.progress=off",
                                    "--training.export=none",
                                    "--sample.length=0"};
  };
  RunResult r = fsdprun.run(under_fsdprun(2, args(20, "1e3")), {}, 180);
  expect_workers_exited(r, 3);
  std::smatch m;
  const std::string out = r.out;
  ASSERT_TRUE(std::regex_search(out, m,
                                std::regex("stopping at step ([0-9]+): the loss is (\\S+) and the gradient "
                                           "norm is (\\S+) \\(non-finite\\)")))
      << describe(r);
  const int bad = std::stoi(m[1]);
  ASSERT_GE(bad, 2) << "the first step already failed: no checkpoint to check";
  EXPECT_TRUE(contains(r, "this step was not applied (no optimizer step) and nothing of it is saved")) << describe(r);
  const std::string good = dir / ("ckpt/step_" + std::to_string(bad - 1));
  EXPECT_TRUE(contains(r, "The last good checkpoint is " + good + ".")) << describe(r);
  // Clipping is on (max_grad_norm 1.0): the advice does not tell to set it.
  EXPECT_FALSE(contains(r, "or set training.max_grad_norm")) << describe(r);
  EXPECT_TRUE(contains(r, "clipping at training.max_grad_norm cannot help")) << describe(r);
  for (int s = bad; s <= 20; ++s) EXPECT_FALSE(fs::exists(dir / ("ckpt/step_" + std::to_string(s)))) << s;
  for (const char* file : {"m0.jsonl", "m1.jsonl"}) {
    const auto metrics = read_metrics(dir / file);
    ASSERT_EQ(metrics.rbegin()->first, bad - 1) << file;  // the bad step is not logged as done
    for (const auto& [step, v] : metrics) EXPECT_TRUE(std::isfinite(v.loss) && std::isfinite(v.grad_norm)) << step;
  }
  // The checkpoint named good is: it loads, and the model it holds (exported by a run that is
  // already complete at that step) has finite weights only.
  const auto done = with(args(bad - 1, "1e3"), {"--training.export=" + dir / "good.pt"});
  RunResult again = fsdprun.run(under_fsdprun(2, done), {}, 180);
  ASSERT_EQ(again.exit_code, 0) << describe(again);
  EXPECT_TRUE(contains(again, "resumed from " + good + " at step " + std::to_string(bad - 1))) << describe(again);
  write_text(dir / "finite.py",
             "import sys, torch\nsd = torch.load(sys.argv[1])\n"
             "assert all(torch.isfinite(t).all() for t in sd.values())\n");
  EXPECT_EQ(run_python(dir / "finite.py", {dir / "good.pt"}), 0);
}

// ------------------------------------------------------------------ a failed background save

// A regular file where the checkpoint of step 10 goes makes its background save fail on every
// rank; the run stops at a step after it, the same on both ranks, with one line per rank, and
// step 5 stays resumable.
TEST(TrainerFaults, AFailedBackgroundSaveStopsEveryRankWithOneLineEachAndStep5Resumes) {
  TempDir dir;
  fs::create_directories(dir / "ckpt");
  write_text(dir / "ckpt/step_10", "in the way\n");
  const auto args = with(base_args(dir.path(), 40), {"--training.resume=never"});
  RunResult r = fsdprun.run(under_fsdprun(2, args), {}, 120);
  expect_workers_exited(r, 1);
  for (const char* rank : {"rank 0", "rank 1"})
    EXPECT_TRUE(contains(r, std::string(rank) + ": saving the checkpoint of step 10 failed: ")) << rank << "\n"
                                                                                                << describe(r);
  EXPECT_TRUE(contains(r, "the last complete checkpoint is " + dir / "ckpt/step_5")) << describe(r);
  const int64_t stopped = last_step_in(dir / "m0.jsonl");
  EXPECT_GE(stopped, 10);
  EXPECT_LT(stopped, 40);
  EXPECT_EQ(last_step_in(dir / "m1.jsonl"), stopped) << "the ranks stopped at different steps";
  EXPECT_TRUE(fs::exists(dir / "ckpt/step_5/metadata.json"));

  fs::remove(dir / "ckpt/step_10");
  RunResult again = fsdprun.run(under_fsdprun(2, base_args(dir.path(), 40)), {}, 120);
  ASSERT_EQ(again.exit_code, 0) << describe(again);
  EXPECT_TRUE(contains(again, "resumed from " + dir / "ckpt/step_5 at step 5")) << describe(again);
}

// ------------------------------------------------------------------ model.init_from as Python writes it

// A Python model with the trainer's architecture and parameter names (base_args: 2 layers, dim
// 64, vocab 64, max_seq_len 64), randomly initialised; its state_dict() saved as is (an
// OrderedDict) and in the bundles training scripts write.
const char* kPythonModel = R"(import sys, torch, torch.nn as nn
class Attention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        for name in ('wq', 'wk', 'wv', 'wo'): setattr(self, name, nn.Linear(dim, dim, bias=False))
class FeedForward(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.w1, self.w2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.attention_norm, self.attention = nn.LayerNorm(dim), Attention(dim)
        self.ffn_norm, self.feed_forward = nn.LayerNorm(dim), FeedForward(dim)
class Transformer(nn.Module):
    def __init__(self, n_layers=2, vocab=64, max_seq_len=64, dim=64):
        super().__init__()
        self.tok_embeddings, self.pos_embeddings = nn.Embedding(vocab, dim), nn.Embedding(max_seq_len, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(n_layers))
        self.norm, self.output = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)
torch.manual_seed(7)
model = Transformer()
with torch.no_grad():
    for p in model.parameters(): p.normal_(0, 0.05)
sd = model.state_dict()
assert type(sd).__name__ == 'OrderedDict'
out = sys.argv[1]
torch.save(sd, out + '/ordered_dict.pt')
torch.save({'model': sd, 'step': 3}, out + '/model_bundle.pt')
torch.save({'state_dict': sd, 'optimizer': {}}, out + '/state_dict_bundle.pt')
bad = model.state_dict()
bad['norm.weight'][3] = float('nan')
torch.save(bad, out + '/nan.pt')
)";

const char* kPythonCompare = R"(import sys, torch
a, b = torch.load(sys.argv[1]), torch.load(sys.argv[2])
a = a.get('model', a.get('state_dict', a))
assert list(a.keys()) == list(b.keys()), (list(a.keys()), list(b.keys()))
for k in a: assert torch.allclose(a[k], b[k], rtol=0, atol=1e-20), k
print('OK', len(a))
)";

TEST(TrainerFaults, InitFromReadsPythonStateDictsAndBundles) {
  FSDP_SKIP_WITHOUT_PYTHON();
  TempDir dir;
  write_text(dir / "model.py", kPythonModel);
  write_text(dir / "compare.py", kPythonCompare);
  ASSERT_EQ(run_python(dir / "model.py", {dir.path()}), 0);
  for (const char* name : {"ordered_dict", "model_bundle", "state_dict_bundle"}) {
    SCOPED_TRACE(name);
    const std::string file = dir / (std::string(name) + ".pt"), out = dir / (std::string(name) + ".out.pt");
    const auto args =
        with(base_args(dir / name, 1), {"--model.init_from=" + file, "--optimizer.lr=1e-30", "--schedule.min_lr=0",
                                        "--fsdp_config.checkpoint_interval=0", "--training.export=" + out});
    RunResult r = fsdprun.run(under_fsdprun(2, args), {}, 120);
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    EXPECT_EQ(run_python(dir / "compare.py", {file, out}), 0);  // a vanishing step exports the same weights
    // What a bundle holds besides the state dict is said, not silently dropped.
    const std::string ignored = std::string(name) == "model_bundle"        ? "'step' (int)"
                                : std::string(name) == "state_dict_bundle" ? "'optimizer' (dict)"
                                                                           : "";
    EXPECT_EQ(contains(r, "these entries are ignored (nothing of them runs): " + ignored), !ignored.empty())
        << describe(r);
  }
}

// The advice used to be "set training.max_grad_norm" even when it was set; weights that are
// not finite cannot train at all, so the file is refused naming the tensor.
TEST(TrainerFaults, InitFromWithNonFiniteWeightsIsRefusedNamingTheFileAndTensor) {
  FSDP_SKIP_WITHOUT_PYTHON();
  TempDir dir;
  write_text(dir / "model.py", kPythonModel);
  ASSERT_EQ(run_python(dir / "model.py", {dir.path()}), 0);
  RunResult r = trainer.run(with(base_args(dir.path(), 3), {"--model.init_from=" + dir / "nan.pt"}), {}, 60);
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_TRUE(contains(r, "model.init_from " + dir / "nan.pt" +
                              ": 1 tensor(s) hold NaN or infinite values: "
                              "norm.weight (1 of 64)"))
      << describe(r);
  EXPECT_FALSE(contains(r, "max_grad_norm")) << describe(r);
  EXPECT_EQ(last_step_in(dir / "m0.jsonl"), 0);
}

// A safetensors directory is read a rank's rows at a time: the rank whose rows hold a NaN names
// it, and every rank stops with that line before training (none waits in a collective).
TEST(TrainerFaults, InitFromSafetensorsWithANaNInOneRanksRowsStopsEveryRankNamingIt) {
  FSDP_SKIP_WITHOUT_PYTHON();
  TempDir dir;
  RunResult a = fsdprun.run(
      under_fsdprun(2, with(base_args(dir / "a", 1),
                            {"--fsdp_config.checkpoint_interval=0", "--training.export=" + dir / "a.safetensors"})),
      {}, 120);
  ASSERT_EQ(a.exit_code, 0) << describe(a);
  // The last element of norm.weight (64 values): rank 1's rows at W=2.
  write_text(dir / "poison.py",
             "import json, struct, sys\n"
             "d = sys.argv[1]\n"
             "f = d + '/' + json.load(open(d + '/model.safetensors.index.json'))['weight_map']['norm.weight']\n"
             "b = bytearray(open(f, 'rb').read())\n"
             "n = struct.unpack('<Q', b[:8])[0]\n"
             "begin, end = json.loads(b[8:8 + n])['norm.weight']['data_offsets']\n"
             "b[8 + n + end - 4:8 + n + end] = struct.pack('<f', float('nan'))\n"
             "open(f, 'wb').write(b)\n");
  ASSERT_EQ(run_python(dir / "poison.py", {dir / "a.safetensors"}), 0);
  RunResult r = fsdprun.run(
      under_fsdprun(2, with(base_args(dir / "b", 3), {"--model.init_from=" + dir / "a.safetensors"})), {}, 120);
  EXPECT_NE(r.exit_code, 0) << describe(r);
  EXPECT_TRUE(contains(r, "model.init_from " + dir / "a.safetensors" +
                              ": rank 1: 1 tensor(s) hold NaN or infinite "
                              "values in this rank's rows: norm.weight (1 of 32)"))
      << describe(r);
  EXPECT_FALSE(contains(r, "rank 0: 1 tensor(s)")) << describe(r);
  EXPECT_EQ(last_step_in(dir / "b/m0.jsonl"), 0);
}

// ------------------------------------------------------------------ damaged token files

std::string token_header(uint32_t token_bytes, uint64_t vocab, uint64_t count) {
  std::string h = std::string("FSDPTOK\0", 8);
  auto put = [&h](uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) h.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  };
  put(1, 4), put(token_bytes, 4), put(vocab, 8), put(count, 8);
  return h;
}

TEST(TrainerFaults, DamagedTokenFileHeadersNameTheFileAndWhatIsWrong) {
  TempDir dir;
  const uint64_t big = uint64_t{1} << 63;
  const std::vector<std::tuple<std::string, std::string, std::string>> cases = {
      {"vocab", token_header(2, big, 4) + std::string(8, '\0'),
       "the header's vocabulary size (offset 16) is 9223372036854775808; expected 1 to 65536"},
      {"count", token_header(2, 256, big), "the header's token count (offset 24) is 9223372036854775808"},
      {"count4", token_header(4, 256, (uint64_t{1} << 62) + 1) + std::string(4, '\0'),
       "the header's token count (offset 24) is 4611686018427387905"},
      // Valid magic, then the header stops: a truncated token file, not "not a token file".
      {"cut", token_header(2, 256, 4).substr(0, 20),
       "the token file is truncated: its header needs 32 bytes, the file has 20"},
  };
  for (const auto& [name, bytes, expected] : cases) {
    SCOPED_TRACE(name);
    const std::string file = dir / (name + ".tokens");
    write_text(file, bytes);
    RunResult r = trainer.run(
        with(base_args(dir / name, 2), {"--model.vocab_size=256", "--data.source=tokens", "--data.path=" + file}), {},
        60);
    EXPECT_EQ(r.exit_code, 1) << describe(r);
    EXPECT_TRUE(contains(r, file + ": " + expected)) << describe(r);
  }
}

// ------------------------------------------------------------------ the collective timeout

// Rank 1 starts 30 s late; with collective_timeout_s 2 rank 0 gives up after 2 s (the default
// would wait 5 minutes).
TEST(TrainerFaults, CollectiveTimeoutFromTheConfigEndsAWaitForAMissingRank) {
  TempDir dir;
  write_text(dir / "rank1_late.sh", "#!/bin/sh\nif [ \"$LOCAL_RANK\" = 1 ]; then sleep 30; fi\nexec \"$@\"\n", true);
  std::vector<std::string> args = {"--standalone", "--nproc-per-node", "2", dir / "rank1_late.sh", trainer.path()};
  for (const auto& a : with(base_args(dir.path(), 3), {"--fsdp_config.collective_timeout_s=2"})) args.push_back(a);
  RunResult r = fsdprun.run(args, {}, 60);
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_LT(r.seconds, 20) << describe(r);
  EXPECT_TRUE(contains(r, "timed out after 2000 ms")) << describe(r);
}

TEST(TrainerFaults, TheEnvironmentsTimeoutWinsOverTheKeyAndTheRunSaysSo) {
  TempDir dir;
  RunResult r = trainer.run(with(base_args(dir.path(), 1), {"--fsdp_config.collective_timeout_s=5"}),
                            {{"FSDP_COLLECTIVE_TIMEOUT_MS", "60000"}}, 60);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_TRUE(contains(r,
                       "note: FSDP_COLLECTIVE_TIMEOUT_MS=60000 in the environment sets the collective timeout; "
                       "fsdp_config.collective_timeout_s (5"))
      << describe(r);

  // The note is true: rank 1 starts 5 s late, which the key's 2 s would not wait for (see the
  // test above), and the environment's 60 s does.
  write_text(dir / "rank1_late.sh", "#!/bin/sh\nif [ \"$LOCAL_RANK\" = 1 ]; then sleep 5; fi\nexec \"$@\"\n", true);
  std::vector<std::string> args = {"--standalone", "--nproc-per-node", "2", dir / "rank1_late.sh", trainer.path()};
  for (const auto& a : with(base_args(dir / "late", 3), {"--fsdp_config.collective_timeout_s=2"})) args.push_back(a);
  RunResult late = fsdprun.run(args, {{"FSDP_COLLECTIVE_TIMEOUT_MS", "60000"}}, 120);
  EXPECT_EQ(late.exit_code, 0) << describe(late);
  EXPECT_FALSE(contains(late, "timed out")) << describe(late);
  EXPECT_TRUE(contains(late,
                       "FSDP_COLLECTIVE_TIMEOUT_MS=60000 in the environment sets the collective timeout; "
                       "fsdp_config.collective_timeout_s (2 s) is not used"))
      << describe(late);
}

// The library ignores an empty FSDP_COLLECTIVE_TIMEOUT_MS, so the key is in force and the run
// does not claim otherwise.
TEST(TrainerFaults, AnEmptyTimeoutVariableLeavesTheKeyInForce) {
  TempDir dir;
  RunResult r = trainer.run(with(base_args(dir.path(), 1), {"--fsdp_config.collective_timeout_s=5"}),
                            {{"FSDP_COLLECTIVE_TIMEOUT_MS", ""}}, 60);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_FALSE(contains(r, "FSDP_COLLECTIVE_TIMEOUT_MS")) << describe(r);
}

}  // namespace
