// layer: util (what may include what: docs/architecture.md)
/// \file
/// fsdp/chunk.h — torch.chunk's split of a size into pieces: the rule every layout
/// in fsdp-cpp follows (DTensor's Shard, FSDP's shards, the collectives' uneven counts), in one
/// place below them all.
#pragma once

#include <cstdint>

namespace fsdp {

/// Where piece `index` of `parts` starts, and its length, when `size` elements are split with
/// torch.chunk's rule: pieces of ceil(size / parts); the last ones may be shorter or empty.
struct ChunkBounds {
  int64_t offset;  ///< the first element of the piece
  int64_t length;  ///< its number of elements (0 for an empty piece)
};
/// The bounds of piece `index` (0 <= index < parts) of `size` elements split into `parts`.
inline ChunkBounds chunk_bounds(int64_t size, int64_t parts, int64_t index) {
  const int64_t chunk = (size + parts - 1) / parts;
  const int64_t offset = chunk * index < size ? chunk * index : size;
  const int64_t end = chunk * (index + 1) < size ? chunk * (index + 1) : size;
  return {offset, end - offset};
}

}  // namespace fsdp
