"""The server's engine process client: same streams as AsyncLLMEngine; a dead process is noticed."""
from __future__ import annotations

import asyncio

import pytest

from pagedllm import AsyncEngineArgs, SamplingParams
from pagedllm.engine.async_engine import EngineDeadError
from pagedllm.entrypoints.openai.engine_client import MPEngineClient, _Request, encode_delta
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import RequestOutputKind


def output(text: str, ids: list[int], finished: bool = False) -> RequestOutput:
    return RequestOutput("r", "p", [1, 2], None, [CompletionOutput(
        0, text, ids, -1.0, None, "length" if finished else None)], finished)


def test_deltas_rebuild_cumulative_outputs() -> None:
    acc = _Request("p", [1, 2], accumulate=True, prompt_every_time=True)
    rebuilt = [acc.apply("r", encode_delta(o)) for o in (
        output("a", [5]), output("b", [6]), output("c", [7], finished=True))]
    assert [(o.outputs[0].text, o.outputs[0].token_ids, o.finished) for o in rebuilt] == [
        ("a", [5], False), ("ab", [5, 6], False), ("abc", [5, 6, 7], True)]
    assert rebuilt[0].outputs[0].token_ids == [5]  # earlier snapshots are not mutated
    assert rebuilt[-1].prompt_token_ids == [1, 2] and rebuilt[-1].outputs[0].finish_reason == "length"


def test_deltas_pass_through_with_the_prompt_first() -> None:
    req = _Request("p", [1, 2], accumulate=False, prompt_every_time=False)
    outs = [req.apply("r", encode_delta(o)) for o in (output("a", [5]), output("b", [6], True))]
    assert [(o.outputs[0].text, o.outputs[0].token_ids) for o in outs] == [("a", [5]), ("b", [6])]
    assert outs[0].prompt_token_ids == [1, 2] and outs[1].prompt_token_ids is None


def test_engine_process_streams_and_death(tiny_model: str) -> None:
    client = MPEngineClient(AsyncEngineArgs(model=tiny_model, device="cpu", dtype="float32",
                                            num_gpu_blocks_override=32,
                                            disable_log_requests=True))
    params = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0)

    async def main() -> None:
        outs = [o async for o in client.generate("hi", params, "a")]
        assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3, 4, 5]
        assert outs[-1].finished and outs[-1].outputs[0].text.startswith(outs[0].outputs[0].text)
        delta = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0,
                               output_kind=RequestOutputKind.DELTA)
        deltas = [o async for o in client.generate("hi", delta, "d")]
        assert [len(o.outputs[0].token_ids) for o in deltas] == [1] * 5
        assert sum((o.outputs[0].token_ids for o in deltas), []) == outs[-1].outputs[0].token_ids
        assert "".join(o.outputs[0].text for o in deltas) == outs[-1].outputs[0].text
        assert deltas[0].prompt_token_ids == outs[0].prompt_token_ids
        assert all(o.prompt_token_ids is None for o in deltas[1:])
        with pytest.raises(ValueError, match="out of range"):
            await client.add_request("b", [10**6], params)
        await client.check_health()
        stream = await client.add_request("c", "long", SamplingParams(max_tokens=400,
                                                                      ignore_eos=True))
        await stream.__anext__()
        client._proc.kill()  # the engine process dies mid-request
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        assert client.errored
        with pytest.raises(EngineDeadError):
            await client.check_health()
        await client.shutdown()

    asyncio.run(main())
