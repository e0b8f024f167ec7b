// A small SIMT emulator that runs the torch-free CUDA kernels of csrc/ on the CPU, so their
// indexing, masking and synchronization are tested on a machine without a GPU.
//
// Force-included (g++ -include simt_emu.h -x c++ csrc/foo.cu) in place of the CUDA headers; it
// supplies what csrc/cuda_compat.h would (types, WARP_SIZE, pl_shfl_xor, launch_kernel) plus the
// CUDA built-ins the kernels use. Every GPU thread is a fiber (ucontext); blocks run one at a time.
//
// Semantics enforced (a violation fails the launch with a message instead of hanging):
//   * __syncthreads(): every live thread of the block must arrive; a thread that exits while others
//     wait at a barrier is an error (non-uniform barrier);
//   * pl_shfl_xor(): all WARP_SIZE lanes of the warp must make the same call (full-mask shuffle),
//     an exited lane or a lane at a different shuffle deadlocks and is reported;
//   * fibers are resumed in a random (seeded) order at every scheduling pass, so a missing barrier
//     shows up as wrong results rather than staying hidden by a fixed order; the blocks of a grid
//     run in a random order too.
// __shared__ variables become function-level statics: shared by the fibers of a block, and blocks
// run one after another, so this matches CUDA as long as a kernel does not rely on their contents at
// block start (it must not on a GPU either).
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#define PAGEDLLM_SIMT_EMU 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define PL_DEVICE inline
#define PL_LAUNCH_BOUNDS(threads)
#define WARP_SIZE 32

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint4 {
  unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }

// ---- 16-bit float storage types ------------------------------------------------------------
struct __half {
  uint16_t bits;
};
struct pl_bf16_storage {
  uint16_t bits;
};
typedef __half pl_half;
typedef pl_bf16_storage pl_bf16;

inline __half __ushort_as_half(unsigned short bits) { return __half{bits}; }
inline float __half2float(__half h) {
  _Float16 f;
  std::memcpy(&f, &h.bits, 2);
  return static_cast<float>(f);
}
inline __half __float2half(float value) {
  const _Float16 f = static_cast<_Float16>(value);  // round to nearest even
  __half h;
  std::memcpy(&h.bits, &f, 2);
  return h;
}
inline unsigned short __half_as_ushort(__half h) { return h.bits; }
inline float pl_uint_as_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline uint32_t pl_float_as_uint(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return bits;
}

// ---- runtime API subset ----------------------------------------------------------------------
typedef void* cudaStream_t;
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorLaunchFailure = 4 };
enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4
};

namespace simt {

struct Fiber {
  enum State { kReady, kWaitBlock, kWaitWarp, kDone };
  ucontext_t ctx;
  std::vector<char> stack;
  dim3 thread_idx;
  int linear = 0;
  State state = kReady;
  uint64_t wait_gen = 0;
};

struct Warp {
  uint64_t gen = 0;
  int arrived = 0;
  int mask = 0;
  int width = 0;
  float slots[2][WARP_SIZE];
};

struct Block {
  dim3 block_idx, block_dim, grid_dim;
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  ucontext_t scheduler;
  std::function<void()> body;
  uint64_t barrier_gen = 0;
  int barrier_arrived = 0;
  int live = 0;
  bool failed = false;
};

inline Block* g_block = nullptr;
inline Fiber* g_fiber = nullptr;
inline std::string g_error;      // first error of the current launch sequence
inline uint64_t g_seed = 12345;  // scheduling order seed
inline size_t g_stack_bytes = 256 * 1024;

inline void fail(const std::string& message) {
  if (g_error.empty()) g_error = message;
  g_block->failed = true;
  swapcontext(&g_fiber->ctx, &g_block->scheduler);  // never resumed
}

inline void fiber_entry() {
  g_block->body();
  g_fiber->state = Fiber::kDone;
  // uc_link returns to the scheduler.
}

inline void sync_block() {
  Block& b = *g_block;
  Fiber& f = *g_fiber;
  const uint64_t gen = b.barrier_gen;
  if (++b.barrier_arrived == b.live) {
    b.barrier_arrived = 0;
    ++b.barrier_gen;
    return;
  }
  f.state = Fiber::kWaitBlock;
  f.wait_gen = gen;
  swapcontext(&f.ctx, &b.scheduler);
}

inline float shfl_xor(float value, int lane_mask, int width) {
  Block& b = *g_block;
  Fiber& f = *g_fiber;
  const int lane = f.linear % WARP_SIZE;
  Warp& w = b.warps[f.linear / WARP_SIZE];
  if (width <= 0 || width > WARP_SIZE || (width & (width - 1)) != 0) fail("shfl_xor: bad width");
  const int buf = static_cast<int>(w.gen & 1);
  if (w.arrived == 0) {
    w.mask = lane_mask;
    w.width = width;
  } else if (w.mask != lane_mask || w.width != width) {
    fail("shfl_xor: lanes of one warp are at different shuffles (divergent shuffle)");
  }
  w.slots[buf][lane] = value;
  const uint64_t gen = w.gen;
  if (++w.arrived == WARP_SIZE) {
    w.arrived = 0;
    ++w.gen;
  } else {
    f.state = Fiber::kWaitWarp;
    f.wait_gen = gen;
    swapcontext(&f.ctx, &b.scheduler);
  }
  int src = lane ^ lane_mask;
  if (src / width != lane / width) src = lane;
  return w.slots[buf][src];
}

inline bool runnable(const Block& b, const Fiber& f) {
  switch (f.state) {
    case Fiber::kReady: return true;
    case Fiber::kWaitBlock: return b.barrier_gen > f.wait_gen;
    case Fiber::kWaitWarp: return b.warps[f.linear / WARP_SIZE].gen > f.wait_gen;
    case Fiber::kDone: return false;
  }
  return false;
}

inline void run_block(Block& b, std::mt19937_64& rng) {
  const int n = static_cast<int>(b.block_dim.x * b.block_dim.y * b.block_dim.z);
  b.fibers.resize(n);
  b.warps.assign((n + WARP_SIZE - 1) / WARP_SIZE, Warp{});
  b.barrier_gen = 0;
  b.barrier_arrived = 0;
  b.live = n;
  for (int i = 0; i < n; ++i) {
    Fiber& f = b.fibers[i];
    f.linear = i;
    f.thread_idx = dim3(i % b.block_dim.x, (i / b.block_dim.x) % b.block_dim.y,
                        i / (b.block_dim.x * b.block_dim.y));
    f.state = Fiber::kReady;
    f.stack.resize(g_stack_bytes);
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = f.stack.size();
    f.ctx.uc_link = &b.scheduler;
    makecontext(&f.ctx, fiber_entry, 0);
  }
  std::vector<int> order(n);
  for (int i = 0; i < n; ++i) order[i] = i;
  int done = 0;
  while (done < n && !b.failed) {
    std::shuffle(order.begin(), order.end(), rng);
    bool progressed = false;
    for (int i : order) {
      Fiber& f = b.fibers[i];
      if (!runnable(b, f)) continue;
      f.state = Fiber::kReady;
      g_fiber = &f;
      swapcontext(&b.scheduler, &f.ctx);
      progressed = true;
      if (b.failed) break;
      if (f.state == Fiber::kDone) {
        ++done;
        --b.live;
        if (b.barrier_arrived > 0) {
          g_error = "a thread exited while others wait at __syncthreads (non-uniform barrier)";
          b.failed = true;
          break;
        }
      }
    }
    if (!progressed && !b.failed) {
      g_error = "deadlock: threads wait at a barrier or shuffle that some lanes never reach";
      b.failed = true;
    }
  }
}

inline void run_grid(dim3 grid, dim3 block, std::function<void()> body) {
  if (!g_error.empty()) return;  // an earlier launch failed; keep its message
  if ((block.x * block.y * block.z) % WARP_SIZE != 0) {
    g_error = "block size must be a multiple of WARP_SIZE";
    return;
  }
  std::mt19937_64 rng(g_seed++);
  Block b;
  b.grid_dim = grid;
  b.block_dim = block;
  b.body = std::move(body);
  // Blocks run in a random (seeded) order: a kernel may not rely on one.
  std::vector<dim3> blocks;
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) blocks.emplace_back(x, y, z);
    }
  }
  std::shuffle(blocks.begin(), blocks.end(), rng);
  for (const dim3& idx : blocks) {
    if (!g_error.empty()) break;
    b.block_idx = idx;
    b.failed = false;
    g_block = &b;
    run_block(b, rng);
  }
  g_block = nullptr;
  g_fiber = nullptr;
}

}  // namespace simt

#define threadIdx (::simt::g_fiber->thread_idx)
#define blockIdx (::simt::g_block->block_idx)
#define blockDim (::simt::g_block->block_dim)
#define gridDim (::simt::g_block->grid_dim)
#define __syncthreads() ::simt::sync_block()

inline float pl_shfl_xor(float value, int lane_mask, int width = WARP_SIZE) {
  return ::simt::shfl_xor(value, lane_mask, width);
}

// g++ in ISO mode (-std=c++17) never contracts a * b + c into an FMA, so the plain operators are the
// correctly rounded single operations that __fmul_rn / __fadd_rn are on the GPU.
inline float pl_fmul_rn(float a, float b) { return a * b; }
inline float pl_fadd_rn(float a, float b) { return a + b; }
// Programmatic dependent launch has nothing to overlap here: launches run one after another.
inline void pl_wait_prior_grids() {}
inline void pl_release_dependents() {}
inline void pl_release_and_wait() {}
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

inline cudaError_t cudaGetLastError() {
  return simt::g_error.empty() ? cudaSuccess : cudaErrorLaunchFailure;
}
inline const char* cudaGetErrorString(cudaError_t err) {
  return err == cudaSuccess ? "no error" : "emulated launch failed";
}
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind,
                                   cudaStream_t) {
  std::memcpy(dst, src, bytes);
  return cudaSuccess;
}

namespace pagedllm {
template <typename... KernelArgs, typename... Args>
inline void launch_kernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, cudaStream_t,
                          Args... args);
// Dynamic shared memory is not emulated (no emulated kernel uses it).
template <typename... KernelArgs, typename... Args>
inline void launch_kernel_smem(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, int,
                               cudaStream_t stream, Args... args) {
  launch_kernel(kernel, grid, block, stream, args...);
}
template <typename... KernelArgs, typename... Args>
inline void launch_kernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, cudaStream_t,
                          Args... args) {
  std::tuple<KernelArgs...> params(static_cast<KernelArgs>(args)...);
  simt::run_grid(grid, block, [&]() { std::apply(kernel, params); });
}
}  // namespace pagedllm
