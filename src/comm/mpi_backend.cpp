// The MPI collectives. Where data moves: the MPI calls in the algorithm functions below, each
// run on the group's communication thread (QueuedProcessGroup). Who waits: the caller, through
// Work::wait(). Who ends a stuck job: the Watchdog.
#include "src/comm/mpi_backend.h"

#include "src/comm/p2p_algorithms.h"
#include "src/comm/progress_board.h"
#include "src/comm/store_server.h"
#include "src/util/tensor_bytes.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <ATen/ops/div.h>

#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

namespace fsdp {
namespace comm {
namespace {

using Clock = std::chrono::steady_clock;
using detail::bytes_of;

// Every MPI call of this file goes through here: MPI_ERRORS_RETURN is set on our communicators,
// so a failure comes back as a code, and becomes an exception naming the call.
void check_mpi(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {0};
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw std::runtime_error(std::string(call) + " failed: " + text);
}

int as_mpi_count(int64_t n, const std::string& group) {
  TORCH_CHECK(n <= std::numeric_limits<int>::max(), "fsdp collective on group '", group, "': ", n,
              " elements exceed the MPI backend's limit of 2^31 - 1 per rank (MPI counts are int); "
              "use smaller FSDP groups or the gloo backend");
  return static_cast<int>(n);
}

// ------------------------------------------------------------------------------ datatypes

// For moving bytes (all-gather, broadcast): one MPI element per tensor element, so counts stay
// in elements and reach further than byte counts would before int overflows.
MPI_Datatype element_type(size_t element_size) {
  static std::mutex mu;
  static std::map<size_t, MPI_Datatype> types;
  std::lock_guard<std::mutex> lock(mu);
  auto it = types.find(element_size);
  if (it != types.end()) return it->second;
  MPI_Datatype t;
  check_mpi(MPI_Type_contiguous(static_cast<int>(element_size), MPI_BYTE, &t), "MPI_Type_contiguous");
  check_mpi(MPI_Type_commit(&t), "MPI_Type_commit");
  types[element_size] = t;
  return t;
}

// MPI has no 16-bit floats: bf16 and fp16 travel as MPI_UINT16_T and are combined by these
// operations, in float and rounded back, as ATen's own bf16/fp16 arithmetic does.
enum class Combine { kSum, kMax, kMin };

template <typename T, Combine C>
void combine_16bit(void* in, void* inout, int* len, MPI_Datatype*) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) {
    const float x = static_cast<float>(a[i]), y = static_cast<float>(b[i]);
    float z;
    if (C == Combine::kSum) {
      z = x + y;
    } else if (std::isnan(x) || std::isnan(y)) {
      z = std::numeric_limits<float>::quiet_NaN();  // as at::maximum / at::minimum
    } else {
      z = C == Combine::kMax ? std::max(x, y) : std::min(x, y);
    }
    b[i] = static_cast<T>(z);
  }
}

struct Ops16 {
  MPI_Op bf16[3];
  MPI_Op half[3];
};

Ops16& ops16() {
  static Ops16 ops = [] {
    Ops16 o;
    check_mpi(MPI_Op_create(&combine_16bit<c10::BFloat16, Combine::kSum>, 1, &o.bf16[0]), "MPI_Op_create");
    check_mpi(MPI_Op_create(&combine_16bit<c10::BFloat16, Combine::kMax>, 1, &o.bf16[1]), "MPI_Op_create");
    check_mpi(MPI_Op_create(&combine_16bit<c10::BFloat16, Combine::kMin>, 1, &o.bf16[2]), "MPI_Op_create");
    check_mpi(MPI_Op_create(&combine_16bit<c10::Half, Combine::kSum>, 1, &o.half[0]), "MPI_Op_create");
    check_mpi(MPI_Op_create(&combine_16bit<c10::Half, Combine::kMax>, 1, &o.half[1]), "MPI_Op_create");
    check_mpi(MPI_Op_create(&combine_16bit<c10::Half, Combine::kMin>, 1, &o.half[2]), "MPI_Op_create");
    return o;
  }();
  return ops;
}

struct Reduction {
  MPI_Datatype type = MPI_DATATYPE_NULL;
  MPI_Op op = MPI_OP_NULL;
};

// How MPI reduces `dtype` with `op` (avg: a sum, divided afterwards). Undefined type when MPI
// cannot reduce that dtype.
Reduction reduction_for(at::ScalarType dtype, ReduceOp op) {
  const int k = op == ReduceOp::kMax ? 1 : op == ReduceOp::kMin ? 2 : 0;
  const MPI_Op arith[3] = {MPI_SUM, MPI_MAX, MPI_MIN};
  switch (dtype) {
    case at::kFloat: return {MPI_FLOAT, arith[k]};
    case at::kDouble: return {MPI_DOUBLE, arith[k]};
    case at::kChar: return {MPI_INT8_T, arith[k]};
    case at::kByte: return {MPI_UINT8_T, arith[k]};
    case at::kShort: return {MPI_INT16_T, arith[k]};
    case at::kInt: return {MPI_INT32_T, arith[k]};
    case at::kLong: return {MPI_INT64_T, arith[k]};
    case at::kBool: return {MPI_C_BOOL, k == 2 ? MPI_LAND : MPI_LOR};  // as ATen: sum and max are "or"
    case at::kBFloat16: return {MPI_UINT16_T, ops16().bf16[k]};
    case at::kHalf: return {MPI_UINT16_T, ops16().half[k]};
    default: return {};
  }
}

bool all_equal(const std::vector<int64_t>& v) {
  return std::all_of(v.begin(), v.end(), [&](int64_t c) { return c == v.front(); });
}

int64_t sum_of(const std::vector<int64_t>& v) {
  int64_t s = 0;
  for (int64_t c : v) s += c;
  return s;
}

// ------------------------------------------------------------------------------ transfers

// Reduce-scatters and all-reduces of at least this many bytes (the whole buffer) run our ring
// (p2p_algorithms.h) on MpiTransfers; smaller ones call MPI's collectives, whose latency-optimised
// algorithms suit small messages and many ranks. OpenMPI 4.1's reduce-scatter and all-reduce
// allocate a temporary as large as the input on every call (fresh pages, above glibc's 32 MiB mmap
// threshold, which on a VM cost more than the transfer); its reduce-scatter measured about 2x
// slower than the ring at 256 KiB and 3-7x from 1 MiB up (docs/benchmarks.md, "MPI against Gloo").
constexpr int64_t kPointToPointBytes = int64_t{256} << 10;
// The largest message MpiTransfers sends; a transfer moves as several.
constexpr size_t kPieceBytes = size_t{1} << 20;

// Point-to-point transfers on a group's communicator, for the algorithms of p2p_algorithms.h.
// A transfer moves as messages of at most kPieceBytes, so that a piece that arrived can be
// reduced while the next is still moving. Transfers match by posting order (tag 0): each
// operation runs alone on its group's communicator, and every step waits for its own.
class MpiTransfers final : public Transfers {
 public:
  explicit MpiTransfers(MPI_Comm comm) : comm_(comm) {}

  void send(const char* ptr, size_t nbytes, int peer, uint64_t) override {
    for (size_t off = 0; off < nbytes; off += kPieceBytes) {
      sends_.emplace_back();
      check_mpi(MPI_Isend(ptr + off, piece_len(nbytes, off), MPI_BYTE, peer, 0, comm_, &sends_.back()), "MPI_Isend");
    }
  }

  void recv(char* ptr, size_t nbytes, int peer, uint64_t) override {
    for (size_t off = 0; off < nbytes; off += kPieceBytes) {
      recvs_.push_back({MPI_REQUEST_NULL, ptr + off, piece_len(nbytes, off)});
      check_mpi(MPI_Irecv(ptr + off, recvs_.back().nbytes, MPI_BYTE, peer, 0, comm_, &recvs_.back().request),
                "MPI_Irecv");
    }
  }

  void wait_recvs(const std::function<void(char*, size_t)>& on_landed) override {
    for (auto& r : recvs_) {
      check_mpi(MPI_Wait(&r.request, MPI_STATUS_IGNORE), "MPI_Wait");
      on_landed(r.ptr, static_cast<size_t>(r.nbytes));
    }
    recvs_.clear();
  }

  void wait_sends() override {
    check_mpi(MPI_Waitall(static_cast<int>(sends_.size()), sends_.data(), MPI_STATUSES_IGNORE), "MPI_Waitall");
    sends_.clear();
  }

 private:
  static int piece_len(size_t nbytes, size_t off) { return static_cast<int>(std::min(kPieceBytes, nbytes - off)); }

  struct Pending {
    MPI_Request request;
    char* ptr;
    int nbytes;
  };
  MPI_Comm comm_;
  std::vector<MPI_Request> sends_;
  std::vector<Pending> recvs_;
};

// ------------------------------------------------------------------------------ watchdog

// Ends the job when an MPI call outlives its deadline: prints what `describe` says, then
// MPI_Abort. One thread per process, for every group (and group creation).
class Watchdog {
 public:
  Watchdog() : thread_([this] { loop(); }) {}

  uint64_t arm(Clock::time_point deadline, std::function<std::string()> describe) {
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t id = next_id_++;
    armed_.emplace(id, Entry{deadline, std::move(describe)});
    cv_.notify_all();
    return id;
  }

  void disarm(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    armed_.erase(id);
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

 private:
  struct Entry {
    Clock::time_point deadline;
    std::function<std::string()> describe;
  };

  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stopping_) {
      if (armed_.empty()) {
        cv_.wait(lock);
        continue;
      }
      auto first = std::min_element(armed_.begin(), armed_.end(),
                                    [](const auto& a, const auto& b) { return a.second.deadline < b.second.deadline; });
      if (Clock::now() < first->second.deadline) {
        cv_.wait_until(lock, first->second.deadline);
        continue;
      }
      std::function<std::string()> describe = std::move(first->second.describe);
      armed_.erase(first);
      lock.unlock();
      const std::string message = describe();
      std::fprintf(stderr, "%s\n", message.c_str());
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, 1);
      std::_Exit(1);  // MPI_Abort does not return; should it, the job still must not hang
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, Entry> armed_;
  uint64_t next_id_ = 0;
  bool stopping_ = false;
  std::thread thread_;
};

// Process-wide MPI state, made by mpi_job() and never destroyed (its thread is stopped before
// MPI_Finalize instead: static destruction order at exit is not ours to choose).
struct MpiState {
  bool we_initialised = false;
  MPI_Comm create_comm = MPI_COMM_NULL;  // parent of sub-groups; used only under new_group's lock
  Watchdog* watchdog = nullptr;
  void (*before_finalize)() = nullptr;
};
MpiState* g_mpi = nullptr;
std::mutex g_mpi_mu;

void finalize_at_exit() {
  if (!g_mpi) return;
  if (g_mpi->before_finalize) g_mpi->before_finalize();
  g_mpi->watchdog->stop();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

// Runs `call` (a blocking MPI call on the calling thread) under the watchdog.
template <typename F>
void guarded(std::chrono::milliseconds timeout, const std::string& what, F&& call) {
  const uint64_t id = g_mpi->watchdog->arm(Clock::now() + timeout, [what, timeout] {
    return "fsdp: " + what + " did not complete within " + std::to_string(timeout.count()) +
           " ms: some member never called it. An MPI call cannot be cancelled, so this process ends the MPI "
           "job (MPI_Abort).";
  });
  try {
    call();
  } catch (...) {
    g_mpi->watchdog->disarm(id);
    throw;
  }
  g_mpi->watchdog->disarm(id);
}

int comm_rank(MPI_Comm comm) {
  int r = 0;
  check_mpi(MPI_Comm_rank(comm, &r), "MPI_Comm_rank");
  return r;
}

// OpenMPI's shared memory copies a large message once, straight out of the sender's memory
// (Linux cross-memory attach: process_vm_readv), where the kernel allows it, and otherwise twice,
// through a shared segment; the single copy measured 1.1-2.4x faster (docs/benchmarks.md, "MPI
// against Gloo"). A container whose seccomp profile refuses that system call makes each such
// transfer fail rather than fall back, so unless the user chose a mechanism
// (OMPI_MCA_btl_vader_single_copy_mechanism, which mpirun's --mca sets), ask for the two-copy
// path where this process may not make the call on itself. (OpenMPI falls back by itself where
// Yama's ptrace_scope is the obstacle.)
void avoid_a_refused_single_copy() {
#ifdef OPEN_MPI
  if (std::getenv("OMPI_MCA_btl_vader_single_copy_mechanism")) return;
  char from = 1, to = 0;
  struct iovec local {
    &to, 1
  }, remote{&from, 1};
  if (process_vm_readv(getpid(), &local, 1, &remote, 1, 0) == 1 && to == 1) return;
  setenv("OMPI_MCA_btl_vader_single_copy_mechanism", "none", 0);
#endif
}

// The interface the user named for the job's transports (FSDP_SOCKET_IFNAME, else
// GLOO_SOCKET_IFNAME) is the one OpenMPI's TCP transport uses too, unless the user chose
// OpenMPI's own (btl_tcp_if_include or _exclude, which mpirun's --mca sets).
void use_the_named_interface() {
#ifdef OPEN_MPI
  if (std::getenv("OMPI_MCA_btl_tcp_if_include") || std::getenv("OMPI_MCA_btl_tcp_if_exclude")) return;
  for (const char* name : {"FSDP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"}) {
    const char* iface = std::getenv(name);
    if (iface == nullptr || *iface == '\0') continue;
    setenv("OMPI_MCA_btl_tcp_if_include", iface, 0);
    return;
  }
#endif
}

}  // namespace

// ------------------------------------------------------------------------------ the job

MpiJob mpi_job(void (*before_finalize)()) {
  std::lock_guard<std::mutex> lock(g_mpi_mu);
  if (!g_mpi) {
    int initialised = 0, provided = 0;
    MPI_Initialized(&initialised);
    if (!initialised) {
      int argc = 0;
      char** argv = nullptr;
      avoid_a_refused_single_copy();
      use_the_named_interface();
      TORCH_CHECK(MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided) == MPI_SUCCESS,
                  "fsdp: MPI_Init_thread failed; is this process started by mpirun or srun --mpi=pmix?");
    } else {
      MPI_Query_thread(&provided);
    }
    TORCH_CHECK(provided >= MPI_THREAD_MULTIPLE,
                "fsdp: the MPI backend needs MPI_THREAD_MULTIPLE (each process group has its own "
                "communication thread), but this MPI provides level ",
                provided,
                initialised ? " (the program initialised MPI itself: call MPI_Init_thread with "
                              "MPI_THREAD_MULTIPLE)"
                            : "; use an MPI built with thread support, or the gloo backend");
    auto* state = new MpiState();
    state->we_initialised = !initialised;
    state->before_finalize = before_finalize;
    check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &state->create_comm), "MPI_Comm_dup");
    MPI_Comm_set_errhandler(state->create_comm, MPI_ERRORS_RETURN);
    state->watchdog = new Watchdog();
    g_mpi = state;
    if (state->we_initialised) std::atexit(finalize_at_exit);
  }
  MpiJob job;
  MPI_Comm_rank(MPI_COMM_WORLD, &job.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &job.size);
  return job;
}

namespace {

// Where rank 0's board store listens, and the others reach it: loopback when every rank is on
// this node; else the interface the user named (FSDP_SOCKET_IFNAME, GLOO_SOCKET_IFNAME), else
// MASTER_ADDR, else this host's name, which must not resolve to loopback.
std::string board_address(bool single_node) {
  if (single_node) return "127.0.0.1";
  for (const char* name : {"FSDP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"}) {
    if (const char* iface = std::getenv(name)) {
      try {
        return address_of_interface(iface);
      } catch (const std::exception& e) {
        throw CollectiveError(c10::str("fsdp: ", name, "=", iface, ": ", e.what()));
      }
    }
  }
  if (const char* addr = std::getenv("MASTER_ADDR")) return addr;
  char host[256] = {0};
  TORCH_CHECK(gethostname(host, sizeof(host) - 1) == 0, "fsdp: gethostname() failed");
  TORCH_CHECK(!is_loopback_address(host), "fsdp: this MPI job spans several nodes, and rank 0's host name '", host,
              "' resolves to a loopback address, which the other nodes cannot reach for the progress board. Set "
              "FSDP_SOCKET_IFNAME to the network interface the ranks reach rank 0 on, or MASTER_ADDR to an address "
              "of rank 0's host.");
  return host;
}

}  // namespace

MpiBoardStore mpi_board_store(std::chrono::milliseconds timeout) {
  const MpiJob job = mpi_job(nullptr);
  // One node when every rank shares this node's memory: then loopback reaches rank 0.
  MPI_Comm node;
  check_mpi(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node), "MPI_Comm_split_type");
  int node_size = 0;
  MPI_Comm_size(node, &node_size);
  MPI_Comm_free(&node);

  MpiBoardStore out;
  struct {
    char host[256];
    int port;
  } where{};
  if (job.rank == 0) {
    const std::string address = board_address(node_size == job.size);
    StoreServerOptions o;
    o.bind_address = address;
    o.timeout = timeout;
    try {
      out.server = host_store(o);
    } catch (const StoreBindError& e) {
      throw CollectiveError(c10::str("fsdp: rank 0 could not host the progress board's store (", e.what(),
                                     "). Set FSDP_SOCKET_IFNAME to the network interface the ranks reach rank 0 "
                                     "on, or MASTER_ADDR to an address of rank 0's host."));
    }
    where.port = static_cast<c10d::TCPStore&>(*out.server).getPort();
    std::snprintf(where.host, sizeof(where.host), "%s", address.c_str());
  }
  check_mpi(MPI_Bcast(&where, sizeof(where), MPI_BYTE, 0, MPI_COMM_WORLD), "MPI_Bcast");
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(where.port);
  opts.isServer = false;
  opts.waitWorkers = false;
  opts.timeout = timeout;
  try {
    out.client = c10::make_intrusive<c10d::TCPStore>(std::string(where.host), opts);
  } catch (const std::exception& e) {
    throw CollectiveError(c10::str("fsdp: rank ", job.rank, " could not reach the progress board's store that rank 0 ",
                                   "hosts at ", where.host, ":", where.port, " (", e.what(),
                                   "); set MASTER_ADDR to an address of rank 0's node that the others can reach"));
  }
  return out;
}

// ------------------------------------------------------------------------------ lifecycle

std::shared_ptr<MpiProcessGroup> MpiProcessGroup::world(MpiGroupConfig config) {
  mpi_job(nullptr);
  MPI_Comm comm;
  guarded(config.timeout, "creating process group '" + config.name + "' (MPI_Comm_dup of the world)",
          [&] { check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &comm), "MPI_Comm_dup"); });
  return std::shared_ptr<MpiProcessGroup>(new MpiProcessGroup(std::move(config), comm));
}

std::shared_ptr<MpiProcessGroup> MpiProcessGroup::subgroup(MpiGroupConfig config, int instance) {
  mpi_job(nullptr);
  MPI_Group world_group, members;
  check_mpi(MPI_Comm_group(g_mpi->create_comm, &world_group), "MPI_Comm_group");
  check_mpi(
      MPI_Group_incl(world_group, static_cast<int>(config.global_ranks.size()), config.global_ranks.data(), &members),
      "MPI_Group_incl");
  // Members agree on the tag: it comes from the member set and how many such groups exist.
  size_t h = std::hash<std::string>()(config.name) + static_cast<size_t>(instance);
  const int tag = static_cast<int>(h % 32000);
  MPI_Comm comm = MPI_COMM_NULL;
  std::ostringstream what;
  what << "creating process group '" << config.name << "' (global ranks " << format_ranks(config.global_ranks)
       << ", MPI_Comm_create_group)";
  guarded(config.timeout, what.str(),
          [&] { check_mpi(MPI_Comm_create_group(g_mpi->create_comm, members, tag, &comm), "MPI_Comm_create_group"); });
  MPI_Group_free(&members);
  MPI_Group_free(&world_group);
  return std::shared_ptr<MpiProcessGroup>(new MpiProcessGroup(std::move(config), comm));
}

MpiProcessGroup::MpiProcessGroup(MpiGroupConfig config, MPI_Comm comm)
    : QueuedProcessGroup(comm_rank(comm), config.global_ranks, config.name, config.timeout, "mpi"),
      config_(std::move(config)),
      comm_(comm) {
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  start_thread();
}

MpiProcessGroup::~MpiProcessGroup() {
  stop_thread();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Comm_free(&comm_);
}

WorkHandle MpiProcessGroup::enqueue(Op op) {
  // Refused here, on the caller's thread and on every rank alike, rather than failing one
  // rank's communication thread while the others wait for it.
  if (op.kind == CollectiveKind::kReduceScatter || op.kind == CollectiveKind::kAllReduce) {
    TORCH_CHECK(reduction_for(op.input.scalar_type(), op.reduce).type != MPI_DATATYPE_NULL,
                "fsdp collective on group '", name(), "': the MPI backend cannot reduce dtype ", op.input.scalar_type(),
                " (it reduces float, double, bfloat16, half, bool and integer tensors); use the gloo backend");
  }
  const std::string& group = name();
  if (op.kind == CollectiveKind::kAllGather || op.kind == CollectiveKind::kReduceScatter) {
    as_mpi_count(sum_of(op.counts), group);  // displacements are ints too
  } else if (op.input.defined()) {
    as_mpi_count(op.input.numel(), group);
  }
  return QueuedProcessGroup::enqueue(std::move(op));
}

// Failures (an MPI call's error code, the progress board's store) come back as exceptions; they
// become the CollectiveError the caller's wait() reports.
void MpiProcessGroup::execute(const Op& op, int64_t seq) {
  try {
    if (config_.board) config_.board->entered(name(), seq);
    run_under_watchdog(op, seq);
  } catch (const std::exception& e) {
    throw CollectiveError(std::string("fsdp: ") + to_string(op.kind) + " #" + std::to_string(seq) +
                          " on process group '" + name() + "' (global ranks " + format_ranks(global_ranks()) +
                          ", MPI backend) failed: " + e.what() + ". The group is now unusable.");
  }
}

void MpiProcessGroup::run_under_watchdog(const Op& op, int64_t seq) {
  const CollectiveKind kind = op.kind;
  const uint64_t id =
      g_mpi->watchdog->arm(Clock::now() + timeout(), [this, kind, seq] { return timeout_message(kind, seq); });
  try {
    switch (kind) {
      case CollectiveKind::kAllGather: all_gather(op); break;
      case CollectiveKind::kReduceScatter: reduce_scatter(op); break;
      case CollectiveKind::kAllReduce: all_reduce(op); break;
      case CollectiveKind::kBroadcast: broadcast(op); break;
      case CollectiveKind::kBarrier:
        check_mpi(MPI_Barrier(comm_), "MPI_Barrier");
        count_bytes(kind, size() - 1, size() - 1);
        break;
    }
  } catch (...) {
    g_mpi->watchdog->disarm(id);
    throw;
  }
  g_mpi->watchdog->disarm(id);
}

// Called by the watchdog thread while the operation is still stuck in MPI.
std::string MpiProcessGroup::timeout_message(CollectiveKind kind, int64_t seq) {
  std::ostringstream msg;
  msg << "fsdp: " << to_string(kind) << " #" << seq << " on process group '" << name() << "' (global ranks "
      << format_ranks(global_ranks()) << ", this is group rank " << rank() << ", MPI backend) timed out after "
      << timeout().count() << " ms";
  if (config_.board) msg << describe_absent_and_stalled(*config_.board, name(), global_ranks(), seq);
  msg << ". An MPI collective cannot be cancelled, so this process ends the MPI job (MPI_Abort). If a rank is "
         "only slow, raise the timeout (fsdp::InitOptions().timeout(...), fsdp_config.collective_timeout_s or "
         "FSDP_COLLECTIVE_TIMEOUT_MS).";
  return msg.str();
}

// ------------------------------------------------------------------------------ collectives
// Byte counters hold what a bandwidth-optimal algorithm moves for this rank (MPI does not say
// what its own algorithm moved): the same figures the Gloo backend counts.

Transport MpiProcessGroup::transport() {
  Transport t;
  t.rank = rank();
  t.size = size();
  t.seq = 0;  // unused: MpiTransfers match by posting order
  t.transfers = [this] { return std::make_unique<MpiTransfers>(comm_); };
  t.scratch = [this](size_t nbytes) { return scratch(nbytes); };
  return t;
}

bool MpiProcessGroup::runs_point_to_point(int64_t total_bytes) const {
  return size() > 1 && total_bytes >= kPointToPointBytes;
}

// MPI_Allgather(v) at every size: it allocates nothing, and across nodes its ring moves each
// piece over every node boundary once, where a direct exchange would send it once per rank there.
void MpiProcessGroup::all_gather(const Op& op) {
  const int W = size(), r = rank();
  const size_t es = op.output.element_size();
  const MPI_Datatype type = element_type(es);
  char* out = bytes_of(op.output);
  const char* in = bytes_of(op.input);
  int64_t own_offset = 0;
  for (int p = 0; p < r; ++p) own_offset += op.counts[p];
  // FSDP may hand in its own shard's slice of the output: MPI then must not copy it onto itself.
  const void* send = (op.counts[r] > 0 && out + own_offset * es == in) ? MPI_IN_PLACE : in;
  all_gather_pieces(send, out, op.counts, type);
  const int64_t own = op.counts[r] * static_cast<int64_t>(es);
  count_bytes(CollectiveKind::kAllGather, own * (W - 1), sum_of(op.counts) * static_cast<int64_t>(es) - own);
}

void MpiProcessGroup::all_gather_pieces(const void* send, char* out, const std::vector<int64_t>& counts,
                                        MPI_Datatype type) {
  const int W = size(), r = rank();
  if (all_equal(counts)) {
    const int n = static_cast<int>(counts[0]);
    check_mpi(MPI_Allgather(send, n, type, out, n, type, comm_), "MPI_Allgather");
    return;
  }
  std::vector<int> ints(W), displs(W);
  for (int p = 0, off = 0; p < W; off += ints[p], ++p) {
    ints[p] = static_cast<int>(counts[p]);
    displs[p] = off;
  }
  check_mpi(MPI_Allgatherv(send, ints[r], type, out, ints.data(), displs.data(), type, comm_), "MPI_Allgatherv");
}

void MpiProcessGroup::reduce_scatter(const Op& op) {
  const int W = size(), r = rank();
  const size_t es = op.output.element_size();
  const char* in = bytes_of(op.input);
  char* out = bytes_of(op.output);
  if (runs_point_to_point(sum_of(op.counts) * static_cast<int64_t>(es))) {
    ring_reduce_scatter(transport(), out, in, op.counts, op.output.scalar_type(), op.reduce);  // divides for avg
  } else {
    const Reduction red = reduction_for(op.input.scalar_type(), op.reduce);
    if (all_equal(op.counts)) {
      check_mpi(MPI_Reduce_scatter_block(in, out, static_cast<int>(op.counts[0]), red.type, red.op, comm_),
                "MPI_Reduce_scatter_block");
    } else {
      std::vector<int> counts(op.counts.begin(), op.counts.end());
      check_mpi(MPI_Reduce_scatter(in, out, counts.data(), red.type, red.op, comm_), "MPI_Reduce_scatter");
    }
    if (op.reduce == ReduceOp::kAvg && op.output.numel() > 0) op.output.div_(W);
  }
  const int64_t others = (sum_of(op.counts) - op.counts[r]) * static_cast<int64_t>(es);
  count_bytes(CollectiveKind::kReduceScatter, others, others);
}

void MpiProcessGroup::all_reduce(const Op& op) {
  const int W = size();
  const at::Tensor& t = op.input;
  if (t.numel() == 0) return;
  if (runs_point_to_point(static_cast<int64_t>(t.nbytes()))) {
    // Our ring reduce-scatter in place, then MPI's all-gather of the reduced pieces.
    const std::vector<int64_t> counts = chunk_counts(t.numel(), W);
    ring_reduce_scatter_in_place(transport(), bytes_of(t), counts, t.scalar_type(), op.reduce);  // divides for avg
    all_gather_pieces(MPI_IN_PLACE, bytes_of(t), counts, element_type(t.element_size()));
  } else {
    const Reduction red = reduction_for(t.scalar_type(), op.reduce);
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, bytes_of(t), static_cast<int>(t.numel()), red.type, red.op, comm_),
              "MPI_Allreduce");
    if (op.reduce == ReduceOp::kAvg) t.div_(W);
  }
  const int64_t moved = 2 * static_cast<int64_t>(t.nbytes()) * (W - 1) / W;  // ring: reduce-scatter + all-gather
  count_bytes(CollectiveKind::kAllReduce, moved, moved);
}

void MpiProcessGroup::broadcast(const Op& op) {
  const int W = size();
  const at::Tensor& t = op.input;
  if (t.numel() == 0) return;
  check_mpi(MPI_Bcast(bytes_of(t), static_cast<int>(t.numel()), element_type(t.element_size()), op.root, comm_),
            "MPI_Bcast");
  const int64_t nbytes = static_cast<int64_t>(t.nbytes());
  if (rank() == op.root) {
    count_bytes(CollectiveKind::kBroadcast, nbytes * (W - 1), 0);
  } else {
    count_bytes(CollectiveKind::kBroadcast, 0, nbytes);
  }
}

}  // namespace comm
}  // namespace fsdp
