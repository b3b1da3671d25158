// layer: comm (what may include what: docs/architecture.md)
/// \file
/// fsdp/distributed.h — joining the job: rendezvous from the launcher's environment, the
/// world process group, and sub-groups.
///
/// \code{.cpp}
///   // under `fsdprun --nproc-per-node 2 ./train` (or torchrun, mpirun, srun):
///   fsdp::init_process_group();                 // reads RANK, WORLD_SIZE, MASTER_ADDR, ...
///   auto world = fsdp::world();                 // the group of all ranks
///   ...
///   fsdp::destroy_process_group();              // optional; also done at exit
/// \endcode
///
/// The environment contract is torchrun's: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
/// MASTER_ADDR, MASTER_PORT (and TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_USE_AGENT_STORE when
/// a launcher hosts the store). When RANK is absent, OpenMPI's OMPI_COMM_WORLD_* or Slurm's
/// SLURM_* variables are used instead; MASTER_ADDR / MASTER_PORT still name the store (Slurm:
/// defaults are the step's first node, by its name in SLURM_STEP_NODELIST, where task 0 runs,
/// and a port derived from SLURM_JOB_ID).
#pragma once

#include <fsdp/process_group.h>

#include <torch/arg.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace fsdp {

/// Where this process sits in the job, as read from the environment.
struct RendezvousInfo {
  int rank = 0;                           ///< RANK: this process's rank in the world
  int world_size = 1;                     ///< WORLD_SIZE: the number of ranks
  int local_rank = 0;                     ///< LOCAL_RANK: its rank among the ranks of its host
  int local_world_size = 1;               ///< LOCAL_WORLD_SIZE: the ranks of its host
  std::string master_addr = "127.0.0.1";  ///< MASTER_ADDR: the store's host
  int master_port = 29500;                ///< MASTER_PORT: the store's port
  int restart_count = 0;                  ///< TORCHELASTIC_RESTART_COUNT
  bool use_agent_store = false;           ///< the launcher hosts the store; every rank is a client
  std::string source;                     ///< "torchrun", "openmpi", "slurm" or "default"
};

/// Parses the environment (see the file comment). Throws c10::Error naming the variable when one
/// is present but malformed or inconsistent (e.g. RANK >= WORLD_SIZE). Without any launcher
/// variables it describes a single process (rank 0 of 1). Does not communicate.
RendezvousInfo rendezvous_info_from_env();

/// How init_process_group() joins the job: the collectives' timeout, the transport's address, the
/// backend.
struct InitOptions {
  /// Timeout of every collective of the groups created from this runtime, and of the
  /// rendezvous itself. FSDP_COLLECTIVE_TIMEOUT_MS in the environment overrides the default.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(5);
  /// Address this rank's transport binds to; empty = derived (loopback when the store is on
  /// loopback, else this host's name). GLOO_SOCKET_IFNAME / FSDP_SOCKET_IFNAME select an
  /// interface instead.
  TORCH_ARG(std::string, transport_host) = "";
  /// The collectives' implementation: "gloo" (fsdp-cpp's algorithms on Gloo's TCP transport),
  /// "mpi" (the MPI library's collectives: shared memory within a node, the interconnect across
  /// nodes; the job must be started by mpirun or srun), or "" / "auto": mpi when the job was
  /// started by mpirun or srun and this build has MPI, else gloo. FSDP_BACKEND in the
  /// environment overrides it. An unknown name, or mpi in a build without MPI, throws c10::Error.
  TORCH_ARG(std::string, backend) = "";
};

/// The backend the process group runs on ("gloo" or "mpi"); throws c10::Error unless initialised.
std::string backend();
/// True when this build of fsdp-cpp has the MPI backend (CMake found MPI).
bool mpi_available();

/// Joins the job described by the environment: connects to (or, on rank 0 without a launcher
/// store, hosts) the TCPStore at MASTER_ADDR:MASTER_PORT and builds the world group.
/// Collective over all ranks; blocks until all have arrived or the timeout expires.
/// Throws c10::Error if already initialised or the environment is malformed, and
/// CollectiveError if the store cannot be reached or hosted, or not every rank arrives (or
/// connects its transport) within the timeout. Sets SIGPIPE to ignored when the program left it
/// at its default (as Python does for PyTorch), so that a peer that has left makes a collective
/// throw CollectiveError instead of killing this process; a handler of the program's is kept.
void init_process_group(InitOptions options = InitOptions());
/// The same from an explicit description (used by tests and by programs with their own launch).
void init_process_group(const RendezvousInfo& info, InitOptions options = InitOptions());

/// True between init_process_group() and destroy_process_group(). Thread-safe; never throws.
bool is_initialized();
/// Tears down every group of this process. Not collective, but peers blocked in a collective
/// with this process will see an error. Safe to call when not initialised.
void destroy_process_group();

/** @{ */
/// The group of all ranks, and this process's place in it. Each throws c10::Error unless
/// initialised. Thread-safe. rendezvous_info() returns a copy, so it stays valid after
/// destroy_process_group().
std::shared_ptr<ProcessGroup> world();
int get_rank();
int get_world_size();
RendezvousInfo rendezvous_info();
/** @} */

/// A group of the given world ranks (sorted, distinct). Collective over the MEMBERS only: each
/// member must call it with the same ranks, in the same order relative to its other new_group
/// calls; non-members need not call it. Blocks until all members have connected. The group
/// rank of a member is its position in `ranks`. Throws c10::Error if `ranks` is malformed or
/// does not contain this rank, and CollectiveError if the members do not all connect within
/// the timeout.
std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks);
/// The same on a chosen backend: "" is the world's; "nccl" runs the group on NCCL over this
/// rank's current CUDA device (a "cuda" DeviceMesh makes its groups so). The world group itself
/// stays on a CPU backend: it coordinates the host side (checkpoints, the trainer's votes).
/// Throws c10::Error for an unknown backend, and for "nccl" in a build without the CUDA path
/// (-DFSDP_USE_CUDA=ON) or in a job whose world runs on MPI (NCCL needs the rendezvous store).
std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks, const std::string& backend);

}  // namespace fsdp
