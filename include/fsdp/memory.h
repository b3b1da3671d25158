// layer: util (what may include what: docs/architecture.md)
/// \file
/// fsdp/memory.h — CPU memory accounting: the analogue of torch.cuda.memory_allocated(),
/// max_memory_allocated() and reset_peak_memory_stats(), plus the process's resident set.
///
/// \code{.cpp}
///   fsdp::memory::reset_peak_allocated();
///   train_step();
///   std::printf("%s\n", fsdp::memory::memory_stats().to_string().c_str());
/// \endcode
///
/// Tensor bytes are counted by a wrapper around LibTorch's CPU allocator. Linking the fsdp
/// library installs it when the library is loaded, so nothing has to be called first.
/// Setting the environment variable FSDP_DISABLE_MEMORY_TRACKING=1 skips that automatic
/// installation (install_tracking_allocator() still works); the counters then stay at 0.
///
/// What is counted: every CPU storage allocated through c10's CPU allocator after the wrapper
/// was installed (at::empty, at::randn, results of CPU ops, resizes of such storages). The
/// number is the bytes that were requested, not what malloc rounds them up to.
///
/// What is not counted:
/// \code{.cpp}
///   - storages allocated before installation (for example by another library's static
///     initializers). They are freed correctly. A storage keeps the allocator it was created
///     with, so later resizes of such a storage are not counted either;
///   - memory that does not come from the c10 allocator: BLAS and oneDNN scratch buffers,
///     gloo's internal buffers (std::vector), MPI buffers, tensors made with from_blob,
///     and plain malloc/new;
///   - CUDA memory (use the CUDA caching allocator's statistics for that).
/// \endcode
///
/// The RSS functions report what the kernel sees for the whole process, including the
/// ~180 MiB LibTorch baseline. RSS depends on glibc: a freed block is not always given back to
/// the kernel (the dynamic mmap threshold grows after a large free, so later medium-sized
/// blocks come from the heap and stay resident). For RSS measurements that follow the tensor
/// numbers, fix the thresholds, e.g. MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=131072.
#pragma once

#include <cstdint>
#include <string>

namespace fsdp {
namespace memory {

/// Installs the counting allocator as LibTorch's CPU allocator if it is not the current one.
/// The first call wraps the allocator that is current at that moment (normally c10's
/// default). It is called automatically when the fsdp library is loaded; calling it again is
/// harmless. If some other code has since replaced the CPU allocator with a higher priority,
/// the counting allocator cannot take its place back and this returns false.
/// Returns true if the counting allocator is the current CPU allocator after the call.
/// Thread-safe, but LibTorch's allocator registry itself is not meant to be changed while
/// other threads allocate: call it at start-up, as the library does.
bool install_tracking_allocator();

/// True if the counting allocator is LibTorch's current CPU allocator. Cheap.
bool tracking_allocator_installed();

/// Caching of large blocks. Freed tensor storage of 256 KiB or more is kept and reused for later
/// allocations of about the same size (up to a quarter larger), like the CUDA caching
/// allocator's: a training step allocates the same sizes every iteration, and handing a block
/// back to glibc means faulting fresh pages in next time, which on some machines costs more than
/// the work done on them. On by default; FSDP_CPU_CACHING=0 in the environment turns it off at
/// start-up, and FSDP_CPU_CACHE_LIMIT_MB caps it (default: a quarter of physical memory).
/// An allocation that no cached block fits first gives back cached blocks of at least its size,
/// the longest unused first, so that the cache holds freed memory only in place of what the
/// process would otherwise take anew: resident memory stays near the live tensors' peak
/// (CacheRelease::kOnMiss, below, the default). Blocks
/// of 256 KiB or more are mapped by glibc one by one (its mmap threshold is set to that size when
/// the library loads; FSDP_CPU_MALLOC_DEFAULTS=1 keeps glibc's own), so a block given back
/// leaves the resident memory at once.
/// Cached bytes are not in allocated_bytes(); they are resident (RSS) until given back.
int64_t cached_bytes();
/// allocated_bytes() + cached_bytes(): what the allocator holds (torch.cuda.memory_reserved).
int64_t reserved_bytes();
/// Gives every cached block back to the system allocator. Thread-safe.
void empty_cache();
/** @{ */
/// Turns caching on or off (off also empties the cache). Thread-safe.
void set_caching_enabled(bool enabled);
bool caching_enabled();
/** @} */

/// When the block cache gives blocks back.
enum class CacheRelease {
  /// At every request no cached block fits: cached blocks of at least its size, the longest
  /// unused first. Resident memory stays near the live tensors' peak, which `fsdp-train plan`
  /// predicts; but a step whose sizes do not all fit the blocks freed before them gives back
  /// blocks it needs again later in the step, and faults their pages in anew every step.
  kOnMiss,
  /// Only what would take the cache past its limit (FSDP_CPU_CACHE_LIMIT_MB): a freed block that
  /// does not fit under it. A step then reuses the blocks of the steps before it (the llama_small
  /// of the link benchmark, 4 x 256 per rank on 2 ranks: 9x fewer page faults, a step 19-25 %
  /// shorter), and resident memory grows by the blocks kept beside the live ones (there: 393 to
  /// 448 MiB, 22 % of its peak tensors).
  kAtLimit,
};
/** @{ */
/// Sets and reads the policy (thread-safe; a new one applies to the requests that follow). At
/// start-up it is FSDP_CPU_CACHE_RELEASE from the environment, `on_miss` (the default) or
/// `at_limit`; any other value is reported on stderr, once, and on_miss used.
void set_cache_release(CacheRelease release);
CacheRelease cache_release();
/** @} */

/// Bytes of CPU tensor storage that are allocated now (live), as counted above.
/// Thread-safe; one atomic load.
int64_t allocated_bytes();

/// The largest value allocated_bytes() has had since the allocator was installed or since the
/// last reset_peak_allocated(). Thread-safe; one atomic load.
int64_t max_allocated_bytes();

/// Sets the peak to the current live bytes, so that max_allocated_bytes() measures the peak of
/// what follows. Thread-safe; an allocation that races with the reset may or may not be
/// reflected in the new peak.
void reset_peak_allocated();

/// Number of counted allocations since installation (never decreases). Thread-safe; cheap.
int64_t allocation_count();

/// Number of counted allocations that are still alive. Thread-safe; cheap.
int64_t live_allocation_count();

/** @{ */
/// A cap on allocated_bytes(), for tests and for runs that must stay inside a memory budget:
/// with a limit of L > 0 bytes, an allocation of n bytes while allocated_bytes() + n > L throws
/// c10::Error ("CPU out of memory: ...", naming the sizes and the limit) from the operation that
/// allocates, as an out-of-memory CUDA allocation does, and changes no counter. 0 (the default)
/// removes the limit. It sees only what the counters see (above): it caps tensor storage, not
/// the process. Allocations racing in other threads are checked one by one against the live
/// bytes, so together they may pass the limit by up to their own sizes. Throws c10::Error for a
/// negative value. Thread-safe; the limit is one atomic.
void set_allocation_limit(int64_t bytes);
int64_t allocation_limit();
/** @} */

/// The process's resident set size in bytes, from /proc/self/statm, or -1 if it cannot be
/// read. Thread-safe; reads a /proc file (microseconds), so do not call it per operation.
int64_t current_rss_bytes();

/// The process's peak resident set size in bytes (VmHWM in /proc/self/status) since start or
/// since the last successful reset_peak_rss(), or -1 if it cannot be read.
/// Thread-safe; reads a /proc file.
int64_t peak_rss_bytes();

/// Resets the peak RSS (VmHWM) to the current RSS by writing "5" to /proc/self/clear_refs.
/// Returns true on success. Returns false, changing nothing, where that is not permitted or
/// not supported (kernels before 4.0, some sandboxes, no /proc); if `error` is non-null it then
/// receives a one-line reason. Thread-safe; one small write to /proc.
bool reset_peak_rss(std::string* error = nullptr);

/// A snapshot of all the numbers above. Taking one reads two /proc files.
struct MemoryStats {
  bool tracking = false;              ///< tracking_allocator_installed()
  int64_t allocated_bytes = 0;        ///< live tensor bytes
  int64_t max_allocated_bytes = 0;    ///< peak tensor bytes since install or reset
  int64_t allocation_count = 0;       ///< allocations since install
  int64_t live_allocation_count = 0;  ///< allocations alive now
  int64_t cached_bytes = 0;           ///< freed blocks kept for reuse
  int64_t current_rss_bytes = -1;     ///< -1: unavailable
  int64_t peak_rss_bytes = -1;        ///< -1: unavailable

  /// One line in MiB, e.g.
  /// "tensors 64.00 MiB (peak 128.00 MiB, 3 live / 17 allocs), cached 8.00 MiB,
  ///  RSS 245.1 MiB (peak 310.4 MiB)".
  std::string to_string() const;
};

/// Takes a snapshot. Thread-safe. The fields are read one after another, not atomically
/// together.
MemoryStats memory_stats();

}  // namespace memory
}  // namespace fsdp
