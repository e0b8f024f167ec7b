// Launch configuration shared by every launcher: whether launch_kernel (cuda_compat.h) uses
// programmatic dependent launch.
#include <atomic>

#include "cuda_compat.h"

namespace pagedllm {
namespace {

std::atomic<bool> g_programmatic_launch{false};
std::atomic<int> g_kernel_arch{0};

#if !defined(USE_ROCM)
// Writes the architecture of the device code that runs (0 where it is not CUDA).
__global__ void device_arch_kernel(int* arch) {
#if defined(__CUDA_ARCH__)
  *arch = __CUDA_ARCH__;
#else
  *arch = 0;
#endif
}
#endif

}  // namespace

bool programmatic_launch_enabled() { return g_programmatic_launch.load(std::memory_order_relaxed); }

int kernel_arch() { return g_kernel_arch.load(std::memory_order_relaxed); }

bool configure_programmatic_launch(bool enable) {
  bool on = false;
#if !defined(USE_ROCM)
  // The kernels wait for their predecessor only where compiled for sm_90+ (pl_wait_prior_grids):
  // ask the code that actually runs on this device.
  int* arch = nullptr;
  int host_arch = 0;
  if (cudaMalloc(&arch, sizeof(int)) == cudaSuccess) {
    device_arch_kernel<<<1, 1>>>(arch);
    if (cudaMemcpy(&host_arch, arch, sizeof(int), cudaMemcpyDeviceToHost) != cudaSuccess) host_arch = 0;
    cudaFree(arch);
  }
  g_kernel_arch.store(host_arch, std::memory_order_relaxed);
  on = enable && host_arch >= 900;
#else
  (void)enable;
#endif
  g_programmatic_launch.store(on, std::memory_order_relaxed);
  return on;
}

}  // namespace pagedllm
