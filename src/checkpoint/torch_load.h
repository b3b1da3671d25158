// torch_load.h — reads the files Python's torch.save writes (and save_pytorch_state_dict):
// a zip archive holding data.pkl, a pickle (protocol 2) of the saved object whose tensors refer
// to their storages by persistent id, and one record data/<key> per storage.
//
// LibTorch's own unpickler (torch::pickle_load, still in 2.15) cannot read what Python users
// save: it turns every collections.OrderedDict into None (it expects one only as a tensor's empty
// backward hooks), so loading model.state_dict() fails with "Expected GenericDict but got None"
// (tests/checkpoint/test_pytorch_file.cpp checks that this is still so, and where). This reader
// implements the subset of the protocol torch.save emits on the pickle machine of pickle.h,
// which checks every read against the data's bounds. It executes nothing: the Python objects it
// rebuilds are dicts (plain and OrderedDict), lists, tuples, None, bools, ints, floats, strings
// and tensors; any other object (a class instance such as argparse.Namespace) becomes an opaque
// value that names its Python type, an error only if a caller needs its content. LibTorch's PyTorchStreamReader
// reads the zip archive.
#pragma once

#include "src/checkpoint/pickle.h"

#include <memory>
#include <string>

namespace fsdp {
namespace detail {

// The Python objects of a torch.save file are pickle.h's PyValue: dicts (plain and OrderedDict),
// lists, tuples, None, bools, ints, floats, strings, tensors (kTensor), storages, and opaque
// values naming their Python type; py_type_name and dict_find read them.

// The object the torch.save file at `path` holds. Throws c10::Error naming `path`, and saying
// what is wrong, on: a missing file or a directory, a file that is not a zip archive (including
// torch.save's legacy format), a truncated or damaged archive, a malformed pickle, a tensor
// whose sizes and strides reach outside its storage, a storage record of the wrong size.
// Tensors are always created on the CPU, whatever device they were saved from; views of one
// storage (tied weights, a transposed tensor) stay views of one storage, as in torch.load.
std::shared_ptr<PyValue> torch_load(const std::string& path);

// How torch_load_bytes reads an archive found inside another file.
struct TorchLoadOptions {
  // Begins every error message, e.g. "fsdp::load_dcp: ".
  std::string who = "fsdp::load_pytorch_state_dict: ";
  // Refuse every GLOBAL but the few a tensor or a plain value needs (the tensor rebuild
  // function, OrderedDict, the storage types), instead of keeping an unknown class as an opaque
  // value: for archives that are items of a checkpoint, where nothing else belongs.
  bool only_tensor_globals = false;
};

// The object of the torch.save archive held in `data` (`size` bytes), as torch_load reads a
// file; `name` names it in messages (e.g. "'ckpt/__0_0.distcp' at byte 1577, key 'model.w'").
// Throws c10::Error beginning with options.who on anything torch_load refuses, and, with
// only_tensor_globals, on a GLOBAL outside the list, naming it.
std::shared_ptr<PyValue> torch_load_bytes(const std::string& name, const char* data, size_t size,
                                          const TorchLoadOptions& options);

}  // namespace detail
}  // namespace fsdp
