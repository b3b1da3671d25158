// agreement.h — small facts gathered from every rank so that all ranks take the same decision
// at the same point: which checkpoint to resume from, whether each rank can read it, whether
// the checkpoint directory is usable, and each step's numbers. Every function here is
// collective over the world: every rank calls it, in the same order.
#pragma once

#include <string>
#include <vector>

namespace fsdp {
namespace train {

// Every rank's numbers, rank after rank (each rank gives the same count).
std::vector<double> all_gather_numbers(const std::vector<double>& mine);

// Every rank's string, indexed by rank (any lengths, empty included).
std::vector<std::string> all_gather_strings(const std::string& mine);

// Rank 0's string, on every rank.
std::string from_rank0(const std::string& text);

// `problem` is this rank's reason why it cannot go on ("" = it can). When any rank has one,
// every rank throws the same std::runtime_error: `what`, then "rank R: problem" for each rank
// that has one. Returns normally only when no rank has a problem.
void throw_unless_every_rank_ok(const std::string& problem, const std::string& what);

}  // namespace train
}  // namespace fsdp
