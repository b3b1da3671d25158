// Counting CPU allocator and /proc based RSS readers (see include/fsdp/memory.h).
//
// Design of the counting allocator
// --------------------------------
// CountingAllocator wraps the CPU allocator that was current when it was installed (c10's
// default). allocate(n) asks the wrapped allocator for n + kHeader bytes and writes a small
// header at the start of that block:
//
//   [ Header: n, wrapped deleter, wrapped context | padding ][ n bytes returned to the caller ]
//   ^ wrapped DataPtr.get()                               ^ our DataPtr: data == context
//
// The returned DataPtr has data == context == the user pointer and a single static deleter.
// The deleter steps back kHeader bytes, subtracts n from the counters and frees the block by
// calling the wrapped DataPtr's own deleter with its own context, so the block always goes
// back to the allocator that made it.
//
// Why a header and not a heap-allocated context object holding the wrapped DataPtr:
//   - no extra malloc/free per tensor;
//   - data == context keeps the DataPtr "simple", which LibTorch relies on: raw_allocate()
//     asserts it, and 2.x copy-on-write (lazy clone) only wraps simple DataPtrs;
//   - raw_deleter() can return the one static deleter;
//   - every allocation carries its own wrapped deleter, so changing what we wrap later is safe.
// The cost is kHeader (64) extra bytes per allocation; the counters report the requested n.
// kHeader is a multiple of c10::gAlignment, so the returned pointer keeps the wrapped
// allocator's alignment (64 bytes for c10's default).
//
// Installation runs from a static initializer in this file, i.e. when libfsdp is loaded
// (after libc10, which it depends on, has registered its default allocator). The allocator
// object is created with new and never destroyed, so tensors freed during static destruction
// at exit still find it.
#include <fsdp/memory.h>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/alignment.h>
#include <c10/util/Exception.h>

#include <malloc.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <vector>

namespace fsdp {
namespace memory {
namespace {

// Priority passed to c10::SetCPUAllocator. c10 registers its default with 0 and replaces an
// allocator only with one of equal or higher priority; 100 keeps ours in place against
// default-priority registrations and still lets a user wrap ours with a higher priority.
constexpr uint8_t kInstallPriority = 100;

struct Header {
  size_t nbytes;              // what the caller asked for (what we count)
  size_t capacity;            // usable bytes after the header
  c10::DeleterFnPtr deleter;  // the wrapped DataPtr's deleter ...
  void* context;              // ... and its context
};

constexpr size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }
constexpr size_t kHeader = round_up(sizeof(Header), c10::gAlignment);

// ------------------------------------------------------------------------------ block cache
//
// Freed blocks of at least kCacheMin bytes are kept and handed out again for requests of about
// the same size (at most a quarter larger), as the CUDA caching allocator does for GPU memory.
// Why: glibc gives large blocks back to the kernel (every block of kCacheMin or more is its own
// mmap: set_glibc_mmap_threshold), and first-touching fresh pages can cost more than the work
// done on them (~100 ms to fault in 32 MiB on a 2-vCPU VM). A training step allocates the same
// sizes every iteration, so after the first step they come from here. Blocks are rounded up to
// kCacheRound so that near-equal sizes share them.
//
// A request the cache cannot serve first gives back cached blocks, the longest unused first, of
// at least its own size: a new block is then taken from the system only in place of cached ones
// (or when the cache is empty), so the resident memory stays the live tensors' plus at most
// about one block, instead of the live tensors' plus every size a step ever freed (at a 0.85 B
// Llama's step, 1.4 GiB of blocks no request of that moment could use).
constexpr size_t kCacheMin = size_t{256} << 10;
constexpr size_t kCacheRound = size_t{64} << 10;

int64_t default_cache_limit() {
  if (const char* mb = std::getenv("FSDP_CPU_CACHE_LIMIT_MB")) return std::atoll(mb) << 20;
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page / 4 : int64_t{1} << 30;
}

CacheRelease cache_release_default() {
  const char* v = std::getenv("FSDP_CPU_CACHE_RELEASE");
  if (v == nullptr || v[0] == '\0' || std::strcmp(v, "on_miss") == 0) return CacheRelease::kOnMiss;
  if (std::strcmp(v, "at_limit") == 0) return CacheRelease::kAtLimit;
  std::fprintf(stderr,
               "fsdp: FSDP_CPU_CACHE_RELEASE=%s is neither on_miss nor at_limit; the block cache uses on_miss "
               "(fsdp/memory.h says what each does)\n",
               v);
  return CacheRelease::kOnMiss;
}

bool caching_default() {
  const char* v = std::getenv("FSDP_CPU_CACHING");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

// glibc raises its mmap threshold up to 32 MiB as large blocks are freed, after which blocks
// below it come from the heap and stay resident when freed in its middle (a model built a
// layer at a time, then sharded, leaves 0.7 GiB of such holes at 0.85 B parameters). The block
// cache keeps the blocks worth keeping, so glibc is asked to map every block of kCacheMin or
// more on its own, and to unmap it when it is given back. FSDP_CPU_MALLOC_DEFAULTS=1 in the
// environment leaves glibc's own policy.
bool set_glibc_mmap_threshold() {
  const char* keep = std::getenv("FSDP_CPU_MALLOC_DEFAULTS");
  if (keep != nullptr && keep[0] != '\0' && std::strcmp(keep, "0") != 0) return false;
  return mallopt(M_MMAP_THRESHOLD, static_cast<int>(kCacheMin)) == 1;
}

struct BlockCache {
  std::mutex mu;
  std::multimap<size_t, std::pair<char*, uint64_t>> free;  // capacity -> (block (header first), age)
  std::map<uint64_t, std::multimap<size_t, std::pair<char*, uint64_t>>::iterator> by_age;  // oldest first
  uint64_t next_age = 0;
  std::atomic<int64_t> cached{0};
  std::atomic<bool> enabled{caching_default()};
  std::atomic<CacheRelease> release_policy{cache_release_default()};
  const int64_t limit = default_cache_limit();

  char* take(size_t capacity) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = free.lower_bound(capacity);
    if (it == free.end() || it->first > capacity + capacity / 4) return nullptr;
    char* block = it->second.first;
    cached.fetch_sub(static_cast<int64_t>(it->first), std::memory_order_relaxed);
    by_age.erase(it->second.second);
    free.erase(it);
    return block;
  }
  // `enabled` is read under the lock, and set_enabled() flips it under the lock: a block freed
  // while caching is being turned off is either emptied with the rest or not cached at all.
  bool put(char* block, size_t capacity) {
    std::lock_guard<std::mutex> lock(mu);
    if (!enabled.load(std::memory_order_relaxed)) return false;
    if (cached.load(std::memory_order_relaxed) + static_cast<int64_t>(capacity) > limit) return false;
    const uint64_t age = next_age++;
    by_age.emplace(age, free.emplace(capacity, std::make_pair(block, age)));
    cached.fetch_add(static_cast<int64_t>(capacity), std::memory_order_relaxed);
    return true;
  }
  void set_enabled(bool on) {
    {
      std::lock_guard<std::mutex> lock(mu);
      enabled.store(on, std::memory_order_relaxed);
    }
    if (!on) release_all();
  }
  // Gives back the blocks unused longest until `bytes` are given back or none is left (all of
  // them for SIZE_MAX). The deleters run outside the lock.
  void release(size_t bytes) {
    std::vector<Header> blocks;
    {
      std::lock_guard<std::mutex> lock(mu);
      size_t freed = 0;
      while (freed < bytes && !by_age.empty()) {
        const auto entry = by_age.begin()->second;
        blocks.push_back(*reinterpret_cast<const Header*>(entry->second.first));
        freed += entry->first;
        cached.fetch_sub(static_cast<int64_t>(entry->first), std::memory_order_relaxed);
        free.erase(entry);
        by_age.erase(by_age.begin());
      }
    }
    for (const Header& h : blocks) {
      if (h.deleter != nullptr) h.deleter(h.context);
    }
  }
  void release_all() { release(SIZE_MAX); }
};

BlockCache& block_cache() {
  static BlockCache* cache = new BlockCache();  // never destroyed, like the allocator
  return *cache;
}

// Counters: plain globals of trivially destructible atomics, constant-initialised, so they are
// usable before any constructor runs and after every destructor has run.
std::atomic<int64_t> g_live{0};
std::atomic<int64_t> g_peak{0};
std::atomic<int64_t> g_count{0};
std::atomic<int64_t> g_live_count{0};
std::atomic<int64_t> g_limit{0};  // 0: no limit (set_allocation_limit)

// Refuses an allocation of n bytes that would take the live bytes past the limit. Checked
// before the block is taken, so a refused allocation changes no counter.
void check_limit(size_t n) {
  const int64_t limit = g_limit.load(std::memory_order_relaxed);
  if (limit <= 0) return;
  const int64_t live = g_live.load(std::memory_order_relaxed);
  TORCH_CHECK(live + static_cast<int64_t>(n) <= limit, "CPU out of memory: tried to allocate ", n, " bytes with ", live,
              " bytes of tensors allocated, over the limit of ", limit,
              " bytes set by fsdp::memory::set_allocation_limit; raise the limit or allocate less");
}

void note_alloc(int64_t n) {
  const int64_t now = g_live.fetch_add(n, std::memory_order_relaxed) + n;
  g_count.fetch_add(1, std::memory_order_relaxed);
  g_live_count.fetch_add(1, std::memory_order_relaxed);
  int64_t peak = g_peak.load(std::memory_order_relaxed);
  while (now > peak && !g_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

void counting_delete(void* ptr) {
  if (ptr == nullptr) return;
  auto* h = reinterpret_cast<Header*>(static_cast<char*>(ptr) - kHeader);
  const Header copy = *h;  // read before the block goes away
  g_live.fetch_sub(static_cast<int64_t>(copy.nbytes), std::memory_order_relaxed);
  g_live_count.fetch_sub(1, std::memory_order_relaxed);
  if (copy.capacity >= kCacheMin && block_cache().put(reinterpret_cast<char*>(h), copy.capacity)) return;
  if (copy.deleter != nullptr) copy.deleter(copy.context);
}

class CountingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    c10::Allocator* inner = wrapped_.load(std::memory_order_acquire);
    if (n == 0 || inner == nullptr) {
      // Nothing to count. Keep one deleter for every DataPtr we return (raw_deleter()).
      return {nullptr, nullptr, &counting_delete, c10::Device(c10::DeviceType::CPU)};
    }
    check_limit(n);
    size_t capacity = n;
    if (n >= kCacheMin && block_cache().enabled.load(std::memory_order_relaxed)) {
      capacity = round_up(n, kCacheRound);
      if (char* cached = block_cache().take(capacity)) {
        reinterpret_cast<Header*>(cached)->nbytes = n;
        note_alloc(static_cast<int64_t>(n));
        void* user = cached + kHeader;
        return {user, user, &counting_delete, c10::Device(c10::DeviceType::CPU)};
      }
      // A new block in place of cached ones, not beside them (kAtLimit: put() keeps the limit).
      if (block_cache().release_policy.load(std::memory_order_relaxed) == CacheRelease::kOnMiss)
        block_cache().release(capacity);
    }
    c10::DataPtr block = inner->allocate(capacity + kHeader);
    char* base = static_cast<char*>(block.get());
    const c10::Device device = block.device();
    Header h{n, capacity, block.get_deleter(), nullptr};
    h.context = block.release_context();  // we own the block from here on
    std::memcpy(base, &h, sizeof h);
    note_alloc(static_cast<int64_t>(n));
    void* user = base + kHeader;
    return {user, user, &counting_delete, device};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &counting_delete; }

  // Copies between two blocks of this allocator (Allocator::clone uses it): the wrapped
  // allocator's way, which is a memcpy for CPU memory.
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    c10::Allocator* inner = wrapped_.load(std::memory_order_acquire);
    if (inner != nullptr) {
      inner->copy_data(dest, src, count);
      return;
    }
    std::memcpy(dest, src, count);
  }

  // Sets the allocator to delegate to. Safe while others allocate: every block remembers the
  // deleter of the allocator that made it.
  void wrap(c10::Allocator* inner) { wrapped_.store(inner, std::memory_order_release); }
  bool wraps_something() const { return wrapped_.load(std::memory_order_acquire) != nullptr; }

 private:
  std::atomic<c10::Allocator*> wrapped_{nullptr};
};

CountingAllocator& counting_allocator() {
  static CountingAllocator* instance = new CountingAllocator();  // never destroyed
  return *instance;
}

std::mutex& install_mutex() {
  static std::mutex* m = new std::mutex();  // never destroyed
  return *m;
}

// Installs when libfsdp is loaded, unless FSDP_DISABLE_MEMORY_TRACKING is set to something
// other than "" or "0".
bool install_at_load() {
  const char* off = std::getenv("FSDP_DISABLE_MEMORY_TRACKING");
  if (off != nullptr && off[0] != '\0' && std::strcmp(off, "0") != 0) return false;
  return install_tracking_allocator();
}
const bool g_installed_at_load = install_at_load();
const bool g_mmap_threshold_set = set_glibc_mmap_threshold();

// Returns the value (in kB) of `key:` in /proc/self/status, or -1.
int64_t status_kib(const char* key) {
  std::ifstream f("/proc/self/status");
  if (!f) return -1;
  const size_t klen = std::strlen(key);
  std::string line;
  while (std::getline(f, line)) {
    if (line.compare(0, klen, key) == 0 && line.size() > klen && line[klen] == ':') {
      long long kib = -1;
      if (std::sscanf(line.c_str() + klen + 1, "%lld", &kib) == 1) return kib;
      return -1;
    }
  }
  return -1;
}

std::string mib(int64_t bytes, int digits) {
  if (bytes < 0) return "n/a";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f MiB", digits, static_cast<double>(bytes) / (1 << 20));
  return buf;
}

}  // namespace

bool install_tracking_allocator() {
  std::lock_guard<std::mutex> lock(install_mutex());
  CountingAllocator& counting = counting_allocator();
  c10::Allocator* current = c10::GetCPUAllocator();
  if (current == &counting) return true;
  if (!counting.wraps_something()) {
    counting.wrap(current);
  }
  // Later calls (someone replaced us) re-install with the allocator first wrapped; wrapping
  // the new current one could make a cycle if it wraps us.
  c10::SetCPUAllocator(&counting, kInstallPriority);
  return c10::GetCPUAllocator() == &counting;
}

bool tracking_allocator_installed() { return c10::GetCPUAllocator() == &counting_allocator(); }

int64_t allocated_bytes() { return g_live.load(std::memory_order_relaxed); }
int64_t max_allocated_bytes() { return g_peak.load(std::memory_order_relaxed); }
void reset_peak_allocated() { g_peak.store(g_live.load(std::memory_order_relaxed), std::memory_order_relaxed); }
int64_t allocation_count() { return g_count.load(std::memory_order_relaxed); }
int64_t cached_bytes() { return block_cache().cached.load(std::memory_order_relaxed); }
int64_t reserved_bytes() { return allocated_bytes() + cached_bytes(); }
void empty_cache() { block_cache().release_all(); }
void set_caching_enabled(bool enabled) { block_cache().set_enabled(enabled); }
bool caching_enabled() { return block_cache().enabled.load(std::memory_order_relaxed); }
void set_cache_release(CacheRelease release) { block_cache().release_policy.store(release, std::memory_order_relaxed); }
CacheRelease cache_release() { return block_cache().release_policy.load(std::memory_order_relaxed); }
int64_t live_allocation_count() { return g_live_count.load(std::memory_order_relaxed); }

void set_allocation_limit(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "fsdp::memory::set_allocation_limit: ", bytes, " bytes is negative; pass 0 for no limit");
  g_limit.store(bytes, std::memory_order_relaxed);
}
int64_t allocation_limit() { return g_limit.load(std::memory_order_relaxed); }

int64_t current_rss_bytes() {
  std::ifstream f("/proc/self/statm");
  long long size_pages = 0, resident_pages = -1;
  if (!(f >> size_pages >> resident_pages) || resident_pages < 0) {
    const int64_t kib = status_kib("VmRSS");
    return kib < 0 ? -1 : kib * 1024;
  }
  return static_cast<int64_t>(resident_pages) * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

int64_t peak_rss_bytes() {
  const int64_t kib = status_kib("VmHWM");
  return kib < 0 ? -1 : kib * 1024;
}

bool reset_peak_rss(std::string* error) {
  FILE* f = std::fopen("/proc/self/clear_refs", "w");
  if (f == nullptr) {
    if (error != nullptr) *error = std::string("cannot open /proc/self/clear_refs: ") + std::strerror(errno);
    return false;
  }
  const bool wrote = std::fputs("5", f) >= 0;
  const int write_errno = errno;
  const bool closed = std::fclose(f) == 0;  // the kernel reports a rejected value here
  if (!wrote || !closed) {
    if (error != nullptr)
      *error = std::string("writing 5 to /proc/self/clear_refs failed: ") + std::strerror(wrote ? errno : write_errno);
    return false;
  }
  return true;
}

std::string MemoryStats::to_string() const {
  std::ostringstream s;
  if (tracking) {
    s << "tensors " << mib(allocated_bytes, 2) << " (peak " << mib(max_allocated_bytes, 2) << ", "
      << live_allocation_count << " live / " << allocation_count << " allocs)";
  } else {
    s << "tensors: not tracked";
  }
  s << ", cached " << mib(cached_bytes, 2);
  s << ", RSS " << mib(current_rss_bytes, 1) << " (peak " << mib(peak_rss_bytes, 1) << ")";
  return s.str();
}

MemoryStats memory_stats() {
  MemoryStats m;
  m.tracking = tracking_allocator_installed();
  m.allocated_bytes = allocated_bytes();
  m.max_allocated_bytes = max_allocated_bytes();
  m.allocation_count = allocation_count();
  m.live_allocation_count = live_allocation_count();
  m.cached_bytes = cached_bytes();
  m.current_rss_bytes = current_rss_bytes();
  m.peak_rss_bytes = peak_rss_bytes();
  return m;
}

}  // namespace memory
}  // namespace fsdp
