// layer: checkpoint (what may include what: docs/architecture.md)
/// \file
/// fsdp/safetensors.h — the safetensors format for a fully_shard()ed model: one file per rank plus
/// Hugging Face's index, written without gathering the whole model anywhere.
///
/// \code{.cpp}
///   fsdp::save_safetensors(fsdp::sharded_state_dict(*model), "ckpt");   // every rank
///   // ckpt/model-00001-of-00002.safetensors, ckpt/model-00002-of-00002.safetensors,
///   // ckpt/model.safetensors.index.json  (transformers' from_pretrained layout)
///   auto part = fsdp::load_safetensors_file("ckpt/model-00001-of-00002.safetensors");
///   // into a model sharded over any world size, each rank reading only its own rows:
///   fsdp::load_sharded_state_dict(*model, fsdp::load_safetensors("ckpt", fsdp::sharded_state_dict(*model)));
/// \endcode
///
/// A safetensors file is: an 8-byte little-endian u64 N, N bytes of UTF-8 JSON mapping each
/// tensor name to {"dtype", "shape", "data_offsets": [begin, end)} (offsets relative to the end
/// of the header) plus an optional "__metadata__" object of strings, then the raw little-endian
/// row-major bytes of the tensors. Supported dtypes: F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL.
#pragma once

#include <fsdp/state_dict.h>

#include <torch/arg.h>

#include <map>
#include <string>
#include <vector>

namespace fsdp {

/// The "__metadata__" of a file: string -> string entries, as the format requires.
using SafetensorsMetadata = std::map<std::string, std::string>;

/// The options of save_safetensors() and load_safetensors().
struct SafetensorsOptions {
  /// Files are named `<prefix>-<rank+1>-of-<world>.safetensors` (5 digits each) and
  /// `<prefix>.safetensors.index.json`.
  TORCH_ARG(std::string, prefix) = "model";
  /// Extra "__metadata__" entries of every file, next to "format": "pt" (a "format" entry here
  /// replaces it).
  TORCH_ARG(SafetensorsMetadata, metadata) = {};
  /// load_safetensors and load_safetensors_into: a tensor stored in another floating dtype (F64,
  /// F32, BF16, F16) than its key's in `like` is read as stored and converted to `like`'s (a
  /// Hugging Face checkpoint in bf16 loaded into an fp32 model). false: the difference is
  /// refused, naming the tensor.
  TORCH_ARG(bool, convert_float_dtypes) = false;
  /// load_safetensors and load_safetensors_into: a tensor of the files that the model does not
  /// have and whose name one of these ECMAScript regular expressions matches (std::regex_search)
  /// is skipped instead of refused as unexpected, as transformers skips its models'
  /// _keys_to_ignore_on_load_unexpected (GPT-2's old attention-mask buffers, a Llama's saved
  /// rotary inv_freq). A key the model has is never skipped. An invalid expression throws.
  TORCH_ARG(std::vector<std::string>, ignore_unexpected) = {};
  /// load_safetensors and load_safetensors_into: a prefix that the files may leave out of the
  /// model's keys, as transformers' base_model_prefix ("transformer." for GPT-2, whose Hub files
  /// name "h.0.attn.c_attn.weight" what the model names "transformer.h.0.attn.c_attn.weight").
  /// When no tensor of the files starts with it, each key of the model that does is looked up
  /// without it; the model's keys (and the errors' names) stay as they are. "" (the default): the
  /// files name every tensor as the model does.
  TORCH_ARG(std::string, optional_key_prefix) = "";
};

/// Writes `state_dict` under `dir` (created if missing) as one safetensors file per rank and, on
/// rank 0, the index {"metadata": {"total_size": bytes of all tensor data}, "weight_map":
/// {name: file}}.
///
/// Collective over the world, which every value's mesh must span (as fsdp::sharded_state_dict's
/// do); every rank passes the same keys, shapes and dtypes. Blocks until every file and the index
/// are written.
///
/// Each name goes to exactly one rank's file. Names are assigned greedily in state-dict order to
/// the rank with the fewest bytes so far (ties: the lowest rank), the same on every rank. A
/// value with any Shard placement is gathered with DTensor::full_tensor(): every rank takes part
/// (the public ProcessGroup API has no point-to-point send, and all_gather_v is what full_tensor
/// uses) and every rank but the owner drops the result at once. A fully replicated value is
/// written from the owner's local copy, without communication. The owner's file header is known
/// up front from the shapes, so each tensor is appended to the file as soon as it is available:
/// at most one gathered tensor is alive per rank at any time.
///
/// Each file is written to "`<file>.tmp`" and renamed when complete; rank 0 writes the index (in
/// the same way) after a barrier, so the index appears only once every file exists. A rank that
/// is assigned no tensor still writes a valid file with an empty header.
///
/// Throws c10::Error, before any communication, on an unsupported dtype, a mesh that does not
/// span the world, a name that is empty, "__metadata__" or not UTF-8, or a metadata entry that
/// is not UTF-8; and naming the file on an I/O error (the partial ".tmp" file is removed; the
/// other ranks then fail in their next collective).
void save_safetensors(const ShardedStateDict& state_dict, const std::string& dir,
                      const SafetensorsOptions& options = SafetensorsOptions());

/// Reads a safetensors directory (written by save_safetensors, or any `<prefix>.safetensors.index.json`
/// with its files, or a single `<prefix>.safetensors`) into new tensors laid out like `like` (same
/// keys, dtypes and global shapes, any placements: e.g. fsdp::sharded_state_dict of a model built
/// sharded, at any world size), reading from the files only the bytes of this rank's pieces:
/// a model never held whole anywhere can be loaded. Load the result with
/// fsdp::load_sharded_state_dict. A piece split along a dim other than 0 (a shard_placement_fn's
/// Shard(d)) costs more: the whole rows it lies in are read, then cut.
/// Not collective (file reads only). Every header is checked as load_safetensors_file checks it.
/// Throws c10::Error, naming the directory or file and the tensor, on: neither an index nor the
/// single file, an index that is not JSON or names a file outside `dir`, a key of `like` missing
/// or a tensor `like` does not have, a dtype (unless options.convert_float_dtypes() and both are
/// floating) or shape that differs from the model's, an unreadable or malformed file.
ShardedStateDict load_safetensors(const std::string& dir, const ShardedStateDict& like,
                                  const SafetensorsOptions& options = SafetensorsOptions());

/// Reads a safetensors directory as load_safetensors does (the same checks and errors), but
/// straight into `targets` (e.g. fsdp::sharded_state_dict(*model), whose local tensors are the
/// live shards), one tensor at a time: beside the model only the piece being read is allocated,
/// so a model loads in its own memory, not in twice it. Every key is checked before anything is
/// written; a tensor that cannot be read (a truncated file, a dtype or shape that differs) throws
/// after the tensors before it were written. Not collective; no autograd history is recorded.
void load_safetensors_into(const std::string& dir, const ShardedStateDict& targets,
                           const SafetensorsOptions& options = SafetensorsOptions());

/// Reads one safetensors file (written by save_safetensors or by anyone else) into name ->
/// tensor, in the order of the tensors' data in the file. Not collective. Allocates a new CPU
/// tensor per entry; the file is read once, one tensor at a time.
///
/// Checks everything before trusting it and throws c10::Error naming the file on malformed
/// input: a file shorter than its header, a header that is not a JSON object of well-formed
/// entries, an unknown dtype, data_offsets out of range, of the wrong length for the shape and
/// dtype, overlapping, or leaving holes in the data (the format requires the data to be
/// covered exactly).
TensorStateDict load_safetensors_file(const std::string& path);

}  // namespace fsdp
