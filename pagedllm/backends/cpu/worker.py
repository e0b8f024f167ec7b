"""The cpu worker: the base worker, plus a heap that keeps what a step frees (heap.py) and one
full-size step at start-up, so the first real step finds the heap grown and oneDNN's primitives
for that batch built instead of faulting pages in while a request waits."""
from __future__ import annotations

from pagedllm.backends.cpu.backend import CPU_MAX_NUM_BATCHED_TOKENS
from pagedllm.backends.cpu.heap import keep_freed_memory, release_free_pages
from pagedllm.backends.cpu.threads import apply_thread_binding
from pagedllm.worker.worker import Worker

# The start-up step's size cap: the cpu default token budget (a long-context model's budget of
# tens of thousands of tokens would take minutes on a CPU, for a batch that seldom comes).
WARMUP_MAX_TOKENS = CPU_MAX_NUM_BATCHED_TOKENS


class CpuWorker(Worker):
    def load_model(self) -> None:
        # $PAGEDLLM_CPU_OMP_THREADS_BIND, on the thread that will run the model (threads.py)
        apply_thread_binding(self.rank, self.tp.size * self.pp.size)
        keep_freed_memory()
        super().load_model()
        # the plain weights the packed linears replaced (ops.py) go back to the system here; the
        # start-up step then grows the heap to a step's peak (heap.py)
        release_free_pages()

    def after_cache_init(self) -> None:
        self.profile_run(WARMUP_MAX_TOKENS)
