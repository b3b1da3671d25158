// Joining the job: the launcher's environment, the store, the world group and sub-groups.
// The process-wide state lives in one Runtime object behind a mutex.
#include <fsdp/distributed.h>

#include <fsdp/flight_recorder.h>

#include "src/comm/gloo_backend.h"
#include "src/comm/nccl_backend.h"
#include "src/comm/progress_board.h"
#include "src/comm/store_server.h"
#include "src/device/device_ops.h"
#ifdef FSDP_WITH_MPI
#include "src/comm/mpi_backend.h"
#endif

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

namespace fsdp {
namespace {

// ------------------------------------------------------------------------------ environment

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return (v && *v) ? v : nullptr;
}

int env_int(const char* name, int fallback) {
  const char* v = env(name);
  if (!v) return fallback;
  char* end = nullptr;
  long parsed = std::strtol(v, &end, 10);
  TORCH_CHECK(end && *end == '\0' && parsed >= 0 && parsed <= 1000000000L, "environment variable ", name, "='", v,
              "' is not a non-negative integer");
  return static_cast<int>(parsed);
}

bool env_true(const char* name) {
  const char* v = env(name);
  if (!v) return false;
  std::string s(v);
  return s == "1" || s == "True" || s == "true" || s == "TRUE" || s == "yes";
}

// The tasks on this node: its entry (SLURM_NODEID, its index in the step) of the step's layout,
// which Slurm writes as counts, a repeated one with "(xN)": "2(x3),1" is 2, 2, 2 and 1 tasks.
int slurm_tasks_on_this_node() {
  const char* name = env("SLURM_STEP_TASKS_PER_NODE") ? "SLURM_STEP_TASKS_PER_NODE" : "SLURM_TASKS_PER_NODE";
  const char* layout = env(name);
  if (!layout) return 1;
  int node = env_int("SLURM_NODEID", 0);
  const char* p = layout;
  for (;;) {
    char* end = nullptr;
    const long tasks = std::strtol(p, &end, 10);
    long repeat = 1;
    if (end != p && std::strncmp(end, "(x", 2) == 0) {
      p = end + 2;
      repeat = std::strtol(p, &end, 10);
      TORCH_CHECK(end != p && *end == ')', "environment variable ", name, "='", layout,
                  "' is not a Slurm task layout (counts such as 2(x3),1)");
      ++end;
    }
    TORCH_CHECK(end != p && tasks >= 1 && repeat >= 1 && (*end == ',' || *end == '\0'), "environment variable ", name,
                "='", layout, "' is not a Slurm task layout (counts such as 2(x3),1)");
    if (node < repeat) return static_cast<int>(tasks);
    node -= static_cast<int>(repeat);
    TORCH_CHECK(*end == ',', "environment variable SLURM_NODEID='", env("SLURM_NODEID"), "' names no node of ", name,
                "='", layout, "'");
    p = end + 1;
  }
}

// The first host of a Slurm host list, where task 0 runs: "node[07-09,12],gpu1" gives node07,
// and "rack[1-2]-n[3-4]" rack1-n3.
std::string first_slurm_host(const char* name, const std::string& list) {
  std::string host;
  for (size_t i = 0; i < list.size() && list[i] != ','; ++i) {
    if (list[i] != '[') {
      host += list[i];
      continue;
    }
    const size_t close = list.find(']', i);
    TORCH_CHECK(close != std::string::npos, "environment variable ", name, "='", list,
                "' is not a Slurm host list (an unclosed [)");
    host += list.substr(i + 1, list.find_first_of("-,]", i + 1) - (i + 1));
    i = close;
  }
  TORCH_CHECK(!host.empty(), "environment variable ", name, "='", list, "' is not a Slurm host list");
  return host;
}

// Where task 0, which hosts the store, runs: the step's first node, by its name. Not srun's
// own address (SLURM_LAUNCH_NODE_IPADDR), which is a login node's when srun runs there.
std::string slurm_store_host() {
  for (const char* name : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}) {
    if (const char* list = env(name)) return first_slurm_host(name, list);
  }
  const char* launch = env("SLURM_LAUNCH_NODE_IPADDR");
  return launch ? launch : "127.0.0.1";
}

// ------------------------------------------------------------------------------ runtime

struct Runtime {
  RendezvousInfo info;
  InitOptions options;
  c10::intrusive_ptr<c10d::Store> store;       // prefixed; shared by group creation
  std::shared_ptr<comm::ProgressBoard> board;  // has its own store connection
  std::shared_ptr<ProcessGroup> world;
  std::map<std::vector<int>, int> groups_made;  // how many groups of each member set exist
  std::string transport_host;
  std::string transport_iface;
  std::string backend;  // "gloo" or "mpi"
};

std::mutex g_mu;
std::unique_ptr<Runtime> g_runtime;

Runtime& runtime() {
  TORCH_CHECK(g_runtime, "fsdp: the process group is not initialised; call fsdp::init_process_group() first");
  return *g_runtime;
}

// Rank 0's store: on loopback only when MASTER_ADDR is a loopback address (every rank is on
// this machine), else on every address, as torchrun's.
c10::intrusive_ptr<c10d::Store> host_rendezvous_store(const RendezvousInfo& info, std::chrono::milliseconds timeout) {
  comm::StoreServerOptions o;
  o.bind_address = comm::is_loopback_address(info.master_addr) ? info.master_addr : "";
  o.port = info.master_port;
  o.timeout = timeout;
  return comm::host_store(o);
}

c10::intrusive_ptr<c10d::Store> connect_rendezvous_store(const RendezvousInfo& info,
                                                         std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(info.master_port);
  opts.isServer = false;
  opts.waitWorkers = false;
  opts.timeout = timeout;
  return c10::make_intrusive<c10d::TCPStore>(info.master_addr, opts);
}

// A store connection under the launcher's or our own key prefix.
c10::intrusive_ptr<c10d::Store> connect_store(const RendezvousInfo& info, std::chrono::milliseconds timeout,
                                              bool may_host) {
  if (info.world_size == 1 && !info.use_agent_store) {
    return c10::make_intrusive<c10d::HashStore>();  // alone: nothing to talk to
  }
  const bool host = may_host && !info.use_agent_store && info.rank == 0;
  c10::intrusive_ptr<c10d::Store> tcp;
  try {
    tcp = host ? host_rendezvous_store(info, timeout) : connect_rendezvous_store(info, timeout);
  } catch (const std::exception& e) {
    throw CollectiveError(c10::str("fsdp: rank ", info.rank, " could not ", host ? "host" : "reach",
                                   " the rendezvous store at ", info.master_addr, ":", info.master_port, " (", e.what(),
                                   "). Check MASTER_ADDR/MASTER_PORT, and that no other job uses that port."));
  }
  // torchrun's agent store scopes each restart attempt's keys like this; so do we.
  const std::string prefix = info.use_agent_store ? "/worker/attempt_" + std::to_string(info.restart_count) : "fsdp";
  return c10::make_intrusive<c10d::PrefixStore>(prefix, tcp);
}

std::string group_name(const std::vector<int>& ranks, int instance) {
  std::ostringstream s;
  s << "g" << instance << "[";
  for (size_t i = 0; i < ranks.size(); ++i) s << (i ? "," : "") << ranks[i];
  s << "]";
  return s.str();
}

// A group on NCCL over this rank's current CUDA device (nccl_backend.h).
std::shared_ptr<ProcessGroup> make_nccl_group(Runtime& rt, const std::vector<int>& ranks, std::string name) {
  device::has_ops_for(c10::DeviceType::CUDA);  // loads the CUDA path, which sets the factory
  comm::NcclGroupFactory factory = comm::nccl_group_factory();
  TORCH_CHECK(factory != nullptr, "fsdp: backend 'nccl' asked for group ", name,
              ", but this build of fsdp-cpp has no CUDA path; rebuild it with -DFSDP_USE_CUDA=ON against a CUDA "
              "LibTorch, or use a \"cpu\" mesh");
  TORCH_CHECK(rt.store,
              "fsdp: NCCL groups exchange their ids through the rendezvous store, which this rank does not "
              "hold (the world runs on MPI); start the job with fsdprun or torchrun (FSDP_BACKEND=gloo)");
  comm::NcclGroupConfig cfg;
  cfg.rank = static_cast<int>(std::find(ranks.begin(), ranks.end(), rt.info.rank) - ranks.begin());
  cfg.global_ranks = ranks;
  cfg.timeout = rt.options.timeout();
  cfg.store = c10::make_intrusive<c10d::PrefixStore>("nccl/" + name, rt.store);
  cfg.name = std::move(name);
  cfg.device = device::ops_for(c10::DeviceType::CUDA).current_device();
  return factory(std::move(cfg));
}

std::shared_ptr<ProcessGroup> make_group(Runtime& rt, const std::vector<int>& ranks, std::string name,
                                         int instance = 0) {
#ifdef FSDP_WITH_MPI
  if (rt.backend == "mpi") {
    comm::MpiGroupConfig cfg;
    cfg.global_ranks = ranks;
    cfg.timeout = rt.options.timeout();
    cfg.board = rt.board;
    cfg.name = std::move(name);
    if (static_cast<int>(ranks.size()) == rt.info.world_size && cfg.name == "world") {
      return comm::MpiProcessGroup::world(std::move(cfg));
    }
    return comm::MpiProcessGroup::subgroup(std::move(cfg), instance);
  }
#else
  (void)instance;
#endif
  comm::GlooGroupConfig cfg;
  cfg.rank = static_cast<int>(std::find(ranks.begin(), ranks.end(), rt.info.rank) - ranks.begin());
  cfg.global_ranks = ranks;
  cfg.timeout = rt.options.timeout();
  cfg.store = c10::make_intrusive<c10d::PrefixStore>("pg/" + name, rt.store);
  cfg.name = std::move(name);
  cfg.transport_host = rt.transport_host;
  cfg.transport_iface = rt.transport_iface;
  cfg.board = rt.board;
  return std::make_shared<comm::GlooProcessGroup>(std::move(cfg));
}

// store.add(key, delta), with a failure of the store reported as the CollectiveError it is.
int64_t store_add(c10d::Store& store, const std::string& key, int64_t delta, const RendezvousInfo& info) {
  try {
    return store.add(key, delta);
  } catch (const std::exception& e) {
    throw CollectiveError(c10::str("fsdp: rank ", info.rank, " lost the rendezvous store at ", info.master_addr, ":",
                                   info.master_port, " (", e.what(), "); is the process that hosts it still running?"));
  }
}

// Waits until every rank has connected to the store, so that an absent rank is reported as
// such instead of as a failed transport connection.
void store_barrier(c10d::Store& store, const RendezvousInfo& info, std::chrono::milliseconds timeout) {
  store_add(store, "joined", 1, info);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const int64_t joined = store_add(store, "joined", 0, info);
    if (joined >= info.world_size) return;
    if (std::chrono::steady_clock::now() >= deadline) {
      throw CollectiveError(c10::str("fsdp: rendezvous timed out after ", timeout.count(), " ms: only ", joined, " of ",
                                     info.world_size, " ranks joined the store at ", info.master_addr, ":",
                                     info.master_port));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

// The backend named by FSDP_BACKEND, else by the options, else the launcher's natural one.
std::string choose_backend(const RendezvousInfo& info, const InitOptions& options) {
  std::string name = options.backend();
  std::string from = "fsdp::InitOptions().backend";
  if (const char* v = env("FSDP_BACKEND")) {
    name = v;
    from = "FSDP_BACKEND";
  }
  if (name.empty() || name == "auto") {
    const bool mpi_launcher = info.source == "openmpi" || info.source == "slurm";
    return mpi_launcher && mpi_available() ? "mpi" : "gloo";
  }
  TORCH_CHECK(name != "nccl", "fsdp: ", from,
              "='nccl': the world group stays on a CPU backend (gloo or mpi), which coordinates the host side; "
              "a \"cuda\" DeviceMesh (fsdp::init_device_mesh(\"cuda\", ...)) runs its groups on NCCL");
  TORCH_CHECK(name == "gloo" || name == "mpi", "fsdp: ", from, "='", name,
              "' is not a process-group backend; use gloo, mpi or auto");
  TORCH_CHECK(name == "gloo" || mpi_available(), "fsdp: ", from,
              "='mpi', but this build of fsdp-cpp has no MPI backend (CMake found no MPI when it was "
              "configured): install libopenmpi-dev (scripts/install-deps.sh) and reconfigure, or use gloo");
  return name;
}

#ifdef FSDP_WITH_MPI
void destroy_at_mpi_exit() { destroy_process_group(); }

// The MPI job must be the one the environment describes: started by mpirun or srun, not by
// fsdprun (whose processes would each be an MPI job of one).
void join_mpi_job(Runtime& rt) {
  const comm::MpiJob job = comm::mpi_job(&destroy_at_mpi_exit);
  TORCH_CHECK(job.size == rt.info.world_size && job.rank == rt.info.rank, "fsdp: the mpi backend sees rank ", job.rank,
              " of ", job.size, " in MPI_COMM_WORLD, but the environment (", rt.info.source, " variables) says rank ",
              rt.info.rank, " of ", rt.info.world_size,
              ". Start the job with mpirun -np N or srun --mpi=pmix, or use the gloo backend "
              "(FSDP_BACKEND=gloo) under fsdprun or torchrun");
  if (rt.info.world_size > 1) {
    comm::MpiBoardStore stores = comm::mpi_board_store(rt.options.timeout());
    rt.store = stores.server;  // rank 0 hosts the board's store; the others hold none
    rt.board = std::make_shared<comm::ProgressBoard>(stores.client, rt.info.rank, "rank 0's progress-board store");
  }
}
#endif

}  // namespace

comm::NcclGroupFactory& comm::nccl_group_factory() {
  static NcclGroupFactory factory = nullptr;
  return factory;
}

bool mpi_available() {
#ifdef FSDP_WITH_MPI
  return true;
#else
  return false;
#endif
}

std::string backend() {
  std::lock_guard<std::mutex> lock(g_mu);
  return runtime().backend;
}

RendezvousInfo rendezvous_info_from_env() {
  RendezvousInfo info;
  if (env("RANK")) {
    info.source = "torchrun";
    info.rank = env_int("RANK", 0);
    info.world_size = env_int("WORLD_SIZE", 1);
    info.local_rank = env_int("LOCAL_RANK", info.rank);
    info.local_world_size = env_int("LOCAL_WORLD_SIZE", info.world_size);
  } else if (env("OMPI_COMM_WORLD_RANK")) {
    info.source = "openmpi";
    info.rank = env_int("OMPI_COMM_WORLD_RANK", 0);
    info.world_size = env_int("OMPI_COMM_WORLD_SIZE", 1);
    info.local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", 0);
    info.local_world_size = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", 1);
  } else if (env("SLURM_PROCID")) {
    info.source = "slurm";
    info.rank = env_int("SLURM_PROCID", 0);
    info.world_size = env_int("SLURM_NTASKS", 1);
    info.local_rank = env_int("SLURM_LOCALID", 0);
    info.local_world_size = slurm_tasks_on_this_node();
    info.master_addr = slurm_store_host();
    // A port every task derives alike from the job id, unless MASTER_PORT says otherwise.
    if (env("SLURM_JOB_ID")) info.master_port = 20000 + env_int("SLURM_JOB_ID", 0) % 20000;
  } else {
    info.source = "default";
  }
  if (const char* addr = env("MASTER_ADDR")) info.master_addr = addr;
  info.master_port = env_int("MASTER_PORT", info.master_port);
  info.restart_count = env_int("TORCHELASTIC_RESTART_COUNT", 0);
  info.use_agent_store = env_true("TORCHELASTIC_USE_AGENT_STORE");

  TORCH_CHECK(info.world_size >= 1, "fsdp: world size must be at least 1 (from ", info.source, ")");
  TORCH_CHECK(info.rank < info.world_size, "fsdp: rank ", info.rank, " is not below world size ", info.world_size,
              " (from ", info.source, " variables)");
  TORCH_CHECK(info.local_rank < info.local_world_size, "fsdp: local rank ", info.local_rank,
              " is not below local world size ", info.local_world_size, " (from ", info.source, " variables)");
  TORCH_CHECK(info.master_port >= 1 && info.master_port <= 65535, "fsdp: MASTER_PORT ", info.master_port,
              " is not a TCP port (1..65535)");
  return info;
}

// A rank that writes to the socket of a peer that has left gets EPIPE, and the collective fails
// with an error naming the group and the ranks (fail()); under the default disposition SIGPIPE
// would kill the process first, with no message. Python ignores SIGPIPE at start-up, so PyTorch's
// ranks see the error; a C++ program does not, so joining the job does it here, unless the
// program already chose its own disposition.
static void ignore_sigpipe_unless_handled() {
  struct sigaction current {};
  if (sigaction(SIGPIPE, nullptr, &current) != 0) return;
  const bool is_default = !(current.sa_flags & SA_SIGINFO) && current.sa_handler == SIG_DFL;
  if (is_default) signal(SIGPIPE, SIG_IGN);
}

void init_process_group(InitOptions options) { init_process_group(rendezvous_info_from_env(), std::move(options)); }

void init_process_group(const RendezvousInfo& info, InitOptions options) {
  std::lock_guard<std::mutex> lock(g_mu);
  TORCH_CHECK(!g_runtime, "fsdp: init_process_group() was already called; call destroy_process_group() first");
  ignore_sigpipe_unless_handled();
  if (const char* ms = env("FSDP_COLLECTIVE_TIMEOUT_MS")) {
    options.timeout(std::chrono::milliseconds(env_int("FSDP_COLLECTIVE_TIMEOUT_MS", 0)));
    TORCH_CHECK(options.timeout().count() > 0, "FSDP_COLLECTIVE_TIMEOUT_MS='", ms, "' must be positive");
  }
  auto rt = std::make_unique<Runtime>();
  rt->info = info;
  rt->options = options;
  rt->backend = choose_backend(info, options);
#ifdef FSDP_WITH_MPI
  if (rt->backend == "mpi") {
    join_mpi_job(*rt);
    std::vector<int> all(info.world_size);
    for (int i = 0; i < info.world_size; ++i) all[i] = i;
    rt->world = make_group(*rt, all, "world");
    g_runtime = std::move(rt);
    return;
  }
#endif
  if (const char* iface = env("FSDP_SOCKET_IFNAME") ? env("FSDP_SOCKET_IFNAME") : env("GLOO_SOCKET_IFNAME")) {
    rt->transport_iface = iface;
  } else if (!options.transport_host().empty()) {
    rt->transport_host = options.transport_host();
  } else if (comm::is_loopback_address(info.master_addr)) {
    rt->transport_host = "127.0.0.1";
  } else {
    char host[256] = {0};
    TORCH_CHECK(gethostname(host, sizeof(host) - 1) == 0, "fsdp: gethostname() failed");
    rt->transport_host = host;
  }
  rt->store = connect_store(info, options.timeout(), /*may_host=*/true);
  if (info.world_size > 1) {
    store_barrier(*rt->store, info, options.timeout());
    rt->board = std::make_shared<comm::ProgressBoard>(
        connect_store(info, options.timeout(), false), info.rank,
        "the job's store at " + info.master_addr + ":" + std::to_string(info.master_port));
  }
  std::vector<int> all(info.world_size);
  for (int i = 0; i < info.world_size; ++i) all[i] = i;
  rt->world = make_group(*rt, all, "world");
  // A launcher asks for flight-recorder dumps (fsdp/flight_recorder.h) by naming a directory.
  if (const char* dir = env("FSDP_FLIGHT_RECORDER_DIR")) FlightRecorder::global().enable_dumps(dir, info.rank);
  g_runtime = std::move(rt);
}

bool is_initialized() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_runtime != nullptr;
}

void destroy_process_group() {
  std::unique_ptr<Runtime> rt;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    rt.swap(g_runtime);
  }
  // Groups (and their threads) go first, then the board and the store connections. The board
  // says first that this rank is leaving: peers that see its connections close must not
  // diagnose it as stopped.
  if (!rt) return;
  if (rt->board) rt->board->leave();
  rt->world.reset();
  rt->board.reset();
}

std::shared_ptr<ProcessGroup> world() {
  std::lock_guard<std::mutex> lock(g_mu);
  return runtime().world;
}

int get_rank() {
  std::lock_guard<std::mutex> lock(g_mu);
  return runtime().info.rank;
}

int get_world_size() {
  std::lock_guard<std::mutex> lock(g_mu);
  return runtime().info.world_size;
}

RendezvousInfo rendezvous_info() {
  std::lock_guard<std::mutex> lock(g_mu);
  return runtime().info;
}

std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks) { return new_group(ranks, ""); }

std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks, const std::string& backend) {
  TORCH_CHECK(backend.empty() || backend == "nccl", "fsdp::new_group: backend '", backend,
              "' is not one a group can choose; use \"\" (the world's backend) or \"nccl\"");
  std::lock_guard<std::mutex> lock(g_mu);
  Runtime& rt = runtime();
  TORCH_CHECK(!ranks.empty(), "fsdp::new_group: the rank list is empty");
  for (size_t i = 0; i < ranks.size(); ++i) {
    TORCH_CHECK(ranks[i] >= 0 && ranks[i] < rt.info.world_size, "fsdp::new_group: rank ", ranks[i],
                " is outside the world of ", rt.info.world_size);
    TORCH_CHECK(i == 0 || ranks[i] > ranks[i - 1], "fsdp::new_group: ranks must be sorted and distinct");
  }
  TORCH_CHECK(std::find(ranks.begin(), ranks.end(), rt.info.rank) != ranks.end(), "fsdp::new_group: rank ",
              rt.info.rank, " is not a member of the requested group; only members call new_group");
  const int instance = rt.groups_made[ranks]++;
  if (backend == "nccl") return make_nccl_group(rt, ranks, group_name(ranks, instance));
  return make_group(rt, ranks, group_name(ranks, instance), instance);
}

}  // namespace fsdp
