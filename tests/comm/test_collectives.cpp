// The process-group layer across real processes: every collective for W = 1..4, sizes that do
// not divide W, byte counters, and the timeout error.
#include "harness/multiprocess.h"

#include <fsdp/distributed.h>
#include <fsdp/placement.h>
#include <fsdp/process_group.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <csignal>
#include <fstream>
#include <string>
#include <thread>

#include <signal.h>
#include <unistd.h>

using fsdp::CollectiveKind;
using fsdp::ReduceOp;
using fsdp::testing::run_distributed;

namespace {

// torch.chunk's split of n into w pieces.
std::vector<int64_t> chunk_counts(int64_t n, int w) {
  std::vector<int64_t> counts;
  for (int i = 0; i < w; ++i) counts.push_back(fsdp::chunk_bounds(n, w, i).length);
  return counts;
}

// A recognisable, exactly representable value per (rank, index).
at::Tensor rank_data(int rank, int64_t n, at::ScalarType dtype = at::kFloat) {
  return (at::arange(n, at::kDouble) + 1000.0 * rank).to(dtype);
}

const std::vector<int> kWorlds = {1, 2, 3, 4};

}  // namespace

TEST(Collectives, AllGatherEvenAndUneven) {
  for (int world : kWorlds) {
    run_distributed(world, [] {
      auto pg = fsdp::world();
      const int W = pg->size(), r = pg->rank();
      // Even: every rank gives 5 elements.
      at::Tensor out = at::full({5 * W}, -1.0f);
      pg->all_gather_into(out, rank_data(r, 5))->wait();
      for (int p = 0; p < W; ++p) EXPECT_TRUE(out.slice(0, 5 * p, 5 * p + 5).equal(rank_data(p, 5))) << "piece " << p;

      // Uneven, torch.chunk style, for sizes smaller than, equal to and not divisible by W.
      for (int64_t n : {int64_t(W - 1), int64_t(W), int64_t(2 * W + 1), int64_t(1000003)}) {
        const auto counts = chunk_counts(n, W);
        at::Tensor full = at::empty({n}, at::kDouble);
        int64_t off = 0;
        for (int p = 0; p < W; ++p) {
          full.slice(0, off, off + counts[p]).copy_(rank_data(p, counts[p], at::kDouble));
          off += counts[p];
        }
        at::Tensor got = at::zeros({n}, at::kDouble);
        pg->all_gather_v(got, rank_data(r, counts[r], at::kDouble), counts)->wait();
        EXPECT_TRUE(got.equal(full)) << "n=" << n;
      }
    });
  }
}

TEST(Collectives, AllGatherCountsOnlyThisRanksShare) {
  for (int world : kWorlds) {
    run_distributed(world, [] {
      auto pg = fsdp::world();
      const int W = pg->size(), r = pg->rank();
      pg->reset_stats();
      const int64_t n = 1 << 16;  // elements per rank
      at::Tensor out = at::empty({n * W});
      pg->all_gather_into(out, rank_data(r, n))->wait();
      const auto s = pg->stats()[CollectiveKind::kAllGather];
      EXPECT_EQ(s.calls, 1);
      EXPECT_EQ(s.bytes_sent, (W - 1) * n * 4);      // its shard to each peer, nothing else
      EXPECT_EQ(s.bytes_received, (W - 1) * n * 4);  // each peer's shard once
      EXPECT_EQ(pg->stats().total_calls(), 1);
    });
  }
}

TEST(Collectives, ReduceScatterIsRealAndLeavesInputAlone) {
  for (int world : kWorlds) {
    run_distributed(world, [] {
      auto pg = fsdp::world();
      const int W = pg->size(), r = pg->rank();
      const double ranks_sum = W * (W - 1) / 2.0;
      for (int64_t n : {int64_t(W - 1), int64_t(W), int64_t(3 * W + 2), int64_t(2000003)}) {
        const auto counts = chunk_counts(n, W);
        int64_t off = 0;
        for (int p = 0; p < r; ++p) off += counts[p];
        at::Tensor input = rank_data(r, n);
        at::Tensor before = input.clone();
        at::Tensor out = at::full({counts[r]}, -7.0f);
        pg->reduce_scatter_v(out, input, counts, ReduceOp::kSum)->wait();
        // sum over p of (i + 1000 p) = W * i + 1000 * sum(p)
        at::Tensor expect = (at::arange(off, off + counts[r], at::kDouble) * W + 1000.0 * ranks_sum).to(at::kFloat);
        EXPECT_TRUE(out.equal(expect)) << "sum, n=" << n;
        EXPECT_TRUE(input.equal(before)) << "input was modified, n=" << n;

        pg->reduce_scatter_v(out, input, counts, ReduceOp::kMax)->wait();
        EXPECT_TRUE(out.equal(rank_data(W - 1, n).slice(0, off, off + counts[r]))) << "max, n=" << n;

        at::Tensor avg_out = at::empty({counts[r]}, at::kDouble);
        pg->reduce_scatter_v(avg_out, input.to(at::kDouble), counts, ReduceOp::kAvg)->wait();
        EXPECT_TRUE(avg_out.allclose(expect.to(at::kDouble) / W)) << "avg, n=" << n;
      }
    });
  }
}

TEST(Collectives, ReduceScatterCountsOnlyThisRanksShare) {
  for (int world : kWorlds) {
    run_distributed(world, [] {
      auto pg = fsdp::world();
      const int W = pg->size(), r = pg->rank();
      const int64_t n = 1 << 16;  // elements each rank receives
      pg->reset_stats();
      at::Tensor out = at::empty({n});
      pg->reduce_scatter_into(out, rank_data(r, n * W))->wait();
      const auto s = pg->stats()[CollectiveKind::kReduceScatter];
      EXPECT_EQ(s.calls, 1);
      // A ring moves W - 1 chunks each way per rank: (W - 1) / W of the input, never all of it.
      EXPECT_EQ(s.bytes_sent, (W - 1) * n * 4);
      EXPECT_EQ(s.bytes_received, (W - 1) * n * 4);
      EXPECT_EQ(pg->stats()[CollectiveKind::kAllReduce].calls, 0);  // not an all-reduce in disguise
    });
  }
}

TEST(Collectives, AllReduceSmallAndLarge) {
  for (int world : kWorlds) {
    run_distributed(world, [] {
      auto pg = fsdp::world();
      const int W = pg->size(), r = pg->rank();
      const double ranks_sum = W * (W - 1) / 2.0;
      for (int64_t n : {int64_t(1), int64_t(W + 1), int64_t(100003)}) {  // 100003 floats > small limit
        at::Tensor t = rank_data(r, n);
        pg->all_reduce(t, ReduceOp::kSum)->wait();
        EXPECT_TRUE(t.equal((at::arange(n, at::kDouble) * W + 1000.0 * ranks_sum).to(at::kFloat))) << "sum n=" << n;

        at::Tensor m = rank_data(r, n);
        pg->all_reduce(m, ReduceOp::kMax)->wait();
        EXPECT_TRUE(m.equal(rank_data(W - 1, n))) << "max n=" << n;

        at::Tensor lo = rank_data(r, n);
        pg->all_reduce(lo, ReduceOp::kMin)->wait();
        EXPECT_TRUE(lo.equal(rank_data(0, n))) << "min n=" << n;

        at::Tensor a = rank_data(r, n, at::kDouble);
        pg->all_reduce(a, ReduceOp::kAvg)->wait();
        EXPECT_TRUE(a.allclose(at::arange(n, at::kDouble) + 1000.0 * ranks_sum / W)) << "avg n=" << n;
      }
      // Integer and bf16 payloads.
      at::Tensor i = at::full({7}, static_cast<int64_t>(r + 1), at::kLong);
      pg->all_reduce(i)->wait();
      EXPECT_TRUE(i.equal(at::full({7}, static_cast<int64_t>(W * (W + 1) / 2), at::kLong)));
      at::Tensor b = at::full({300000}, 1.0, at::kBFloat16);
      pg->all_reduce(b)->wait();
      EXPECT_TRUE(b.equal(at::full({300000}, static_cast<double>(W), at::kBFloat16)));
      EXPECT_THROW(pg->all_reduce(i, ReduceOp::kAvg), c10::Error);  // avg of integers is refused
    });
  }
}

TEST(Collectives, BroadcastAndBarrier) {
  for (int world : kWorlds) {
    run_distributed(world, [] {
      auto pg = fsdp::world();
      const int W = pg->size(), r = pg->rank();
      for (int root = 0; root < W; ++root) {
        at::Tensor t = rank_data(r, 3 * W + 1);
        pg->broadcast(t, root)->wait();
        EXPECT_TRUE(t.equal(rank_data(root, 3 * W + 1))) << "root " << root;
      }
      // A barrier does not complete before the slowest rank arrives.
      pg->barrier()->wait();  // line the ranks up first, so that their clocks start together
      const auto start = std::chrono::steady_clock::now();
      if (r == W - 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
      pg->barrier()->wait();
      if (W > 1) {
        EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(200));
      }
    });
  }
}

TEST(Collectives, AsyncHandlesCompleteInIssueOrder) {
  run_distributed(2, [] {
    auto pg = fsdp::world();
    const int r = pg->rank();
    std::vector<at::Tensor> outs;
    std::vector<fsdp::WorkHandle> works;
    for (int k = 0; k < 8; ++k) {
      outs.push_back(at::empty({2 * 1000}));
      works.push_back(pg->all_gather_into(outs.back(), rank_data(r, 1000) + k));
      EXPECT_EQ(works.back()->seq(), k);
    }
    for (int k = 7; k >= 0; --k) works[k]->wait();  // waiting out of order is fine
    for (int k = 0; k < 8; ++k) {
      EXPECT_TRUE(works[k]->is_completed());
      EXPECT_TRUE(outs[k].slice(0, 1000, 2000).equal(rank_data(1, 1000) + k));
    }
  });
}

// all_reduce(..., after): the all-reduce of a second group reads what the first group's
// collective writes. Rank 1 issues both late, so on rank 0 the second group's all-reduce is
// queued long before the first one's data exists: it must wait for it on its own thread, and
// the call must not wait (the first all-reduce is still unfinished when it returns).
TEST(Collectives, AnAllReduceAfterAnotherGroupsCollectiveReadsItsOutput) {
  run_distributed(2, [] {
    auto first = fsdp::world();
    auto second = fsdp::new_group({0, 1});
    const int r = first->rank();
    for (int64_t n : {int64_t{3}, int64_t{1} << 16}) {
      at::Tensor t = at::full({n}, static_cast<float>(r + 1));
      if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(200));
      fsdp::WorkHandle written = first->all_reduce(t);
      fsdp::WorkHandle reduced = second->all_reduce(t, ReduceOp::kSum, written);
      reduced->wait();
      EXPECT_TRUE(written->is_completed());
      EXPECT_TRUE(t.equal(at::full({n}, 6.0f))) << "n " << n << ": " << t.slice(0, 0, 3);
    }
  });
}

// A collective whose predecessor failed is not run: it reports why, and its group is unusable.
// (A missing rank: under MPI, whose timeouts end the job, the harness leaves it out by name.)
TEST(Collectives, AMissingRankFailsTheAllReduceAfterItsCollectiveWithoutRunningIt) {
  fsdp::testing::DistOptions options;
  options.collective_timeout = std::chrono::milliseconds(1500);
  run_distributed(
      2,
      [] {
        auto first = fsdp::new_group({0, 1});
        auto second = fsdp::new_group({0, 1});
        const int r = first->rank();
        at::Tensor t = at::ones({4});
        // Only rank 0 issues the first all-reduce: it times out there.
        fsdp::WorkHandle written = r == 0 ? first->all_reduce(t) : nullptr;
        if (r == 0) {
          fsdp::WorkHandle reduced = second->all_reduce(t, ReduceOp::kSum, written);
          try {
            reduced->wait();
            ADD_FAILURE() << "the all-reduce ran after a failed predecessor";
          } catch (const fsdp::CollectiveError& e) {
            EXPECT_NE(std::string(e.what()).find("the collective whose output it reads failed"), std::string::npos)
                << e.what();
          }
          EXPECT_THROW(second->barrier()->wait(), fsdp::CollectiveError);
        }
      },
      options);
}

TEST(Collectives, BadArgumentsAreRejectedWithAMessage) {
  run_distributed(1, [] {
    auto pg = fsdp::world();
    try {
      pg->all_gather_into(at::empty({3}), at::empty({2}));
      FAIL() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("all_gather_v"), std::string::npos) << e.what();
    }
    EXPECT_THROW(pg->all_gather_into(at::empty({4}), at::empty({2, 2}).t()), c10::Error);        // not contiguous
    EXPECT_THROW(pg->all_gather_into(at::empty({2}, at::kDouble), at::empty({2})), c10::Error);  // dtype
    at::Tensor x = at::empty({4});
    EXPECT_THROW(pg->reduce_scatter_into(x, x), c10::Error);  // aliasing
    EXPECT_THROW(pg->broadcast(x, 3), c10::Error);            // no such root
  });
}

TEST(Collectives, AMissingRankTimesOutWithANamedError) {
  fsdp::testing::DistOptions opts;
  opts.collective_timeout = std::chrono::milliseconds(1500);
  for (int world : {2, 3}) {
    run_distributed(
        world,
        [] {
          auto pg = fsdp::world();
          const int W = pg->size(), r = pg->rank();
          pg->barrier()->wait();  // #0: everyone is here
          if (r == W - 1) {
            // Never joins #1; stays alive (an exit would close its connections and fail the
            // others early with a different error).
            std::this_thread::sleep_for(std::chrono::milliseconds(5000));
            return;
          }
          at::Tensor out = at::empty({4 * W});
          const auto start = std::chrono::steady_clock::now();
          auto work = pg->all_gather_into(out, at::ones({4}));
          try {
            work->wait();
            FAIL() << "expected a timeout";
          } catch (const fsdp::CollectiveError& e) {
            const std::string msg = e.what();
            EXPECT_NE(msg.find("all_gather #1"), std::string::npos) << msg;
            EXPECT_NE(msg.find("'world'"), std::string::npos) << msg;
            // With W = 3 the other waiting rank may see the first one's connections close just
            // before its own deadline; who did not arrive is reported either way.
            if (W == 2) {
              EXPECT_NE(msg.find("timed out after 1500 ms"), std::string::npos) << msg;
            }
            EXPECT_NE(msg.find("ranks that did not arrive: [" + std::to_string(W - 1) + "]"), std::string::npos) << msg;
          }
          const auto elapsed = std::chrono::steady_clock::now() - start;
          EXPECT_GE(elapsed, std::chrono::milliseconds(1400));
          EXPECT_LT(elapsed, std::chrono::milliseconds(1500 + 5000));  // the timeout plus diagnosis, on a loaded box
          // The group is now unusable, and says so at once.
          try {
            pg->barrier()->wait();
            FAIL() << "expected the group to be unusable";
          } catch (const fsdp::CollectiveError& e) {
            EXPECT_NE(std::string(e.what()).find("unusable"), std::string::npos) << e.what();
          }
        },
        opts);
  }
}

// The pid written to `pid_file` once that process is stopped (state T in /proc/<pid>/stat), or 0
// when that does not happen within `limit`. Polled: on a loaded machine the stop can come late.
int wait_until_stopped(const std::string& pid_file, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    int pid = 0;
    std::ifstream(pid_file) >> pid;
    if (pid > 0) {
      std::string stat;
      std::getline(std::ifstream("/proc/" + std::to_string(pid) + "/stat"), stat);
      const size_t paren = stat.rfind(')');  // "pid (comm) state ...": comm may hold spaces
      if (paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] == 'T') return pid;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return 0;
}

// Rank 2's part in the stopped-rank tests: leaves its pid in `pid_file`, enters all-gather #1,
// and stops (SIGSTOP) once its entry and a heartbeat are out; after the SIGCONT the
// all-gather fails, as the others' did.
void stop_inside_all_gather(fsdp::ProcessGroup& pg, const std::string& pid_file) {
  std::ofstream(pid_file) << getpid();
  at::Tensor out = at::empty({12});
  auto work = pg.all_gather_into(out, at::ones({4}));
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  raise(SIGSTOP);  // until rank 0 sends SIGCONT
  EXPECT_THROW(work->wait(), fsdp::CollectiveError);
}

// Rank 2 stops inside the all-gather; rank 1 never enters it and leaves the job. Both are
// silent on the board, but only rank 2 is stopped: rank 0's error names it alone as stopped.
TEST(Collectives, AStoppedRankIsNamedButNotOneThatLeft) {
  fsdp::testing::DistOptions opts;
  opts.collective_timeout = std::chrono::milliseconds(3000);
  run_distributed(
      3,
      [] {
        auto pg = fsdp::world();
        const int r = pg->rank();
        const std::string pid_file = "/tmp/fsdp_stopped_rank_left_" + std::to_string(getppid());
        pg->barrier()->wait();  // #0
        at::Tensor out = at::empty({12});
        if (r == 2) {
          stop_inside_all_gather(*pg, pid_file);
          return;
        }
        ASSERT_GT(wait_until_stopped(pid_file, std::chrono::seconds(30)), 0) << "rank 2 did not stop";
        if (r == 1) return;  // leaves the job: destroy_process_group, then the process ends
        auto work = pg->all_gather_into(out, at::ones({4}));
        try {
          work->wait();
          ADD_FAILURE() << "expected the all-gather to fail";
        } catch (const fsdp::CollectiveError& e) {
          const std::string msg = e.what();
          EXPECT_NE(msg.find("all_gather #1"), std::string::npos) << msg;
          EXPECT_NE(msg.find("ranks that stopped making progress: [2] (their process is stopped"), std::string::npos)
              << msg;
          EXPECT_EQ(msg.find("stopped making progress: [1"), std::string::npos) << msg;
        }
        int pid = 0;
        std::ifstream(pid_file) >> pid;
        ASSERT_GT(pid, 0);
        kill(pid, SIGCONT);
        std::remove(pid_file.c_str());
      },
      opts);
}

// A rank that entered a collective and then stopped (SIGSTOP) looks as if it arrived; the
// others' timeout must still name it, from its missing heartbeat.
TEST(Collectives, AStoppedRankIsNamedByTheOthersTimeout) {
  fsdp::testing::DistOptions opts;
  opts.collective_timeout = std::chrono::milliseconds(3000);
  run_distributed(
      3,
      [] {
        auto pg = fsdp::world();
        const int r = pg->rank();
        // Where rank 2 leaves its pid for rank 0, which resumes it at the end (the test process is
        // the ranks' common parent).
        const std::string pid_file = "/tmp/fsdp_stopped_rank_" + std::to_string(getppid());
        pg->barrier()->wait();  // #0
        at::Tensor out = at::empty({12});
        if (r == 2) {
          stop_inside_all_gather(*pg, pid_file);
          return;
        }
        // Only once rank 2 is stopped: entering earlier, a slow rank 2 could still finish the
        // all-gather with us.
        ASSERT_GT(wait_until_stopped(pid_file, std::chrono::seconds(30)), 0) << "rank 2 did not stop";
        auto work = pg->all_gather_into(out, at::ones({4}));
        try {
          work->wait();
          ADD_FAILURE() << "expected a timeout";
        } catch (const fsdp::CollectiveError& e) {
          const std::string msg = e.what();
          EXPECT_NE(msg.find("all_gather #1"), std::string::npos) << msg;
          EXPECT_NE(msg.find("ranks that stopped making progress: [2]"), std::string::npos) << msg;
          EXPECT_EQ(msg.find("did not arrive"), std::string::npos) << msg;
        }
        // Stay alive a while: the other waiting rank is still reading heartbeats, and ours must not
        // stop before it is done.
        std::this_thread::sleep_for(std::chrono::milliseconds(1500));
        if (r == 0) {
          int pid = 0;
          std::ifstream(pid_file) >> pid;
          ASSERT_GT(pid, 0);
          kill(pid, SIGCONT);
          std::remove(pid_file.c_str());
        }
      },
      opts);
}
