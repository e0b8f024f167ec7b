"""Offline batched generation with pagedllm's ``LLM``: a few prompts, greedy and sampled, and a
chat conversation.

    python examples/offline_inference.py                      # the built-in demo model
    python examples/offline_inference.py --model /path/to/hf/checkpoint --device auto

Prints one block per request: its prompt, then what the engine generated. With the default
greedy settings the completions are the ones ``examples/openai_client.py`` gets from
``pagedllm serve`` for the same prompts (CI checks that: tests/examples/).
"""
from __future__ import annotations

import argparse

# import pagedllm before torch (or anything that imports it): it sets the OpenMP spin policy
# that torch's CPU threads read once, when torch loads (docs/backends.md, "Threads")
from pagedllm import LLM, SamplingParams

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:"]
CHAT = [{"role": "system", "content": "You write small Python helpers."},
        {"role": "user", "content": "Read a file and return its lines."}]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="pagedllm-demo", help="a local HF folder or pagedllm-demo")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, ... (pagedllm backends)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args(argv)

    llm = LLM(args.model, device=args.device, dtype=args.dtype, seed=0)

    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for out in llm.generate(PROMPTS, greedy, use_tqdm=False):
        completion = out.outputs[0]
        print(f"=== greedy {out.prompt!r} ({completion.finish_reason}, "
              f"{len(completion.token_ids)} tokens)\n{completion.text}")

    # n samples of one prompt; seed= makes a request's draws repeatable
    sampled = SamplingParams(temperature=0.8, top_p=0.95, n=2, seed=1234,
                             max_tokens=args.max_tokens)
    for i, completion in enumerate(llm.generate(PROMPTS[0], sampled, use_tqdm=False)[0].outputs):
        print(f"=== sample {i} of {PROMPTS[0]!r}\n{completion.text}")

    # a conversation through the tokenizer's chat template
    chat = llm.chat(CHAT, greedy, use_tqdm=False)[0].outputs[0]
    print(f"=== chat ({chat.finish_reason})\n{chat.text}")


if __name__ == "__main__":
    main()
