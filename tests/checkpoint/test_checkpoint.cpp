// Distributed checkpoints across real processes: save at one world size, load at another; what
// a damaged or incomplete checkpoint does; the latest pointer.
#include "harness/multiprocess.h"

#include <fsdp/call.h>
#include <fsdp/checkpoint.h>
#include <fsdp/distributed.h>
#include <fsdp/fully_shard.h>
#include <fsdp/models/transformer.h>
#include <fsdp/optim_state_dict.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>

#include <filesystem>
#include <random>
#include <thread>

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>
#include <fstream>

namespace fs = std::filesystem;
using fsdp::testing::run_distributed;

namespace {

// The test body runs again in every child: only the test process itself sets up and cleans up.
void remove_in_parent(const std::string& dir) {
  if (!fsdp::testing::is_child()) fs::remove_all(dir);
}

struct Trainer {
  fsdp::models::Transformer model{nullptr};
  std::unique_ptr<torch::optim::Adam> opt;

  explicit Trainer(uint64_t seed) {
    torch::manual_seed(seed);
    fsdp::models::ModelArgs args;
    args.dropout_p = 0.0;
    model = fsdp::models::Transformer(args);
    for (auto& block : model->blocks()) fsdp::fully_shard(block);
    fsdp::fully_shard(model);
    opt = std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(1e-2));
  }
  // The global batch of a step is the same at every world size; each rank takes its rows.
  double step(int64_t s) {
    const int W = fsdp::get_world_size(), r = fsdp::get_rank();
    auto gen = at::make_generator<at::CPUGeneratorImpl>(900 + s);
    at::Tensor global = at::randint(0, 8, {12, 16}, gen);  // 12 rows: divisible by 1, 2, 3, 4
    at::Tensor toks = global.slice(0, r * (12 / W), (r + 1) * (12 / W));
    opt->zero_grad();
    at::Tensor logits = fsdp::call(model, toks);
    at::Tensor loss = torch::nn::functional::cross_entropy(logits.reshape({-1, 8}), toks.roll(-1, 1).reshape({-1}));
    loss.backward();
    opt->step();
    at::Tensor mean = loss.detach().reshape({1}).clone();
    fsdp::world()->all_reduce(mean, fsdp::ReduceOp::kAvg)->wait();
    return mean.item<double>();
  }
  fsdp::ShardedStateDict state() {
    fsdp::ShardedStateDict sd;
    for (const auto& item : fsdp::sharded_state_dict(*model)) sd.insert("model." + item.key(), item.value());
    for (const auto& item : fsdp::sharded_optimizer_state_dict(*model, *opt))
      sd.insert("optim." + item.key(), item.value());
    return sd;
  }
  void load(const fsdp::ShardedStateDict& sd) {
    fsdp::ShardedStateDict model_part, optim_part;
    for (const auto& item : sd) {
      if (item.key().rfind("model.", 0) == 0) model_part.insert(item.key().substr(6), item.value());
      else optim_part.insert(item.key().substr(6), item.value());
    }
    fsdp::load_sharded_state_dict(*model, model_part);
    fsdp::load_sharded_optimizer_state_dict(*model, *opt, optim_part);
  }
};

void write_losses(const std::string& path, const std::vector<double>& losses) {
  std::ofstream f(path);
  f.precision(17);
  for (double l : losses) f << l << "\n";
}
std::vector<double> read_losses(const std::string& path) {
  std::ifstream f(path);
  std::vector<double> out;
  double l;
  while (f >> l) out.push_back(l);
  return out;
}

}  // namespace

TEST(Checkpoint, SaveAtOneWorldSizeResumeAtAnother) {
  const std::string root = fsdp::testing::shared_temp_path("ckpt_reshard");
  remove_in_parent(root);
  // Reference: an uninterrupted run at each world size b (3 steps, then 3 more). Then for every
  // (a, b) in {1,2,3,4}^2: 3 steps at a, save model + optimizer; load at b, run the 3 more.
  for (int b : {1, 2, 3, 4}) {
    run_distributed(b, [root] {
      Trainer t(0);
      for (int s = 0; s < 3; ++s) t.step(s);
      std::vector<double> after;
      for (int s = 3; s < 6; ++s) after.push_back(t.step(s));
      if (fsdp::get_rank() == 0) {
        fs::create_directories(root);
        write_losses(root + "/uninterrupted_w" + std::to_string(fsdp::get_world_size()), after);
      }
    });
  }
  for (int a : {1, 2, 3, 4}) {
    const std::string ckpt = root + "/saved_at_w" + std::to_string(a);
    run_distributed(a, [ckpt, root] {
      Trainer t(0);
      for (int s = 0; s < 3; ++s) t.step(s);
      fsdp::save_checkpoint(ckpt, t.state());
      std::vector<double> after;
      for (int s = 3; s < 6; ++s) after.push_back(t.step(s));
      // Saving changes nothing: the run goes on exactly as the uninterrupted one.
      if (fsdp::get_rank() == 0) {
        EXPECT_EQ(after, read_losses(root + "/uninterrupted_w" + std::to_string(fsdp::get_world_size())));
      }
    });
    for (int b : {1, 2, 3, 4}) {
      run_distributed(b, [ckpt, root, a] {
        const int W = fsdp::get_world_size();
        Trainer t(123);  // different weights: everything must come from the checkpoint
        fsdp::init_optimizer_state(*t.opt);
        t.load(fsdp::load_checkpoint(ckpt, t.state()));
        std::vector<double> after;
        for (int s = 3; s < 6; ++s) after.push_back(t.step(s));
        const auto reference = read_losses(root + "/uninterrupted_w" + std::to_string(W));
        ASSERT_EQ(reference.size(), after.size());
        for (size_t i = 0; i < after.size(); ++i) {
          if (W == a) EXPECT_EQ(after[i], reference[i]) << "saved at " << a << ", step " << i + 3;
          else
            EXPECT_NEAR(after[i], reference[i], 1e-6) << "saved at " << a << ", loaded at " << W << ", step " << i + 3;
        }
      });
    }
  }
  remove_in_parent(root);
}

TEST(Checkpoint, BadCheckpointsAreRejectedNamingFileAndKey) {
  const std::string root = fsdp::testing::shared_temp_path("ckpt_bad");
  remove_in_parent(root);
  run_distributed(2, [root] {
    Trainer t(0);
    t.step(0);
    const std::string good = root + "/good";
    fsdp::save_checkpoint(good, t.state());
    auto like = t.state();
    auto expect_error = [&](const std::string& dir, const std::vector<std::string>& needles) {
      try {
        fsdp::load_checkpoint(dir, like);
        ADD_FAILURE() << "expected an error for " << dir;
      } catch (const c10::Error& e) {
        for (const auto& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
      }
    };
    const auto model_before = fsdp::full_state_dict(*t.model);
    if (fsdp::get_rank() == 0) {
      auto copy = [&](const std::string& name) {
        fs::copy(good, root + "/" + name, fs::copy_options::recursive);
        return root + "/" + name;
      };
      expect_error(root + "/nowhere", {"does not exist"});
      const std::string no_meta = copy("no_meta");
      fs::remove(no_meta + "/metadata.json");
      expect_error(no_meta, {"metadata.json", "not a complete checkpoint"});
      const std::string newer = copy("newer");
      {
        std::ifstream in(newer + "/metadata.json");
        std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        text.replace(text.find("\"version\": 1"), 12, "\"version\": 9");
        std::ofstream(newer + "/metadata.json") << text;
      }
      expect_error(newer, {"format version 9"});
      const std::string truncated = copy("truncated");
      fs::resize_file(truncated + "/rank_1.data", fs::file_size(truncated + "/rank_1.data") / 2);
      expect_error(truncated, {"rank_1.data", "truncated", "' is affected"});
      const std::string corrupted = copy("corrupted");
      {
        std::fstream f(corrupted + "/rank_0.data", std::ios::in | std::ios::out | std::ios::binary);
        f.seekp(100);
        f.put('\x7f');
      }
      expect_error(corrupted, {"rank_0.data", "checksum mismatch", "key '"});
      auto missing = like;
      missing.insert("model.extra", like["model.norm.weight"]);
      try {
        fsdp::load_checkpoint(good, missing);
        ADD_FAILURE();
      } catch (const c10::Error& e) {
        EXPECT_NE(std::string(e.what()).find("missing key 'model.extra'"), std::string::npos) << e.what();
      }
      auto reshaped = like;
      reshaped["model.norm.weight"] =
          fsdp::DTensor::from_local(at::zeros({3}), like["model.norm.weight"].device_mesh(), {fsdp::Replicate()});
      try {
        fsdp::load_checkpoint(good, reshaped);
        ADD_FAILURE();
      } catch (const c10::Error& e) {
        EXPECT_NE(std::string(e.what()).find("key 'model.norm.weight' has shape [16]"), std::string::npos) << e.what();
      }
      auto retyped = like;
      retyped["model.norm.weight"] = fsdp::DTensor::from_local(
          at::zeros({16}, at::kDouble), like["model.norm.weight"].device_mesh(), {fsdp::Replicate()});
      try {
        fsdp::load_checkpoint(good, retyped);
        ADD_FAILURE();
      } catch (const c10::Error& e) {
        EXPECT_NE(std::string(e.what()).find("key 'model.norm.weight' has dtype Float"), std::string::npos) << e.what();
      }
      auto fewer = like;
      fewer.erase("model.norm.weight");
      try {
        fsdp::load_checkpoint(good, fewer);
        ADD_FAILURE();
      } catch (const c10::Error& e) {
        EXPECT_NE(std::string(e.what()).find("unexpected key 'model.norm.weight'"), std::string::npos) << e.what();
      }
    }
    fsdp::world()->barrier()->wait();
    // Nothing was loaded into the model by any of the failed loads.
    const auto model_after = fsdp::full_state_dict(*t.model);
    for (const auto& item : model_before) EXPECT_TRUE(item.value().equal(model_after[item.key()])) << item.key();
  });
  remove_in_parent(root);
}

TEST(Checkpoint, ManagerPointsAtTheLatestCompleteOneAndKeepsK) {
  const std::string root = fsdp::testing::shared_temp_path("ckpt_mgr");
  remove_in_parent(root);
  run_distributed(2, [root] {
    Trainer t(0);
    fsdp::CheckpointManager manager(root, /*keep=*/2);
    EXPECT_FALSE(manager.latest().has_value());
    for (int64_t s = 1; s <= 3; ++s) {
      t.step(s);
      manager.save(s * 10, t.state());
    }
    ASSERT_TRUE(manager.latest().has_value());
    EXPECT_EQ(fsdp::CheckpointManager::step_of(*manager.latest()), 30);
    EXPECT_FALSE(fs::exists(root + "/step_10"));
    EXPECT_TRUE(fs::exists(root + "/step_20/metadata.json"));
  });
  remove_in_parent(root);
}

// Run only by KilledDuringSaveLeavesTheLastCompleteCheckpoint, in a process it SIGKILLs: saves
// checkpoints back to back forever, printing a line after each.
TEST(CheckpointVictim, DISABLED_SaveForever) {
  const char* root = std::getenv("FSDP_VICTIM_ROOT");
  ASSERT_NE(root, nullptr);
  fsdp::init_process_group();
  Trainer t(0);
  t.step(0);
  fsdp::CheckpointManager manager(root, /*keep=*/2);
  for (int64_t step = 1;; ++step) {
    manager.save(step, t.state());
    std::printf("saved %lld\n", static_cast<long long>(step));
    std::fflush(stdout);
  }
}

TEST(Checkpoint, KilledDuringSaveLeavesTheLastCompleteCheckpoint) {
  const std::string root = fsdp::testing::shared_temp_path("ckpt_kill");
  fs::remove_all(root);
  fsdp::init_process_group();  // one process: loads need a world
  Trainer reader(5);
  fsdp::init_optimizer_state(*reader.opt);
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 20; ++trial) {
    // The victim: this binary, running only the test above.
    int out[2];
    ASSERT_EQ(::pipe(out), 0);
    const std::string exe = "/proc/self/exe", filter = "--gtest_filter=CheckpointVictim.DISABLED_SaveForever",
                      also = "--gtest_also_run_disabled_tests", env_root = "FSDP_VICTIM_ROOT=" + root;
    std::vector<char*> argv = {const_cast<char*>(exe.c_str()), const_cast<char*>(filter.c_str()),
                               const_cast<char*>(also.c_str()), nullptr};
    std::vector<char*> envp = {const_cast<char*>(env_root.c_str()), const_cast<char*>("OMP_NUM_THREADS=1"), nullptr};
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, out[1], 1);
    pid_t pid = -1;
    ASSERT_EQ(posix_spawn(&pid, exe.c_str(), &actions, nullptr, argv.data(), envp.data()), 0);
    posix_spawn_file_actions_destroy(&actions);
    ::close(out[1]);
    // Wait for its first complete save, then kill it at a random moment of the following ones.
    std::string seen;
    char buf[256];
    while (seen.find("saved") == std::string::npos) {
      const ssize_t n = ::read(out[0], buf, sizeof buf);
      ASSERT_GT(n, 0) << "the victim exited before its first save: " << seen;
      seen.append(buf, n);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(std::uniform_int_distribution<int>(0, 300000)(rng)));
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    ::close(out[0]);
    ASSERT_TRUE(WIFSIGNALED(status)) << "trial " << trial;

    // The newest complete checkpoint loads; a step directory left without metadata does not.
    fsdp::CheckpointManager manager(root, 2);
    ASSERT_TRUE(manager.latest().has_value()) << "trial " << trial;
    EXPECT_NO_THROW(fsdp::load_checkpoint(*manager.latest(), reader.state())) << "trial " << trial;
    for (const auto& e : fs::directory_iterator(root)) {
      if (e.is_directory() && !fs::exists(e.path() / "metadata.json")) {
        EXPECT_THROW(fsdp::load_checkpoint(e.path().string(), reader.state()), c10::Error);
      }
    }
  }
  fsdp::destroy_process_group();
  fs::remove_all(root);
}

TEST(Checkpoint, AsyncSaveWritesTheStagedStateAndReportsFailure) {
  const std::string root = fsdp::testing::shared_temp_path("ckpt_async");
  remove_in_parent(root);
  run_distributed(2, [root] {
    Trainer t(0);
    t.step(0);
    fsdp::CheckpointManager sync_saver(root + "/sync"), async_saver(root + "/async");
    sync_saver.save(1, t.state());
    async_saver.save_async(1, t.state());
    for (int s = 1; s < 4; ++s) t.step(s);  // training goes on, changing what was staged
    async_saver.wait();
    auto like = t.state();
    auto a = fsdp::load_checkpoint(*async_saver.latest(), like);
    auto b = fsdp::load_checkpoint(*sync_saver.latest(), like);
    for (const auto& item : a) EXPECT_TRUE(item.value().to_local().equal(b[item.key()].to_local())) << item.key();
    EXPECT_FALSE(a["model.norm.weight"].to_local().equal(like["model.norm.weight"].to_local()));

    // A background write that fails is reported by wait(), not swallowed.
    if (fsdp::get_rank() == 0) std::ofstream(root + "/a_file") << "not a directory";
    fsdp::world()->barrier()->wait();
    fsdp::CheckpointManager broken(root + "/a_file/sub");
    broken.save_async(1, t.state());
    // Every rank learns of rank 0's failure at once (no rank waits for a timeout).
    const auto start = std::chrono::steady_clock::now();
    try {
      broken.wait();
      ADD_FAILURE() << "expected the background save to fail";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("rank 0:"), std::string::npos) << e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
  });
  remove_in_parent(root);
}
