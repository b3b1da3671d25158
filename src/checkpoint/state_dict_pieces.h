// state_dict_pieces.h — shared by the model and optimizer state dicts: which piece of a stored
// value belongs in this rank's live tensor.
#pragma once

#include <fsdp/dtensor.h>

namespace fsdp {
namespace detail {

// This rank's piece of `value` for a live tensor that is either sharded Shard(0) over `mesh`
// (`sharded`) or whole. A Shard(0) value over the same mesh is used as is; a replicated value
// is chunked locally; any other layout is gathered first (collective over the value's mesh).
at::Tensor local_piece(const DTensor& value, bool sharded, const DeviceMesh& mesh);

// This rank's torch.chunk piece (dim 0) of a whole tensor, for a live tensor sharded over `mesh`.
at::Tensor local_piece_of_full(const at::Tensor& full, bool sharded, const DeviceMesh& mesh);

// True when every placement is Replicate() (the value is whole on every rank).
bool all_replicate(const std::vector<Placement>& placements);

// The mesh of the model's sharded parameters; throws if it has none.
DeviceMesh model_mesh(torch::nn::Module& model);

}  // namespace detail
}  // namespace fsdp
