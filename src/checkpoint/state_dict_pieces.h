// state_dict_pieces.h — shared by the model and optimizer state dicts: which piece of a stored
// value belongs in this rank's live tensor.
#pragma once

#include <fsdp/dtensor.h>

#include <optional>

namespace fsdp {
namespace detail {

// This rank's piece of `value` for a live tensor laid out over `mesh` with `placements` (a
// sharded parameter's: (Shard(d)) or, under HSDP, (Replicate(), Shard(d)); all Replicate() for a
// whole tensor). A value with that mesh and those placements is used as is; a replicated value
// is cut locally; any other layout is gathered first (collective over the value's mesh).
at::Tensor local_piece(const DTensor& value, const DeviceMesh& mesh, const std::vector<Placement>& placements);

// This rank's piece (torch.chunk rules, as DTensor cuts it) of a whole tensor, for a live tensor
// laid out over `mesh` with `placements`. A view of `full`; the whole of it when all replicate.
at::Tensor local_piece_of_full(const at::Tensor& full, const DeviceMesh& mesh,
                               const std::vector<Placement>& placements);

// True when every placement is Replicate() (the value is whole on every rank).
bool all_replicate(const std::vector<Placement>& placements);

// The mesh of the model's sharded parameters (or, with tensor parallelism alone, of its split
// ones, or of its replicated modules); throws if it has none.
DeviceMesh model_mesh(torch::nn::Module& model);

// How a parameter is laid out: as fully_shard sharded it or, for one fully_shard did not take,
// as tensor parallelism split it (fsdp/dtensor_parameter.h); std::nullopt when it is whole.
std::optional<DTensor> parameter_layout(const at::Tensor& param);

}  // namespace detail
}  // namespace fsdp
