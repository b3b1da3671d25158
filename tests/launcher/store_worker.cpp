// A stand-in for a training program that rendezvouses through fsdprun's agent store,
// as real workers do (TORCHELASTIC_USE_AGENT_STORE): started by fsdprun in the store
// tests. Usage: fsdprun_store_worker DIR. It writes DIR/ready_RANK, waits until DIR/go
// exists, then connects a c10d::TCPStore client to MASTER_ADDR:MASTER_PORT, sets its own
// key and reads every other rank's (waiting for them), and writes DIR/done_RANK. Exits 1
// with the store's error on stderr if any of that fails.
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>

namespace {

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : "";
}

void touch(const std::string& path) { std::ofstream(path) << "\n"; }

void rendezvous() {
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(std::stoi(env("MASTER_PORT")));
  opts.isServer = false;
  opts.waitWorkers = false;
  opts.timeout = std::chrono::seconds(60);
  c10d::TCPStore store(env("MASTER_ADDR"), opts);
  const std::string prefix = "/worker/attempt_" + env("TORCHELASTIC_RESTART_COUNT") + "/rank_";
  const std::string rank = env("RANK");
  store.set(prefix + rank, std::vector<uint8_t>(rank.begin(), rank.end()));
  const int world = std::stoi(env("WORLD_SIZE"));
  for (int r = 0; r < world; ++r) store.get(prefix + std::to_string(r));  // waits for rank r's key
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: fsdprun_store_worker DIR\n";
    return 64;
  }
  const std::string dir = argv[1];
  touch(dir + "/ready_" + env("RANK"));
  while (!std::filesystem::exists(dir + "/go")) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  try {
    rendezvous();
  } catch (const std::exception& e) {
    std::cerr << "store_worker: " << e.what() << std::endl;
    return 1;
  }
  touch(dir + "/done_" + env("RANK"));
  return 0;
}
