// What only the MPI backend has to show, on the ranks mpirun started: that it is the backend
// in use, sub-groups of a mesh on MPI communicators, 16-bit float reductions (MPI has no such
// type), counters, overlap with compute, and the bodies of the job-ending tests that
// tests/mpi/expect_job_end.sh runs (a rank that never joins, a rank killed with SIGKILL).
#include "harness/multiprocess.h"

#include <fsdp/device_mesh.h>
#include <fsdp/distributed.h>
#include <fsdp/process_group.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

using fsdp::CollectiveKind;
using fsdp::ReduceOp;
using fsdp::testing::run_distributed;

namespace {
const std::vector<int> kWorlds = {1, 2, 3, 4};
}

TEST(MpiBackend, IsTheBackendInUse) {
  for (int world : kWorlds) {
    run_distributed(world, [] {
      EXPECT_EQ(fsdp::backend(), "mpi");
      EXPECT_TRUE(fsdp::mpi_available());
      EXPECT_EQ(fsdp::world()->size(), fsdp::get_world_size());
    });
  }
}

// A 2 x 2 mesh: each rank belongs to one group per dim, each an MPI communicator of its own.
TEST(MpiBackend, MeshDimGroupsReduceWithinTheirMembers) {
  run_distributed(4, [] {
    const int r = fsdp::get_rank();
    auto mesh = fsdp::init_device_mesh("cpu", {2, 2}, {"replicate", "shard"});
    auto rows = mesh.get_group("shard");      // ranks {0,1} and {2,3}
    auto cols = mesh.get_group("replicate");  // ranks {0,2} and {1,3}
    ASSERT_EQ(rows->size(), 2);
    ASSERT_EQ(cols->size(), 2);
    at::Tensor a = at::full({5}, static_cast<float>(r));
    rows->all_reduce(a)->wait();
    const float row_sum = r < 2 ? 0 + 1 : 2 + 3;
    EXPECT_TRUE(a.equal(at::full({5}, row_sum)));
    at::Tensor b = at::full({5}, static_cast<float>(r));
    cols->all_reduce(b)->wait();
    const float col_sum = r % 2 == 0 ? 0 + 2 : 1 + 3;
    EXPECT_TRUE(b.equal(at::full({5}, col_sum)));
    // Both dims at once, as HSDP issues them: each group's thread calls MPI concurrently.
    at::Tensor out = at::empty({6});
    auto w1 = rows->all_gather_into(out, at::full({3}, static_cast<float>(r)));
    at::Tensor c = at::ones({1000});
    auto w2 = cols->all_reduce(c, ReduceOp::kMax);
    w1->wait();
    w2->wait();
    const int left = r - r % 2;
    EXPECT_TRUE(out.slice(0, 0, 3).equal(at::full({3}, static_cast<float>(left))));
    EXPECT_TRUE(out.slice(0, 3, 6).equal(at::full({3}, static_cast<float>(left + 1))));
    EXPECT_TRUE(c.equal(at::ones({1000})));
    // A group of a subset made with new_group: only its members call it.
    if (r != 3) {
      auto three = fsdp::new_group({0, 1, 2});
      at::Tensor t = at::full({2}, static_cast<int64_t>(r + 1), at::kLong);
      three->all_reduce(t)->wait();
      EXPECT_TRUE(t.equal(at::full({2}, static_cast<int64_t>(6), at::kLong)));
    }
    fsdp::world()->barrier()->wait();
  });
}

TEST(MpiBackend, SixteenBitFloatsReduceAsATenWould) {
  for (int world : kWorlds) {
    run_distributed(world, [] {
      auto pg = fsdp::world();
      const int W = pg->size(), r = pg->rank();
      for (auto dtype : {at::kBFloat16, at::kHalf}) {
        at::Tensor x = (at::arange(101, at::kFloat) * 0.25 + r).to(dtype);
        // The reference: ATen's own pairwise sums, in rank order.
        at::Tensor expect = (at::arange(101, at::kFloat) * 0.25).to(dtype);
        for (int p = 1; p < W; ++p) expect = expect + (at::arange(101, at::kFloat) * 0.25 + p).to(dtype);
        at::Tensor sum = x.clone();
        pg->all_reduce(sum)->wait();
        EXPECT_TRUE(sum.to(at::kFloat).allclose(expect.to(at::kFloat), 0.02, 0.1)) << dtype;
        at::Tensor mx = x.clone();
        pg->all_reduce(mx, ReduceOp::kMax)->wait();
        EXPECT_TRUE(mx.equal((at::arange(101, at::kFloat) * 0.25 + (W - 1)).to(dtype))) << dtype;
        at::Tensor avg = at::empty({101 / W}, dtype);
        const int64_t n = avg.numel();
        pg->reduce_scatter_into(avg, x.slice(0, 0, n * W).contiguous(), ReduceOp::kAvg)->wait();
        at::Tensor want = (at::arange(r * n, (r + 1) * n, at::kFloat) * 0.25 + (W - 1) / 2.0);
        EXPECT_TRUE(avg.to(at::kFloat).allclose(want, 0.02, 0.1)) << dtype;
      }
    });
  }
}

// Busy time accrues on the communication thread while the caller computes; the caller's
// blocked time is only what it waited.
TEST(MpiBackend, AsyncWorkOverlapsComputeAndIsCounted) {
  for (int world : {2, 3}) {
    run_distributed(world, [] {
      auto pg = fsdp::world();
      const int W = pg->size();
      pg->reset_stats();
      const int64_t n = 1 << 20;
      at::Tensor out = at::empty({n * W});
      auto work = pg->all_gather_into(out, at::full({n}, static_cast<float>(pg->rank())));
      at::Tensor a = at::randn({256, 256});
      for (int i = 0; i < 20; ++i) a = at::tanh(at::mm(a, a) * 1e-3);  // compute meanwhile
      work->wait();
      for (int p = 0; p < W; ++p) EXPECT_EQ(out[p * n].item<float>(), static_cast<float>(p));
      const auto s = pg->stats()[CollectiveKind::kAllGather];
      EXPECT_EQ(s.calls, 1);
      EXPECT_GT(s.busy_ns, 0);
      EXPECT_GE(s.blocked_ns, 0);
      EXPECT_EQ(s.bytes_sent, (W - 1) * n * 4);
      EXPECT_EQ(s.bytes_received, (W - 1) * n * 4);
    });
  }
}

// Large all-gathers, reduce-scatters and all-reduces run fsdp-cpp's point-to-point algorithms on
// MPI messages, in pieces (small ones run MPI's own collectives). 12 MiB, split unevenly: the
// values are right, the input is left alone, and an all-reduce is bitwise the same everywhere.
TEST(MpiBackend, LargeCollectivesRunInPiecesAndAgreeBitwise) {
  for (int world : kWorlds) {
    run_distributed(world, [] {
      auto pg = fsdp::world();
      const int W = pg->size(), r = pg->rank();
      const int64_t n = (int64_t{3} << 20) + 5;
      auto data_of = [&](int p) { return at::sin(at::arange(n, at::kFloat) * 1e-3 + p); };
      at::Tensor expect = data_of(0).to(at::kDouble);
      for (int p = 1; p < W; ++p) expect += data_of(p).to(at::kDouble);

      at::Tensor sum = data_of(r);
      pg->all_reduce(sum)->wait();
      EXPECT_TRUE(sum.to(at::kDouble).allclose(expect, 1e-5, 1e-5));
      at::Tensor everyones = at::empty({n * W});
      pg->all_gather_into(everyones, sum)->wait();
      for (int p = 0; p < W; ++p) EXPECT_TRUE(everyones.slice(0, p * n, (p + 1) * n).equal(sum)) << "rank " << p;

      at::Tensor mx = data_of(r);
      pg->all_reduce(mx, ReduceOp::kMax)->wait();
      at::Tensor want_max = data_of(0);
      for (int p = 1; p < W; ++p) want_max = at::maximum(want_max, data_of(p));
      EXPECT_TRUE(mx.equal(want_max));

      std::vector<int64_t> counts;
      for (int p = 0; p < W; ++p) counts.push_back(n / W + (p < n % W ? 1 : 0));
      int64_t off = 0;
      for (int p = 0; p < r; ++p) off += counts[p];
      at::Tensor input = data_of(r);
      at::Tensor before = input.clone();
      at::Tensor mine = at::empty({counts[r]});
      pg->reduce_scatter_v(mine, input, counts, ReduceOp::kAvg)->wait();
      EXPECT_TRUE(mine.to(at::kDouble).allclose(expect.slice(0, off, off + counts[r]) / W, 1e-5, 1e-5));
      EXPECT_TRUE(input.equal(before));
    });
  }
}

TEST(MpiBackend, ADtypeMpiCannotReduceIsRefusedOnTheCallersThread) {
  run_distributed(2, [] {
    at::Tensor z = at::zeros({4}, at::kComplexFloat);
    try {
      fsdp::world()->all_reduce(z);
      FAIL() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("cannot reduce dtype"), std::string::npos) << e.what();
    }
    // Moving bytes needs no reduction: complex all-gathers work.
    at::Tensor out = at::empty({8}, at::kComplexFloat);
    fsdp::world()->all_gather_into(out, z)->wait();
    EXPECT_TRUE(out.equal(at::zeros({8}, at::kComplexFloat)));
  });
}

// ---------------------------------------------------------------- job-ending bodies
// Not run by the ordinary entries (their filter leaves MpiJobEnd out): expect_job_end.sh runs
// each under mpirun and checks that the job ends, how, and with which message.

// The last rank never enters the all-gather; the others' watchdog names it and aborts the job.
TEST(MpiJobEnd, ARankThatNeverJoinsAbortsTheJobNamingIt) {
  fsdp::testing::DistOptions opts;
  opts.collective_timeout = std::chrono::milliseconds(1500);
  for (int world : {2, 3}) {
    run_distributed(
        world,
        [] {
          auto pg = fsdp::world();
          pg->barrier()->wait();
          if (pg->rank() == pg->size() - 1) {
            std::this_thread::sleep_for(std::chrono::seconds(60));  // far past the timeout
            return;
          }
          at::Tensor out = at::empty({4 * pg->size()});
          pg->all_gather_into(out, at::ones({4}))->wait();
          ADD_FAILURE() << "the all-gather completed without the last rank";
        },
        opts);
  }
}

// Rank 1 dies by SIGKILL while the others wait in a collective for it; the launcher ends the job.
TEST(MpiJobEnd, ARankKilledBySigkillEndsTheJob) {
  fsdp::testing::DistOptions opts;
  opts.collective_timeout = std::chrono::milliseconds(120000);  // the launcher, not the watchdog, ends it
  run_distributed(
      2,
      [] {
        auto pg = fsdp::world();
        pg->barrier()->wait();
        if (pg->rank() == 1) std::raise(SIGKILL);
        pg->barrier()->wait();
        ADD_FAILURE() << "the barrier completed without rank 1";
      },
      opts);
}

namespace {

// A TCP socket of this process in the LISTEN state: its address as /proc/net/tcp* writes it
// (hex) and its port.
struct Listener {
  std::string address_hex;
  int port;
};

std::set<std::string> socket_inodes_of_this_process() {
  std::set<std::string> inodes;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return inodes;
  while (dirent* e = readdir(dir)) {
    char target[256] = {0};
    const std::string path = std::string("/proc/self/fd/") + e->d_name;
    const ssize_t n = readlink(path.c_str(), target, sizeof(target) - 1);
    const std::string link(target, n > 0 ? static_cast<size_t>(n) : 0);
    if (link.rfind("socket:[", 0) == 0) inodes.insert(link.substr(8, link.size() - 9));
  }
  closedir(dir);
  return inodes;
}

std::vector<Listener> listeners_of_this_process() {
  const std::set<std::string> mine = socket_inodes_of_this_process();
  std::vector<Listener> out;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
      fields >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >> timeout >> inode;
      if (state != "0A" || mine.count(inode) == 0) continue;  // 0A: LISTEN
      const auto colon = local.find(':');
      out.push_back({local.substr(0, colon), std::stoi(local.substr(colon + 1), nullptr, 16)});
    }
  }
  return out;
}

bool is_loopback_hex(const std::string& hex) {
  return hex == "0100007F" || hex == "0000000000000000FFFF00000100007F" || hex == "00000000000000000000000001000000";
}

// Connects to 127.0.0.1:port and sends the first bytes of a store request (a SET whose 16-byte
// key never comes); the connection stays open until the process ends.
bool hold_half_a_request(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) return false;
  const char half[] = {1, 16, 0, 0, 0, 0, 0, 0, 0, 'k'};
  return send(fd, half, sizeof half, 0) == static_cast<ssize_t>(sizeof half);
}

}  // namespace

// The progress board's store under a client that sends part of a request and holds the
// connection: the last rank never joins the all-gather; rank 0's watchdog times out, reads the
// board to name it and aborts the job, all within the timeout plus 5 s of the collective's start
// (expect_job_end.sh --within). In a job on one machine the board listens on loopback only: it
// is rank 0's only TCP listener (Open MPI's TCP transport is left out of this job).
TEST(MpiJobEnd, AStalledClientOfTheBoardDelaysNothing) {
  fsdp::testing::DistOptions opts;
  opts.collective_timeout = std::chrono::milliseconds(3000);
  run_distributed(
      2,
      [] {
        auto pg = fsdp::world();
        pg->barrier()->wait();
        if (pg->rank() == 1) {
          std::this_thread::sleep_for(std::chrono::seconds(60));  // far past the timeout
          return;
        }
        const std::vector<Listener> listeners = listeners_of_this_process();
        ASSERT_EQ(listeners.size(), 1u) << "rank 0 should listen for the board's store only";
        ASSERT_TRUE(is_loopback_hex(listeners[0].address_hex))
            << "the board listens on " << listeners[0].address_hex << ", not on loopback";
        ASSERT_TRUE(hold_half_a_request(listeners[0].port));
        const auto now_ms =
            std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch());
        std::fprintf(stderr, "job-clock-start: %lld\n", static_cast<long long>(now_ms.count()));
        at::Tensor out = at::empty({4 * pg->size()});
        pg->all_gather_into(out, at::ones({4}))->wait();
        ADD_FAILURE() << "the all-gather completed without the last rank";
      },
      opts);
}
