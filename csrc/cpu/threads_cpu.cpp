// OpenMP thread placement for the cpu worker (pagedllm/backends/cpu/threads.py).
//
// bind_omp_threads(cpus) runs one parallel region of exactly len(cpus) threads on the calling
// thread's OpenMP pool (the pool torch's at::parallel_for, oneDNN and MKL reuse for every later
// region started from this thread: libgomp keeps one pool per thread that starts parallel work) and
// binds OpenMP thread i to cpus[i] with sched_setaffinity(0, ...), which on Linux acts on the calling
// thread only. Thread 0 is the caller itself. Returns the kernel thread ids (gettid) of threads
// 0..n-1 in that order, so the caller can log and check what was bound.
//
// Invariants: the region starts all n threads before any of them binds itself (new pool threads
// inherit the creator's mask at creation, so a thread created later by a bound caller would start
// on the caller's core); torch.set_num_threads(n) must be in effect so that no later region asks
// for more threads than the bound pool holds. Torch-free apart from the op registration.
#include <torch/library.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

std::vector<int64_t> bind_omp_threads(const std::vector<int64_t>& cpus) {
  const int64_t n = static_cast<int64_t>(cpus.size());
  TORCH_CHECK(n >= 1, "bind_omp_threads: cpus must name at least one cpu");
  for (int64_t cpu : cpus) {
    TORCH_CHECK(cpu >= 0 && cpu < CPU_SETSIZE, "bind_omp_threads: cpu id ", cpu,
                " is outside [0, ", CPU_SETSIZE, ")");
  }
#ifndef _OPENMP
  TORCH_CHECK(false, "bind_omp_threads: this library was built without OpenMP (torch's thread "
                     "pool is not OpenMP), so its pool threads cannot be reached");
  return {};
#else
  std::vector<int64_t> tids(n, -1);
  std::vector<int> errors(n, 0);
  int team = 0;
#pragma omp parallel num_threads(static_cast<int>(n))
  {
    const int i = omp_get_thread_num();
#pragma omp single
    team = omp_get_num_threads();
    // the implicit barrier of `single` orders every thread's creation before any binding
    if (i < n) {
      cpu_set_t mask;
      CPU_ZERO(&mask);
      CPU_SET(static_cast<int>(cpus[i]), &mask);
      if (sched_setaffinity(0, sizeof(mask), &mask) != 0) errors[i] = errno;
      tids[i] = static_cast<int64_t>(syscall(SYS_gettid));
    }
  }
  TORCH_CHECK(team == n, "bind_omp_threads: OpenMP started ", team, " threads instead of ", n,
              " (OMP_DYNAMIC or OMP_THREAD_LIMIT may cap the team)");
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(errors[i] == 0, "bind_omp_threads: sched_setaffinity of OpenMP thread ", i,
                " to cpu ", cpus[i], " failed: ", std::strerror(errors[i]));
  }
  return tids;
#endif
}

}  // namespace

// no tensor arguments, so a catch-all kernel (no dispatch key to select on)
TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("bind_omp_threads(int[] cpus) -> int[]", &bind_omp_threads);
}
