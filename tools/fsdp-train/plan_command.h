// plan_command.h — `fsdp-train plan CONFIG.yaml [--section.key=value ...] --world N`: the
// memory and communication a run of the configuration needs per rank (fsdp::plan), without
// running anything.
#pragma once

namespace fsdp {
namespace train {

// argv[1] is "plan". Prints the plan (text, or one JSON object with --json); returns the exit
// code (0, or kExitConfig for a configuration or command-line error, printed to stderr).
int plan_command(int argc, char** argv);

}  // namespace train
}  // namespace fsdp
