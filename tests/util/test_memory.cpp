// fsdp::memory: the counting CPU allocator (live/peak tensor bytes) and the RSS readers.
// Single process. Other code in the same process may allocate too, so the checks compare
// differences with a small slack instead of exact totals.
#include <fsdp/memory.h>

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t k64MiB = 64 * kMiB;
constexpr int64_t kSlack = 1 * kMiB;  // room for unrelated small allocations

}  // namespace

TEST(Memory, InstalledWhenLibraryLoads) {
  // Nothing in this test calls install_tracking_allocator() before this check.
  EXPECT_TRUE(fsdp::memory::tracking_allocator_installed());
  EXPECT_TRUE(fsdp::memory::install_tracking_allocator());  // idempotent
  EXPECT_TRUE(fsdp::memory::install_tracking_allocator());
  EXPECT_TRUE(fsdp::memory::tracking_allocator_installed());
}

TEST(Memory, LiveAndPeakFollowA64MiBTensor) {
  ASSERT_TRUE(fsdp::memory::install_tracking_allocator());
  fsdp::memory::reset_peak_allocated();
  const int64_t live0 = fsdp::memory::allocated_bytes();
  const int64_t count0 = fsdp::memory::allocation_count();
  EXPECT_EQ(fsdp::memory::max_allocated_bytes(), live0);

  int64_t peak_with_tensor = 0;
  {
    at::Tensor t = at::empty({k64MiB / 4}, at::kFloat);
    t.fill_(1.0f);  // touch it
    const int64_t live1 = fsdp::memory::allocated_bytes();
    EXPECT_GE(live1 - live0, k64MiB);
    EXPECT_LT(live1 - live0, k64MiB + kSlack);
    peak_with_tensor = fsdp::memory::max_allocated_bytes();
    EXPECT_GE(peak_with_tensor, live0 + k64MiB);
    EXPECT_GE(fsdp::memory::allocation_count(), count0 + 1);
    EXPECT_GE(fsdp::memory::live_allocation_count(), 1);
  }
  // Freed: live drops back, the peak stays.
  const int64_t live2 = fsdp::memory::allocated_bytes();
  EXPECT_LT(live2 - live0, kSlack);
  EXPECT_GT(live0 - live2, -kSlack);
  EXPECT_GE(fsdp::memory::max_allocated_bytes(), peak_with_tensor);

  // Reset: the peak becomes the current live value.
  fsdp::memory::reset_peak_allocated();
  EXPECT_EQ(fsdp::memory::max_allocated_bytes(), fsdp::memory::allocated_bytes());
}

TEST(Memory, PeakIsTheHighWaterMarkOfASequence) {
  fsdp::memory::reset_peak_allocated();
  const int64_t live0 = fsdp::memory::allocated_bytes();
  {
    at::Tensor a = at::zeros({16 * kMiB / 4});  // 16 MiB
    at::Tensor b = at::zeros({32 * kMiB / 4});  // +32 MiB = 48 MiB live
  }
  {
    at::Tensor c = at::zeros({8 * kMiB / 4});  // 8 MiB live afterwards
    EXPECT_GE(fsdp::memory::allocated_bytes() - live0, 8 * kMiB);
  }
  const int64_t peak = fsdp::memory::max_allocated_bytes() - live0;
  EXPECT_GE(peak, 48 * kMiB);
  EXPECT_LT(peak, 48 * kMiB + kSlack);
}

TEST(Memory, ResizeBytesOfAStorageIsCounted) {
  // The FSDP free/refill path: resize a parameter's storage to 0 and back.
  at::Tensor w = at::ones({1024, 1024});  // 4 MiB
  const int64_t live0 = fsdp::memory::allocated_bytes();
  c10::StorageImpl* si = w.storage().unsafeGetStorageImpl();
  const size_t n = si->nbytes();
  si->set_data_ptr_noswap(si->allocator()->allocate(0));
  si->set_nbytes(0);
  EXPECT_LE(fsdp::memory::allocated_bytes() - live0, -4 * kMiB + kSlack);
  si->set_data_ptr_noswap(si->allocator()->allocate(n));
  si->set_nbytes(n);
  EXPECT_GE(fsdp::memory::allocated_bytes() - live0, -kSlack);
  w.fill_(2.0f);
  EXPECT_EQ(w.sum().item<float>(), 2.0f * 1024 * 1024);
}

TEST(Memory, AllocationInAnotherThreadIsCounted) {
  const int64_t live0 = fsdp::memory::allocated_bytes();
  at::Tensor from_thread;
  int64_t seen_in_thread = 0;
  std::thread th([&] {
    from_thread = at::ones({k64MiB / 4});
    seen_in_thread = fsdp::memory::allocated_bytes();
  });
  th.join();
  EXPECT_GE(seen_in_thread - live0, k64MiB);
  EXPECT_GE(fsdp::memory::allocated_bytes() - live0, k64MiB);
  from_thread.reset();  // freed on this thread
  EXPECT_LT(fsdp::memory::allocated_bytes() - live0, kSlack);
}

TEST(Memory, ManyThreadsBalanceToZero) {
  const int64_t live0 = fsdp::memory::allocated_bytes();
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([] {
      for (int i = 0; i < 200; ++i) {
        at::Tensor x = at::empty({1000 + i});
        at::Tensor y = x + 1;  // results of ops are counted too
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_LT(std::abs(fsdp::memory::allocated_bytes() - live0), kSlack);
}

TEST(Memory, ZeroSizedAndRawAllocations) {
  const int64_t live0 = fsdp::memory::allocated_bytes();
  { at::Tensor e = at::empty({0}); }
  c10::Allocator* a = c10::GetCPUAllocator();
  void* p = a->raw_allocate(4096);  // asserts data == context internally
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);  // keeps c10's 64-byte alignment
  EXPECT_GE(fsdp::memory::allocated_bytes() - live0, 4096);
  a->raw_deallocate(p);
  EXPECT_LT(std::abs(fsdp::memory::allocated_bytes() - live0), kSlack);
}

TEST(Memory, RssIsPositiveAndBelowItsPeak) {
  fsdp::memory::empty_cache();  // a cached, already resident block would not raise RSS
  const int64_t rss = fsdp::memory::current_rss_bytes();
  const int64_t peak = fsdp::memory::peak_rss_bytes();
  ASSERT_GT(rss, 0);
  ASSERT_GT(peak, 0);
  EXPECT_GE(peak, rss - kSlack);  // the two files are read at slightly different moments

  // A touched 64 MiB tensor raises RSS and its peak.
  at::Tensor t = at::ones({k64MiB / 4});
  EXPECT_GE(fsdp::memory::current_rss_bytes(), rss + k64MiB - 4 * kMiB);
  EXPECT_GE(fsdp::memory::peak_rss_bytes(), rss + k64MiB - 4 * kMiB);
}

TEST(Memory, ResetPeakRss) {
  fsdp::memory::empty_cache();
  {
    at::Tensor t = at::ones({k64MiB / 4});  // make sure the peak is above what follows
  }
  fsdp::memory::empty_cache();  // and that its pages go back to the system
  const int64_t peak_before = fsdp::memory::peak_rss_bytes();
  std::string error;
  if (!fsdp::memory::reset_peak_rss(&error)) {
    EXPECT_FALSE(error.empty());
    GTEST_SKIP() << "reset_peak_rss unavailable here: " << error;
  }
  const int64_t peak_after = fsdp::memory::peak_rss_bytes();
  const int64_t rss = fsdp::memory::current_rss_bytes();
  // Not above the old peak, give or take pages touched meanwhile (under ASan freed memory stays
  // in its quarantine, so RSS never drops and the peak sits right at it).
  EXPECT_LE(peak_after, peak_before + kMiB);
  // After the reset the peak is the current RSS (give or take pages touched meanwhile).
  EXPECT_LT(peak_after, rss + 8 * kMiB);
  EXPECT_GE(peak_after, rss - 8 * kMiB);
}

TEST(Memory, StatsSnapshot) {
  at::Tensor t = at::zeros({kMiB / 4});
  const fsdp::memory::MemoryStats s = fsdp::memory::memory_stats();
  EXPECT_TRUE(s.tracking);
  EXPECT_GE(s.allocated_bytes, kMiB);
  EXPECT_GE(s.max_allocated_bytes, s.allocated_bytes);
  EXPECT_GE(s.allocation_count, s.live_allocation_count);
  EXPECT_GT(s.current_rss_bytes, 0);
  const std::string text = s.to_string();
  EXPECT_NE(text.find("MiB"), std::string::npos) << text;
  EXPECT_NE(text.find("RSS"), std::string::npos) << text;
}

TEST(Memory, LargeFreedBlocksAreCachedAndReused) {
  ASSERT_TRUE(fsdp::memory::caching_enabled());
  fsdp::memory::empty_cache();
  EXPECT_EQ(fsdp::memory::cached_bytes(), 0);
  const int64_t live = fsdp::memory::allocated_bytes();
  void* first = nullptr;
  {
    at::Tensor t = at::empty({4 * kMiB / 4});
    first = t.data_ptr();
  }
  // Freed: not live any more, but kept (rounded up to 64 KiB).
  EXPECT_EQ(fsdp::memory::allocated_bytes(), live);
  EXPECT_GE(fsdp::memory::cached_bytes(), 4 * kMiB);
  EXPECT_EQ(fsdp::memory::reserved_bytes(), live + fsdp::memory::cached_bytes());
  {
    at::Tensor again = at::empty({4 * kMiB / 4 - 1000});  // a little smaller: same block
    EXPECT_EQ(again.data_ptr(), first);
    EXPECT_EQ(fsdp::memory::cached_bytes(), 0);
    EXPECT_EQ(fsdp::memory::allocated_bytes(), live + (4 * kMiB / 4 - 1000) * 4);
    at::Tensor much_smaller = at::empty({kMiB / 4});  // too small to take a 4 MiB block
    EXPECT_NE(much_smaller.data_ptr(), first);
  }
  fsdp::memory::empty_cache();
  EXPECT_EQ(fsdp::memory::cached_bytes(), 0);
  // Small blocks are never cached; with caching off nothing is.
  { at::Tensor small = at::empty({1000}); }
  EXPECT_EQ(fsdp::memory::cached_bytes(), 0);
  fsdp::memory::set_caching_enabled(false);
  { at::Tensor big = at::empty({4 * kMiB / 4}); }
  EXPECT_EQ(fsdp::memory::cached_bytes(), 0);
  fsdp::memory::set_caching_enabled(true);
}

// A request no cached block fits gives cached blocks back first, the longest unused first: the
// cache never holds freed memory beside a block newly taken from the system (a 0.85 B Llama's
// step held 1.4 GiB so), and what it keeps for reuse is what was freed most recently.
TEST(Memory, AMissGivesBackCachedBlocksBeforeTakingANewOne) {
  ASSERT_TRUE(fsdp::memory::caching_enabled());
  fsdp::memory::empty_cache();
  void* recent = nullptr;
  {
    at::Tensor old_block = at::empty({8 * kMiB / 4});
    at::Tensor recent_block = at::empty({2 * kMiB / 4});
    recent = recent_block.data_ptr();
    old_block.reset();  // freed first: the longest unused
  }
  EXPECT_GE(fsdp::memory::cached_bytes(), 10 * kMiB);
  {
    // 1 MiB: neither block fits (more than a quarter larger); giving back the 8 MiB block is
    // enough, and the 2 MiB one stays for the next request of its size.
    at::Tensor miss = at::empty({kMiB / 4});
    EXPECT_GE(fsdp::memory::cached_bytes(), 2 * kMiB);
    EXPECT_LT(fsdp::memory::cached_bytes(), 3 * kMiB);
    at::Tensor hit = at::empty({2 * kMiB / 4});
    EXPECT_EQ(hit.data_ptr(), recent);
    EXPECT_EQ(fsdp::memory::cached_bytes(), 0);
  }
  fsdp::memory::empty_cache();
}

// With CacheRelease::kAtLimit the same miss keeps both cached blocks: the next request of
// either size takes its own block back, and no page is faulted in anew.
TEST(Memory, AtLimitAMissKeepsTheCachedBlocks) {
  ASSERT_EQ(fsdp::memory::cache_release(), fsdp::memory::CacheRelease::kOnMiss);
  fsdp::memory::empty_cache();
  fsdp::memory::set_cache_release(fsdp::memory::CacheRelease::kAtLimit);
  void* old_ptr = nullptr;
  void* recent = nullptr;
  {
    at::Tensor old_block = at::empty({8 * kMiB / 4});
    at::Tensor recent_block = at::empty({2 * kMiB / 4});
    old_ptr = old_block.data_ptr();
    recent = recent_block.data_ptr();
  }
  const int64_t cached = fsdp::memory::cached_bytes();
  EXPECT_GE(cached, 10 * kMiB);
  {
    at::Tensor miss = at::empty({kMiB / 4});
    EXPECT_EQ(fsdp::memory::cached_bytes(), cached);
    at::Tensor hit = at::empty({2 * kMiB / 4});
    EXPECT_EQ(hit.data_ptr(), recent);
    at::Tensor old_hit = at::empty({8 * kMiB / 4});
    EXPECT_EQ(old_hit.data_ptr(), old_ptr);
  }
  fsdp::memory::set_cache_release(fsdp::memory::CacheRelease::kOnMiss);
  fsdp::memory::empty_cache();
}

TEST(Memory, AllocationLimitRefusesWhatWouldPassIt) {
  ASSERT_TRUE(fsdp::memory::install_tracking_allocator());
  EXPECT_EQ(fsdp::memory::allocation_limit(), 0);
  const int64_t live0 = fsdp::memory::allocated_bytes();
  fsdp::memory::set_allocation_limit(live0 + 16 * kMiB);
  {
    at::Tensor fits = at::empty({8 * kMiB / 4}, at::kFloat);  // 8 MiB: under the limit
    const int64_t live1 = fsdp::memory::allocated_bytes();
    try {
      at::Tensor too_much = at::empty({16 * kMiB / 4}, at::kFloat);  // 8 + 16 > 16
      ADD_FAILURE() << "an allocation past the limit succeeded";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("CPU out of memory"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("set_allocation_limit"), std::string::npos) << e.what();
    }
    EXPECT_EQ(fsdp::memory::allocated_bytes(), live1);  // the refused one counted nothing
  }
  fsdp::memory::set_allocation_limit(0);  // no limit again
  EXPECT_EQ(fsdp::memory::allocation_limit(), 0);
  at::Tensor big = at::empty({32 * kMiB / 4}, at::kFloat);
  EXPECT_GE(fsdp::memory::allocated_bytes(), live0 + 32 * kMiB);
  EXPECT_THROW(fsdp::memory::set_allocation_limit(-1), c10::Error);
}
