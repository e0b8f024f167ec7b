"""`pagedllm generate`: offline generation from the command line (default: the built-in model)."""
from __future__ import annotations

import argparse

SAMPLING_FLAGS = {  # flag -> (type, default); names as in SamplingParams
    "max_tokens": (int, 64), "temperature": (float, 0.0), "top_p": (float, 1.0),
    "top_k": (int, -1), "min_p": (float, 0.0), "n": (int, 1),
    "presence_penalty": (float, 0.0), "frequency_penalty": (float, 0.0),
    "repetition_penalty": (float, 1.0), "min_tokens": (int, 0),
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    from pagedllm.engine.arg_utils import EngineArgs

    p = sub.add_parser("generate", help="generate completions for prompts (offline)")
    p.add_argument("prompts", nargs="*", help="prompt strings")
    p.add_argument("--prompts-file", help="a file with one prompt per line")
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    for name, (kind, default) in SAMPLING_FLAGS.items():
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=default)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pagedllm import LLM, SamplingParams
    from pagedllm.engine.arg_utils import EngineArgs

    prompts = list(args.prompts)
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        raise ValueError("no prompt: give at least one PROMPT or --prompts-file")
    params = SamplingParams(stop=args.stop, ignore_eos=args.ignore_eos,
                            **{k: getattr(args, k) for k in SAMPLING_FLAGS})
    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**{k: v for k, v in vars(engine_args).items()})
    outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    for out in outputs:  # the text as it reads (code keeps its layout), then how it ended
        for comp in out.outputs:
            print(f"{out.prompt}{comp.text}\n--- [{comp.finish_reason}, "
                  f"{len(comp.token_ids)} tokens]")
    return 0
