// A stand-in for a training program, started by fsdprun in the launcher tests.
// Usage: fsdprun_test_worker MODE DIR [ARGS...]; it records what it saw in files
// under DIR (named after its RANK and TORCHELASTIC_RESTART_COUNT).
//   env                           write the torchrun variables, print a few lines, exit 0
//   fail RANK CODE [ignore-term]  RANK exits CODE once all workers are up; others sleep
//   killself RANK                 RANK SIGKILLs itself once all workers are up; others sleep
//   sleep [ignore-term]           sleep for a minute
//   restart RANK SUCCEED_AT       RANK exits 1 while the restart count < SUCCEED_AT
//   port                          write MASTER_PORT to DIR/port, then sleep
//   killwhen RANK FILE            RANK SIGKILLs itself once DIR/FILE exists; others sleep
//   exitwhen FILE                 exit 0 once DIR/FILE exists
#include <arpa/inet.h>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <netinet/in.h>
#include <string>
#include <sys/socket.h>
#include <thread>
#include <unistd.h>

namespace {

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : "";
}

int env_int(const char* name) { return std::atoi(env(name).c_str()); }

std::string g_dir;

std::string tag() { return env("RANK") + "_" + env("TORCHELASTIC_RESTART_COUNT"); }

// Written to a temporary name and renamed, so a reader never sees half a file.
void write_file(const std::string& name, const std::string& text) {
  const std::string path = g_dir + "/" + name;
  {
    std::ofstream out(path + ".tmp");
    out << text;
  }
  std::rename((path + ".tmp").c_str(), path.c_str());
}

void append_file(const std::string& name, const std::string& text) {
  std::ofstream(g_dir + "/" + name, std::ios::app) << text;
}

void write_pid() { write_file("pid_" + tag(), std::to_string(getpid()) + "\n"); }

// Waits (at most 10 s) until every worker of this attempt wrote its pid file.
void wait_for_all_workers() {
  const int world = env_int("WORLD_SIZE");
  for (int i = 0; i < 1000; ++i) {
    int found = 0;
    for (int r = 0; r < world; ++r)
      found += std::filesystem::exists(g_dir + "/pid_" + std::to_string(r) + "_" + env("TORCHELASTIC_RESTART_COUNT"));
    if (found == world) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

[[noreturn]] void sleep_forever(bool ignore_term) {
  if (ignore_term) signal(SIGTERM, SIG_IGN);
  for (int i = 0; i < 600; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::exit(0);
}

bool store_reachable() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(env_int("MASTER_PORT")));
  inet_pton(AF_INET, env("MASTER_ADDR").c_str(), &addr.sin_addr);
  const bool ok = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  close(fd);
  return ok;
}

int mode_env() {
  std::string text;
  for (const char* name :
       {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME",
        "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS"})
    text += std::string(name) + "=" + env(name) + "\n";
  text += std::string("STORE_REACHABLE=") + (store_reachable() ? "1" : "0") + "\n";
  write_file("env_" + tag(), text);
  std::cout << "hello from rank " << env("RANK") << "\n"
            << "tail " << env("RANK") << std::flush;
  std::cerr << "warning from rank " << env("RANK") << std::endl;
  return 0;
}

int mode_fail(int argc, char** argv, bool kill_self) {
  write_pid();
  const int target = std::atoi(argv[3]);
  if (env_int("RANK") != target) sleep_forever(argc > 5 && std::string(argv[5]) == "ignore-term");
  wait_for_all_workers();
  std::cerr << "rank " << target << " is failing now" << std::endl;
  if (kill_self) raise(SIGKILL);
  return std::atoi(argv[4]);
}

// Waits (at most a minute) until DIR/name exists.
void wait_for_file(const std::string& name) {
  for (int i = 0; i < 6000 && !std::filesystem::exists(g_dir + "/" + name); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
}

int mode_when(char** argv, bool kill_self) {
  write_pid();
  const std::string file = argv[kill_self ? 4 : 3];
  if (kill_self && env_int("RANK") != std::atoi(argv[3])) sleep_forever(false);
  wait_for_file(file);
  if (kill_self) raise(SIGKILL);
  return 0;
}

int mode_restart(char** argv) {
  append_file("attempts_" + env("RANK"), env("TORCHELASTIC_RESTART_COUNT") + "\n");
  write_pid();
  const bool fails =
      env_int("RANK") == std::atoi(argv[3]) && env_int("TORCHELASTIC_RESTART_COUNT") < std::atoi(argv[4]);
  if (!fails) return 0;
  wait_for_all_workers();  // so that every rank recorded this attempt before the group stops
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: fsdprun_test_worker MODE DIR [ARGS...]\n";
    return 64;
  }
  const std::string mode = argv[1];
  g_dir = argv[2];
  if (mode == "env") return mode_env();
  if (mode == "fail" && argc >= 5) return mode_fail(argc, argv, false);
  if (mode == "killself" && argc >= 4) return mode_fail(argc, argv, true);
  if (mode == "restart" && argc >= 5) return mode_restart(argv);
  if (mode == "killwhen" && argc >= 5) return mode_when(argv, true);
  if (mode == "exitwhen" && argc >= 4) return mode_when(argv, false);
  if (mode == "sleep") {
    write_pid();
    sleep_forever(argc > 3 && std::string(argv[3]) == "ignore-term");
  }
  if (mode == "port") {
    write_pid();
    write_file("port", env("MASTER_PORT"));
    sleep_forever(false);
  }
  std::cerr << "fsdprun_test_worker: bad arguments for mode '" << mode << "'\n";
  return 64;
}
