// tensor_bytes.h — a tensor's data as raw bytes, for the code that moves bytes between
// buffers it has laid out itself (the collectives and their buffers).
#pragma once

#include <ATen/core/Tensor.h>

namespace fsdp {
namespace detail {

// The first byte of `t`'s data (storage offset included). `t` must be defined and allocated.
inline char* bytes_of(const at::Tensor& t) { return static_cast<char*>(t.data_ptr()); }

}  // namespace detail
}  // namespace fsdp
