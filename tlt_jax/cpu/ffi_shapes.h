// Operand shape checks shared by the CPU kernels' FFI handlers.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "xla/ffi/api/ffi.h"

namespace tlt_cpu {

// Whether a buffer's dimensions are exactly `want`.
inline bool Dims(xla::ffi::Span<const int64_t> dims, std::initializer_list<int64_t> want) {
  return dims.size() == want.size() && std::equal(want.begin(), want.end(), dims.begin());
}

}  // namespace tlt_cpu
