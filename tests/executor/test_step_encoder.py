"""Per-request worker state: every batch of real engine runs, sent as a StepDelta (what the
workers do not hold yet) and rebuilt from the kept state, equals the batch the scheduler made;
and a decode step's bytes do not grow with the context."""
from __future__ import annotations

import dataclasses
import pickle
import time

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.backends.cpu.backend import CpuBackend
from pagedllm.config import SchedulerConfig
from pagedllm.core.batch import ScheduledBatch, StepDelta
from pagedllm.core.block_manager import BlockManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.executor.step_encoder import StepEncoder
from pagedllm.testing.invariants import assert_drained
from pagedllm.worker.seq_states import SeqStates

PROMPTS = [[5 + i, 17, 33 + 2 * i, 9, 11, 40 + i] * (2 + i % 4) for i in range(10)]


def assert_same_batch(got: ScheduledBatch, want: ScheduledBatch) -> None:
    assert len(got.seqs) == len(want.seqs)
    for g, w in zip(got.seqs, want.seqs):
        for f in dataclasses.fields(w):
            gv, wv = getattr(g, f.name), getattr(w, f.name)
            if f.name == "history" and w.num_samples == 0:
                continue  # read for sampled rows only
            if f.name == "sampling_params":
                gv, wv = pickle.dumps(gv), pickle.dumps(wv)
            assert gv == wv, (f.name, g.seq_id, gv, wv)
    for name in ("blocks_to_swap_out", "blocks_to_swap_in", "blocks_to_copy",
                 "finished_seq_ids", "virtual_engine"):
        assert getattr(got, name) == getattr(want, name), name


class Checker:
    """Wraps the engine's encoder: each StepDelta is pickled (as the mp and ray executors send
    it), rebuilt by a second SeqStates and compared with the scheduler's batch."""

    def __init__(self, llm: LLM) -> None:
        executor = llm.llm_engine.executor
        self.encoder = executor.encoder
        self.states = SeqStates()
        self.steps = 0
        self.kinds: set[str] = set()
        real = self.encoder.encode

        def encode(batch: ScheduledBatch) -> StepDelta:
            want = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
            want["seqs"] = [dataclasses.replace(s, block_table=list(s.block_table),
                                                history=None if s.history is None
                                                else list(s.history)) for s in batch.seqs]
            step = real(batch)
            got = self.states.apply(pickle.loads(pickle.dumps(step)))
            assert_same_batch(got, ScheduledBatch(**want))
            self.steps += 1
            self.kinds |= {"new"} if step.new_seqs else set()
            self.kinds |= {type(e).__name__ for e in step.seqs}
            self.kinds |= {"update"} if step.block_updates else set()
            self.kinds |= {"slid"} if step.slid else set()
            self.kinds |= {"swap"} if step.blocks_to_swap_in else set()
            self.kinds |= {"cow"} if step.blocks_to_copy else set()
            return step

        self.encoder.encode = encode  # type: ignore[method-assign]

    def check_drained(self) -> None:
        assert self.encoder.num_seqs == 0 and not self.states.seqs


def run(llm: LLM, params: list[SamplingParams]) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:len(params)]], params,
                        use_tqdm=False)
    assert_drained(llm.llm_engine)
    return [[c.token_ids for c in o.outputs] for o in outs]


def mixed_params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True,
                           repetition_penalty=1.3, presence_penalty=0.5),
            SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, prompt_logprobs=2),
            SamplingParams(temperature=0.9, seed=1, n=2, best_of=3, max_tokens=12,
                           ignore_eos=True, frequency_penalty=0.4)] * 2


@pytest.mark.parametrize("kwargs", [
    dict(enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=32,
         max_num_seqs=8),
    dict(num_gpu_blocks_override=40, preemption_mode="recompute", enable_prefix_caching=True),
    dict(num_gpu_blocks_override=40, preemption_mode="swap", swap_space=1),
], ids=["prefix-chunked", "recompute", "swap"])
def test_rebuilt_batches_equal_the_scheduled_ones(llama_path: str, kwargs: dict) -> None:
    llm = LLM(llama_path, device="cpu", dtype="float32", max_model_len=256, block_size=4,
              **kwargs)
    checker = Checker(llm)
    first = run(llm, mixed_params())
    assert run(llm, mixed_params()) == first  # again, over a warm prefix cache / fresh ids
    llm.llm_engine.step()  # a last schedule tells the workers of the last finished sequences
    checker.check_drained()
    assert {"new", "tuple", "SeqChunk", "update", "cow"} <= checker.kinds
    if "preemption_mode" in kwargs:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    if kwargs.get("preemption_mode") == "swap":
        assert "swap" in checker.kinds


def test_sliding_window_placeholders(checkpoint_factory) -> None:
    path = checkpoint_factory("mistral", sliding_window=6)
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=256, block_size=4,
              enable_prefix_caching=True)
    checker = Checker(llm)
    run(llm, mixed_params()[:4])
    llm.llm_engine.step()
    checker.check_drained()
    assert "slid" in checker.kinds and llm.llm_engine.block_manager.num_slid_out_blocks > 0


def test_scheduled_ahead_decodes(llama_path: str) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CpuBackend, "capabilities",
                   dataclasses.replace(CpuBackend.capabilities, async_output=True))
        llm = LLM(llama_path, device="cpu", dtype="float32", max_model_len=256, block_size=4)
    checker = Checker(llm)
    run(llm, [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)] * 4)
    assert llm.llm_engine.num_steps_ahead > 0 and "tuple" in checker.kinds


def decode_step_bytes(context: int, batch: int = 16, decode_steps: int = 8) -> list[int]:
    """Pickled StepDelta of each all-decode step, for ``batch`` sequences of ``context``."""
    prompt_len = context - decode_steps
    cfg = SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=batch * prompt_len)
    cfg.resolve(context)
    sched = Scheduler(cfg, BlockManager(16, batch * (context // 16 + 2), 0, watermark=0.0))
    params = SamplingParams(temperature=0.0, max_tokens=decode_steps, ignore_eos=True,
                            repetition_penalty=1.2)  # sampling reads the whole sequence
    for i in range(batch):
        sched.add(SequenceGroup(str(i), [Sequence(i, [(7 * i + j) % 500 for j in range(prompt_len)])],
                                params, arrival_time=time.time()))
    encoder, sizes = StepEncoder(16), []
    while sched.has_unfinished():
        out = sched.schedule()
        step = encoder.encode(out.batch)
        if not step.new_seqs and len(step.seqs) == batch:
            sizes.append(len(pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)))
        sched.after_step(out)
        for (_, seq), s in zip(out.entries, out.batch.seqs):
            seq.append_token(300 + seq.num_output_tokens, 0.0, None)
            if seq.num_output_tokens >= decode_steps:
                seq.status = SequenceStatus.FINISHED_LENGTH
        sched.free_finished()
    return sizes


def test_decode_step_bytes_do_not_grow_with_the_context() -> None:
    short, long = decode_step_bytes(64), decode_step_bytes(2048)
    assert len(short) == len(long) > 0
    assert max(long) <= max(short) + 64, (short, long)  # a block id or two may need more bytes
    full = ScheduledBatch()  # what was sent before: every table and history, whole
    assert max(long) * 20 < len(pickle.dumps(full)) + 16 * 2048 * 3
