// Reading the launcher's environment: torchrun, OpenMPI and Slurm variables, and bad values.
#include <fsdp/distributed.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <csignal>
#include <cstdlib>
#include <map>
#include <string>

namespace {

// Sets variables for one test and restores the previous environment afterwards.
class ScopedEnv {
 public:
  explicit ScopedEnv(const std::map<std::string, std::string>& vars) {
    static const char* kAll[] = {"RANK",
                                 "WORLD_SIZE",
                                 "LOCAL_RANK",
                                 "LOCAL_WORLD_SIZE",
                                 "MASTER_ADDR",
                                 "MASTER_PORT",
                                 "TORCHELASTIC_RESTART_COUNT",
                                 "TORCHELASTIC_USE_AGENT_STORE",
                                 "OMPI_COMM_WORLD_RANK",
                                 "OMPI_COMM_WORLD_SIZE",
                                 "OMPI_COMM_WORLD_LOCAL_RANK",
                                 "OMPI_COMM_WORLD_LOCAL_SIZE",
                                 "SLURM_PROCID",
                                 "SLURM_NTASKS",
                                 "SLURM_LOCALID",
                                 "SLURM_TASKS_PER_NODE",
                                 "SLURM_STEP_TASKS_PER_NODE",
                                 "SLURM_NODEID",
                                 "SLURM_STEP_NODELIST",
                                 "SLURM_JOB_NODELIST",
                                 "SLURM_NODELIST",
                                 "SLURM_LAUNCH_NODE_IPADDR",
                                 "SLURM_JOB_ID"};
    for (const char* name : kAll) {
      const char* v = std::getenv(name);
      if (v) saved_[name] = v;
      unsetenv(name);
      touched_.push_back(name);
    }
    for (const auto& kv : vars) setenv(kv.first.c_str(), kv.second.c_str(), 1);
  }
  ~ScopedEnv() {
    for (const auto& name : touched_) unsetenv(name.c_str());
    for (const auto& kv : saved_) setenv(kv.first.c_str(), kv.second.c_str(), 1);
  }

 private:
  std::map<std::string, std::string> saved_;
  std::vector<std::string> touched_;
};

}  // namespace

TEST(Rendezvous, NoLauncherMeansOneProcess) {
  ScopedEnv env({});
  const auto info = fsdp::rendezvous_info_from_env();
  EXPECT_EQ(info.source, "default");
  EXPECT_EQ(info.rank, 0);
  EXPECT_EQ(info.world_size, 1);
}

TEST(Rendezvous, TorchrunContract) {
  ScopedEnv env({{"RANK", "3"},
                 {"WORLD_SIZE", "4"},
                 {"LOCAL_RANK", "1"},
                 {"LOCAL_WORLD_SIZE", "2"},
                 {"MASTER_ADDR", "10.1.2.3"},
                 {"MASTER_PORT", "1234"},
                 {"TORCHELASTIC_RESTART_COUNT", "2"},
                 {"TORCHELASTIC_USE_AGENT_STORE", "True"}});
  const auto info = fsdp::rendezvous_info_from_env();
  EXPECT_EQ(info.source, "torchrun");
  EXPECT_EQ(info.rank, 3);
  EXPECT_EQ(info.world_size, 4);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, 2);
  EXPECT_EQ(info.master_addr, "10.1.2.3");
  EXPECT_EQ(info.master_port, 1234);
  EXPECT_EQ(info.restart_count, 2);
  EXPECT_TRUE(info.use_agent_store);
}

TEST(Rendezvous, OpenMpiVariables) {
  ScopedEnv env({{"OMPI_COMM_WORLD_RANK", "5"},
                 {"OMPI_COMM_WORLD_SIZE", "8"},
                 {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                 {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"},
                 {"MASTER_ADDR", "node0"},
                 {"MASTER_PORT", "29400"}});
  const auto info = fsdp::rendezvous_info_from_env();
  EXPECT_EQ(info.source, "openmpi");
  EXPECT_EQ(info.rank, 5);
  EXPECT_EQ(info.world_size, 8);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, 4);
  EXPECT_EQ(info.master_addr, "node0");
  EXPECT_FALSE(info.use_agent_store);
}

// What srun gives task 2 of `srun -N 2 -n 4` run on a login node (192.0.2.7) outside the job.
TEST(Rendezvous, SlurmVariables) {
  ScopedEnv env({{"SLURM_PROCID", "2"},
                 {"SLURM_NTASKS", "4"},
                 {"SLURM_LOCALID", "0"},
                 {"SLURM_NODEID", "1"},
                 {"SLURM_TASKS_PER_NODE", "2(x2)"},
                 {"SLURM_STEP_TASKS_PER_NODE", "2(x2)"},
                 {"SLURM_STEP_NODELIST", "node[07-08]"},
                 {"SLURM_JOB_NODELIST", "node[07-08]"},
                 {"SLURM_LAUNCH_NODE_IPADDR", "192.0.2.7"},
                 {"SLURM_JOB_ID", "12345"}});
  const auto info = fsdp::rendezvous_info_from_env();
  EXPECT_EQ(info.source, "slurm");
  EXPECT_EQ(info.rank, 2);
  EXPECT_EQ(info.world_size, 4);
  EXPECT_EQ(info.local_rank, 0);
  EXPECT_EQ(info.local_world_size, 2);
  // The store is task 0's, on the step's first node, not on the login node srun ran on.
  EXPECT_EQ(info.master_addr, "node07");
  EXPECT_EQ(info.master_port, 20000 + 12345 % 20000);
}

TEST(Rendezvous, SlurmStoreHostIsTheFirstOfTheStepsNodes) {
  const std::map<std::string, std::string> task0 = {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}};
  auto store_host = [&](std::map<std::string, std::string> more) {
    more.insert(task0.begin(), task0.end());
    ScopedEnv env(more);
    return fsdp::rendezvous_info_from_env().master_addr;
  };
  EXPECT_EQ(store_host({{"SLURM_STEP_NODELIST", "node[07-09,12],gpu1"}}), "node07");
  EXPECT_EQ(store_host({{"SLURM_STEP_NODELIST", "gpu1,node[07-09]"}}), "gpu1");
  EXPECT_EQ(store_host({{"SLURM_STEP_NODELIST", "rack[1-2]-n[3,5]"}}), "rack1-n3");
  EXPECT_EQ(store_host({{"SLURM_STEP_NODELIST", "solo"}}), "solo");
  // The step's nodes, not the job's: a step may run on a part of the allocation.
  EXPECT_EQ(store_host({{"SLURM_STEP_NODELIST", "n[3-4]"}, {"SLURM_JOB_NODELIST", "n[1-4]"}}), "n3");
  EXPECT_EQ(store_host({{"SLURM_JOB_NODELIST", "n[1-4]"}}), "n1");
  EXPECT_EQ(store_host({{"SLURM_LAUNCH_NODE_IPADDR", "192.0.2.7"}}), "192.0.2.7");
  EXPECT_EQ(store_host({{"SLURM_STEP_NODELIST", "n[3-4]"}, {"MASTER_ADDR", "10.0.0.1"}}), "10.0.0.1");
  try {
    store_host({{"SLURM_STEP_NODELIST", "n[3-4"}});
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("SLURM_STEP_NODELIST='n[3-4'"), std::string::npos) << e.what();
  }
}

TEST(Rendezvous, SlurmLocalWorldSizeIsThisNodesTaskCount) {
  auto tasks_here = [](const std::string& layout, int node, const char* var = "SLURM_STEP_TASKS_PER_NODE") {
    ScopedEnv env(
        {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "16"}, {var, layout}, {"SLURM_NODEID", std::to_string(node)}});
    return fsdp::rendezvous_info_from_env().local_world_size;
  };
  EXPECT_EQ(tasks_here("3,2(x2),1", 0), 3);
  EXPECT_EQ(tasks_here("3,2(x2),1", 1), 2);
  EXPECT_EQ(tasks_here("3,2(x2),1", 2), 2);
  EXPECT_EQ(tasks_here("3,2(x2),1", 3), 1);
  EXPECT_EQ(tasks_here("8(x2)", 1, "SLURM_TASKS_PER_NODE"), 8);
  {  // the step's layout wins over the job's, which a step inside sbatch inherits
    ScopedEnv env({{"SLURM_PROCID", "0"},
                   {"SLURM_NTASKS", "4"},
                   {"SLURM_TASKS_PER_NODE", "1(x2)"},
                   {"SLURM_STEP_TASKS_PER_NODE", "2(x2)"}});
    EXPECT_EQ(fsdp::rendezvous_info_from_env().local_world_size, 2);
  }
  for (const auto& bad : {std::make_pair(std::string("2(x"), 0), std::make_pair(std::string("2,x"), 1),
                          std::make_pair(std::string("3,2(x2)"), 3)}) {
    try {
      tasks_here(bad.first, bad.second);
      FAIL() << bad.first;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("SLURM_STEP_TASKS_PER_NODE='" + bad.first + "'"), std::string::npos)
          << e.what();
    }
  }
}

TEST(Rendezvous, BadValuesNameTheVariable) {
  {
    ScopedEnv env({{"RANK", "x"}, {"WORLD_SIZE", "2"}});
    try {
      fsdp::rendezvous_info_from_env();
      FAIL();
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("RANK='x'"), std::string::npos) << e.what();
    }
  }
  {
    ScopedEnv env({{"RANK", "2"}, {"WORLD_SIZE", "2"}});
    EXPECT_THROW(fsdp::rendezvous_info_from_env(), c10::Error);
  }
  {
    ScopedEnv env({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}});
    try {
      fsdp::rendezvous_info_from_env();
      FAIL();
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("MASTER_PORT"), std::string::npos) << e.what();
    }
  }
}

TEST(Rendezvous, SingleProcessNeedsNoStoreOrPort) {
  ScopedEnv env({});
  fsdp::init_process_group();
  EXPECT_TRUE(fsdp::is_initialized());
  EXPECT_EQ(fsdp::get_world_size(), 1);
  at::Tensor t = at::ones({3});
  fsdp::world()->all_reduce(t)->wait();
  EXPECT_TRUE(t.equal(at::ones({3})));
  EXPECT_THROW(fsdp::init_process_group(), c10::Error);  // twice is an error
  fsdp::destroy_process_group();
  EXPECT_FALSE(fsdp::is_initialized());
  EXPECT_THROW(fsdp::world(), c10::Error);
}

// SIGPIPE's disposition after joining: a program's own handler is kept; the default becomes
// "ignored" (as Python's start-up makes it), so that writing to a peer that left fails the
// collective with an error naming the ranks instead of killing this process.
static void own_sigpipe_handler(int) {}

TEST(Rendezvous, JoiningIgnoresSigpipeUnlessTheProgramChoseItsOwn) {
  ScopedEnv env({});
  auto disposition = [] {
    struct sigaction now {};
    sigaction(SIGPIPE, nullptr, &now);
    return now.sa_handler;
  };
  signal(SIGPIPE, own_sigpipe_handler);
  fsdp::init_process_group();
  EXPECT_EQ(disposition(), &own_sigpipe_handler);
  fsdp::destroy_process_group();

  signal(SIGPIPE, SIG_DFL);
  fsdp::init_process_group();
  EXPECT_EQ(disposition(), SIG_IGN);
  fsdp::destroy_process_group();
}
