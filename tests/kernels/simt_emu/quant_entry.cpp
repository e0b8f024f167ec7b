// extern "C" entry over csrc/quantization's launcher, compiled with simt_emu.h for the CPU and
// loaded with ctypes by tests/kernels/test_quant_kernels.py.
#include <cstdint>

#include "quantization/quant_ops.h"

extern "C" {

void quant_emu_reset(uint64_t seed) {
  simt::g_error.clear();
  simt::g_seed = seed;
}

const char* quant_emu_last_error() { return simt::g_error.c_str(); }

int quant_emu_int4_linear(int dtype, void* y, int64_t y_stride, const void* x, int64_t x_stride,
                          const uint32_t* qweight, const float* scales, const float* offsets,
                          int m, int n, int k, int group_size) {
  pagedllm::Int4LinearArgs a{};
  a.dtype = static_cast<pagedllm::ScalarType>(dtype);
  a.y = y;
  a.y_stride = y_stride;
  a.x = x;
  a.x_stride = x_stride;
  a.qweight = qweight;
  a.scales = scales;
  a.offsets = offsets;
  a.m = m;
  a.n = n;
  a.k = k;
  a.group_size = group_size;
  return static_cast<int>(pagedllm::launch_int4_linear(a, nullptr));
}

}  // extern "C"
