"""`pagedllm generate`: offline generation from the command line (default: the built-in model)."""
from __future__ import annotations

import argparse

# flag -> (type, default, help); names and defaults as in SamplingParams, except greedy
# (temperature 0) and 64 tokens
SAMPLING_FLAGS: dict[str, tuple[type, object, str]] = {
    "max_tokens": (int, 64, "most tokens to generate per completion"),
    "temperature": (float, 0.0, "sampling temperature; 0 is greedy"),
    "top_p": (float, 1.0, "nucleus sampling: keep the smallest set of tokens whose probabilities "
                          "add up to this; 1 keeps all"),
    "top_k": (int, -1, "keep the k most likely tokens; -1 keeps all"),
    "min_p": (float, 0.0, "drop tokens less likely than this fraction of the most likely one; "
                          "0 keeps all"),
    "n": (int, 1, "completions per prompt"),
    "presence_penalty": (float, 0.0, "subtracted from the logit of every token already "
                                     "generated, in [-2, 2]"),
    "frequency_penalty": (float, 0.0, "subtracted from a token's logit once per time it was "
                                      "generated, in [-2, 2]"),
    "repetition_penalty": (float, 1.0, "divides positive (multiplies negative) logits of tokens "
                                       "in the prompt or output; 1 is none"),
    "min_tokens": (int, 0, "tokens to generate before EOS or a stop string may end a completion"),
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    from pagedllm.engine.arg_utils import EngineArgs

    p = sub.add_parser("generate", help="generate completions for prompts (offline)")
    p.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt strings")
    p.add_argument("--prompts-file", help="a file with one prompt per line, added after the "
                                          "PROMPTs (default: none)")
    sampling = p.add_argument_group("sampling")
    sampling.add_argument("--stop", action="append", default=None,
                          help="a stop string, repeatable (default: none)")
    sampling.add_argument("--ignore-eos", action="store_true",
                          help="keep generating after the end-of-sequence token (default: False)")
    for name, (kind, default, text) in SAMPLING_FLAGS.items():
        sampling.add_argument("--" + name.replace("_", "-"), type=kind, default=default,
                              help=f"{text} (default: {default})")
    EngineArgs.add_cli_args(p.add_argument_group("engine"))
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
