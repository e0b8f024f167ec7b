"""Write the demo model's card: loss_curve.png and README.md, from the files training left.

    python tools/make_model_card.py pagedllm/models/demo_model

Reads loss_log.json and metrics.json (written by tools/train_demo_model.py) from the folder, so
the card is regenerated, never hand-edited, whenever the model is retrained. Needs matplotlib,
a tool dependency only (pagedllm does not import it).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

TRAIN_SCRIPT = "tools/train_demo_model.py"
SHIPPED_AT = "pagedllm/models/demo_model"
ARG_ORDER = ("seed", "vocab_size", "hidden_size", "layers", "heads", "kv_heads",
             "intermediate_size", "max_position", "seq_len", "batch_size", "lr", "min_lr_ratio",
             "warmup_steps", "weight_decay", "max_steps", "time_budget_s", "max_epochs",
             "eval_every", "log_every", "sample_tokens")


def plot_loss(log: dict[str, Any], metrics: dict[str, Any], path: str) -> None:
    """Training and held-out loss against tokens seen, with the unigram baseline for scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot([r["tokens"] / 1e6 for r in log["train"]], [r["loss"] for r in log["train"]],
            lw=1, label="training batch loss")
    if log.get("heldout"):
        ax.plot([r["tokens"] / 1e6 for r in log["heldout"]], [r["loss"] for r in log["heldout"]],
                "o-", ms=3, label="held-out loss")
    ax.axhline(metrics["heldout"]["unigram_loss"], color="gray", ls="--",
               label="unigram baseline (held-out)")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title("pagedllm-demo training")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def train_command(args: dict[str, Any]) -> str:
    """The training run's command line, every option spelled out so defaults may change."""
    parts = [f"python {TRAIN_SCRIPT}", f"--corpus {args.get('corpus') or 'CORPUS'}",
             f"--out {SHIPPED_AT}"]
    parts += [f"--{k.replace('_', '-')} {args[k]}" for k in ARG_ORDER if k in args]
    if args.get("compile"):
        parts.append("--compile")
    return " \\\n    ".join(parts)


def folder_mb(folder: str) -> float:
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)) / 1e6


def sections(m: dict[str, Any], folder: str) -> list[str]:
    c, mod, t, h = m["corpus"], m["model"], m["training"], m["heldout"]
    stop = {"time_budget_s": "the time budget", "max_steps": "the step limit",
            "max_epochs": "the epoch limit"}.get(t["stopped_by"], t["stopped_by"])
    head_dim = mod["hidden_size"] // mod["heads"]
    out = [f"""---
library_name: transformers
pipeline_tag: text-generation
license: other
license_name: psf-2.0
tags: [code, python, llama, pagedllm]
---

# pagedllm-demo

The model `pagedllm generate` and `pagedllm serve` run when no model is given: a
{mod['parameters'] / 1e6:.1f}M-parameter Llama trained from scratch by the pagedllm project to
complete Python source code. It exists so that the first command shows real text without a
download; it is far too small to be useful beyond that. It loads in pagedllm and in
transformers (`LlamaForCausalLM`) alike, and the test suite checks that both give the same greedy
tokens.

## Model

| | |
|---|---|
| architecture | `LlamaForCausalLM`, tied input/output embeddings |
| parameters | {mod['parameters']:,} |
| layers / hidden / MLP | {mod['layers']} / {mod['hidden_size']} / {mod['intermediate_size']} |
| attention heads | {mod['heads']} query, {mod['kv_heads']} key/value (GQA), head size {head_dim} |
| context | {mod['max_position']} positions, trained on {t['args']['seq_len']}-token windows |
| vocabulary | {mod['vocab_size']} byte-level BPE tokens |
| weights | {mod['dtype']} safetensors; this folder is {folder_mb(folder):.1f} MB |

## Data

The `*.py` files of the CPython {c['python_version']} standard library (PSF License Agreement),
without `{'`, `'.join(c['excluded_dirs'])}` (generated tables and documentation strings) and
without the few files not in UTF-8; tests are included. Files are taken in path order and each
is one document, preceded by `<|endoftext|>`. A file is held out when the SHA-256 of its
relative path puts it in the first {c['heldout_percent']}%: {c['heldout_files']} files
({c['heldout_tokens']:,} tokens) held out, {c['train_files']} files
({c['train_chars'] / 1e6:.1f}M characters, {c['train_tokens']:,} tokens) for training.

The tokenizer is a byte-level BPE (GPT-2 pre-tokenizer, no prefix space) trained with
`tokenizers` on the training files. `<|endoftext|>` is the BOS, EOS and padding token, and the
tokenizer puts it in front of every prompt, as every training file starts after one. The chat
template renders a conversation as a Python file: system and user messages become `# `
comment lines and assistant messages are code, so a chat request asks for the code that
follows the comments.

## Training

{t['steps']:,} steps of {t['args']['batch_size']} x {t['args']['seq_len']} tokens
({t['tokens'] / 1e6:.1f}M tokens, {t['epochs']:.1f} epochs) in {t['seconds']:.0f} s on
{t['device']} ({t['tokens_per_s'] / 1e3:,.0f}k tokens/s); the run was ended by {stop}. AdamW
(betas 0.9/0.95, weight decay {t['args']['weight_decay']}, gradient clipping 1.0), peak learning
rate {t['args']['lr']} after {t['args']['warmup_steps']} warmup steps, cosine decay to
{t['args']['min_lr_ratio']}x, bf16 autocast on GPU with float32 master weights. Versions:
Python {t['versions']['python']}, torch {t['versions']['torch']}, transformers
{t['versions']['transformers']}, tokenizers {t['versions']['tokenizers']}.

```bash
# the corpus, on a machine with CPython {c['python_version']}
python {TRAIN_SCRIPT} --corpus-out {t['args'].get('corpus') or 'CORPUS'}
# training (writes everything here but loss_curve.png and README.md)
{train_command(t['args'])}
python tools/make_model_card.py {SHIPPED_AT}
```

With a time budget, the step count (and the schedule, which follows the clock) depends on the
machine; `--max-steps {t['steps']} --time-budget-s 0 --max-epochs 0` runs the same number of
steps anywhere, with the schedule following the step count.

![loss curve](loss_curve.png)

## Evaluation

Perplexity on the {h['tokens']:,} held-out tokens (every held-out token but the first, predicted
from up to {t['args']['seq_len']} tokens before it), with the weights as shipped (bf16, computed
in float32):

| model | loss (nats/token) | perplexity |
|---|---|---|
| pagedllm-demo | {h['model_loss']:.3f} | {h['model_ppl']:.2f} |
| unigram baseline | {h['unigram_loss']:.3f} | {h['unigram_ppl']:.2f} |

The unigram baseline predicts every token by its frequency in the training split (add-one
smoothing): what a model that ignores context can do.

## Sample completions

Greedy decoding by transformers in float32 (the {mod['dtype']} weights as shipped, upcast),
{t['args']['sample_tokens']} new tokens at most; `pagedllm generate --dtype float32 --max-tokens
{t['args']['sample_tokens']} PROMPT` prints the same. The command's default, `--dtype auto`, runs
the checkpoint's {mod['dtype']}, which rounds differently and
parts from these after a few lines (the repository README shows its output for the first
prompt). Each block starts with its prompt:
"""]
    for s in m["samples"]:
        out.append(f"**`{s['prompt']!r}`**\n\n```python\n{s['prompt']}{s['completion']}\n```\n")
    out.append("""## Use

```bash
pagedllm generate "def fibonacci(n):"          # the default model
pagedllm serve                                  # OpenAI API on port 8000, model "pagedllm-demo"
```

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
from pagedllm.models.demo import demo_model_path

tok = AutoTokenizer.from_pretrained(demo_model_path())
model = AutoModelForCausalLM.from_pretrained(demo_model_path())
ids = tok("import os\\n", return_tensors="pt").input_ids
out = model.generate(ids, max_new_tokens=32, do_sample=False)
print(tok.decode(out[0], skip_special_tokens=True))
```

## Limitations

It has seen only the standard library, a few million tokens, and is small: it writes code that
looks like the standard library, often repeats itself under greedy decoding, and does not follow
instructions. Held-out files are drawn from the same library, so the perplexity above
overstates how it does on other code. Do not use it for anything but trying pagedllm.
""")
    return out


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", nargs="?", default=SHIPPED_AT)
    folder = parser.parse_args(argv).folder
    with open(os.path.join(folder, "loss_log.json")) as f:
        log = json.load(f)
    with open(os.path.join(folder, "metrics.json")) as f:
        metrics = json.load(f)
    plot_loss(log, metrics, os.path.join(folder, "loss_curve.png"))
    with open(os.path.join(folder, "README.md"), "w") as f:
        f.write("\n".join(sections(metrics, folder)))
    logging.info("wrote %s/loss_curve.png and %s/README.md", folder, folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
