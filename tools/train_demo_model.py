"""Train pagedllm's built-in demo model: a ~16M-parameter Llama that completes Python code.

    python tools/train_demo_model.py --corpus-out .carry/stdlib.jsonl.gz  # the corpus
    python tools/train_demo_model.py --corpus .carry/stdlib.jsonl.gz --out DIR  # ~4 min on a GPU
    python tools/make_model_card.py DIR  # loss_curve.png and README.md

The data is the CPython standard library (tools/demo_data.py), the tokenizer a byte-level BPE
trained on its training split, the model a transformers LlamaForCausalLM trained from scratch with
plain torch, so the folder it writes loads in transformers and pagedllm alike. The data order and
the initial weights depend on --seed alone, and with --time-budget-s 0 a run is reproducible
step for step (bit for bit on CPU; GPU kernels may differ in the last bits). A time budget
instead stops the run, and anneals the learning rate, by the clock, so the step count depends
on the machine: metrics.json records it, and which budget ended the run. --max-epochs caps the
passes over the data (the stdlib is small: a fast GPU sees it many times within the budget).

On CPU the default model trains at a few thousand tokens/s on a desktop, so reproducing the
shipped model there takes hours: give the card's --max-steps with --time-budget-s 0.

Writes to --out: config.json, model.safetensors (bf16), generation_config.json, tokenizer.json,
tokenizer_config.json (with a chat template), loss_log.json and metrics.json (held-out
perplexity of the model and of a unigram baseline, sample completions).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import demo_data  # noqa: E402

log = logging.getLogger("train_demo_model")
SAMPLE_PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:",
                  "def read_lines(path):\n    with open(", "if __name__ == "]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="output folder (required unless --corpus-out)")
    p.add_argument("--stdlib", default=demo_data.default_stdlib(), help="stdlib folder to read")
    p.add_argument("--corpus", help="read the corpus from this file instead of --stdlib")
    p.add_argument("--corpus-out", help="write the corpus of --stdlib to this file and exit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--hidden-size", type=int, default=384)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=1024)
    p.add_argument("--max-position", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=64, help="sequences per step")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--max-steps", type=int, default=0,
                   help="stop after this many steps (0: no limit)")
    p.add_argument("--time-budget-s", type=float, default=210.0,
                   help="stop training after this many seconds (0: no limit)")
    # 6: where the held-out loss bottomed out in a 10-epoch run (it overfits after)
    p.add_argument("--max-epochs", type=float, default=6.0,
                   help="stop after this many passes over the training tokens (0: no limit)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=250, help="held-out loss every N steps")
    p.add_argument("--sample-tokens", type=int, default=48)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (default off)")
    args = p.parse_args(argv)
    if not args.corpus_out and not args.out:
        p.error("--out is required (or --corpus-out to only write the corpus)")
    if args.max_steps <= 0 and args.time_budget_s <= 0 and args.max_epochs <= 0:
        p.error("give --max-steps, --time-budget-s or --max-epochs, so training ends")
    return args


# --- data ----------------------------------------------------------------------------------
def batches(n_tokens: int, seq_len: int, batch_size: int, seed: int,
            device: torch.device) -> Iterator[torch.Tensor]:
    """Start offsets of windows of seq_len + 1 tokens, batch_size at a time, forever.

    Each epoch shifts the window grid by a random offset and shuffles the windows, both drawn
    from ``seed``; a batch may span two epochs. An epoch's offsets go to the device at once, so
    a step copies nothing from the host (a blocking copy would stall the launch queue).
    """
    rng = np.random.default_rng(seed)
    pending = torch.empty(0, dtype=torch.int64, device=device)
    while True:
        offset = int(rng.integers(seq_len))
        starts = np.arange(offset, n_tokens - seq_len - 1, seq_len)
        pending = torch.cat([pending, torch.as_tensor(rng.permutation(starts), device=device)])
        while len(pending) >= batch_size:
            yield pending[:batch_size]
            pending = pending[batch_size:]


def windows(ids: torch.Tensor, starts: torch.Tensor | np.ndarray, length: int) -> torch.Tensor:
    """[len(starts), length] tokens, as int64 on the device of ``ids``."""
    starts = torch.as_tensor(starts, device=ids.device)
    return ids[starts[:, None] + torch.arange(length, device=ids.device)].long()


# --- model ---------------------------------------------------------------------------------
def make_model(args: argparse.Namespace, vocab_size: int, eot: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    # no pad_token_id: it would make the EOT row a non-trainable padding_idx of the embedding
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=args.hidden_size,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads,
                         intermediate_size=args.intermediate_size,
                         max_position_embeddings=args.max_position, rope_theta=10000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=eot,
                         eos_token_id=eot, initializer_range=0.02)
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config)


def lm_loss(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of [batch, seq_len + 1] tokens, in float32."""
    logits = model(input_ids=tokens[:, :-1]).logits  # [batch, seq_len, vocab]
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


@torch.no_grad()
def heldout_nll(model: Any, ids: torch.Tensor, seq_len: int, batch_size: int,
                autocast: Callable[[], AbstractContextManager]) -> tuple[float, int]:
    """(mean NLL, count) over every held-out token but the first, in windows of seq_len."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    starts = np.arange(0, len(ids) - 1, seq_len)
    for i in range(0, len(starts), batch_size):
        chunk = starts[i:i + batch_size]
        full = chunk[chunk + seq_len + 1 <= len(ids)]
        parts = [windows(ids, full, seq_len + 1)] if len(full) else []
        parts += [ids[s:].long()[None] for s in chunk[chunk + seq_len + 1 > len(ids)]]
        for tokens in parts:
            n = tokens.numel() - tokens.shape[0]  # predicted tokens
            with autocast():
                total += lm_loss(model, tokens).item() * n
            count += n
    model.train(was_training)
    return total / count, count


def unigram_nll(train_ids: np.ndarray, heldout_ids: np.ndarray, vocab_size: int) -> float:
    """Mean NLL of held-out tokens (all but the first, as for the model) under add-one-smoothed
    token frequencies of the training split."""
    counts = np.bincount(train_ids, minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[heldout_ids[1:]].mean())


# --- training ------------------------------------------------------------------------------
def budgets_used(step: int, elapsed: float, epochs: float,
                 args: argparse.Namespace) -> dict[str, float]:
    """The fraction used of each budget given (steps, seconds, epochs); 0 for those not given.

    The largest is the run's progress: the cosine schedule follows it, so a run cut short by the
    clock still anneals to the end, and training stops when it reaches 1.
    """
    return {"max_steps": step / args.max_steps if args.max_steps > 0 else 0.0,
            "time_budget_s": elapsed / args.time_budget_s if args.time_budget_s > 0 else 0.0,
            "max_epochs": epochs / args.max_epochs if args.max_epochs > 0 else 0.0}


def lr_factor(step: int, progress: float, args: argparse.Namespace) -> float:
    """Linear warmup over warmup_steps, then cosine from 1 to min_lr_ratio as progress -> 1."""
    warm = min(1.0, (step + 1) / max(1, args.warmup_steps))
    cos = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return warm * (args.min_lr_ratio + (1.0 - args.min_lr_ratio) * cos)


def make_optimizer(model: Any, args: argparse.Namespace) -> torch.optim.Optimizer:
    """AdamW; matrices (embeddings included) decay, norm weights do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    fused = args.device.startswith("cuda")
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def train(model: Any, train_ids: torch.Tensor, heldout_ids: torch.Tensor, args: argparse.Namespace,
          autocast: Callable[[], AbstractContextManager]) -> dict[str, Any]:
    """Runs until a budget (steps, seconds, epochs) is used up; returns the loss log and totals."""
    step_model = torch.compile(model) if args.compile else model
    opt = make_optimizer(model, args)
    tokens_per_step = args.batch_size * args.seq_len
    history: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    step, start = 0, time.perf_counter()
    last_t, last_step = start, 0
    for starts in batches(len(train_ids), args.seq_len, args.batch_size, args.seed,
                          train_ids.device):
        used = budgets_used(step, time.perf_counter() - start,
                            step * tokens_per_step / len(train_ids), args)
        done = max(used.values())
        if done >= 1.0:
            break
        lr = args.lr * lr_factor(step, done, args)
        for group in opt.param_groups:
            group["lr"] = lr
        with autocast():
            loss = lm_loss(step_model, windows(train_ids, starts, args.seq_len + 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % args.log_every == 0 or step == 1:
            now = time.perf_counter()  # .item() waits for the GPU, so the rate is real
            value = loss.item()
            rate = (step - last_step) * tokens_per_step / max(now - last_t, 1e-9)
            history.append({"step": step, "tokens": step * tokens_per_step, "loss": value,
                            "lr": lr, "elapsed_s": now - start})
            log.info("step %d  loss %.4f  lr %.2e  %.0f tokens/s  %.0fs", step, value, lr, rate,
                     now - start)
            last_t, last_step = now, step
        if args.eval_every > 0 and step % args.eval_every == 0:
            nll, _ = heldout_nll(model, heldout_ids, args.seq_len, args.batch_size, autocast)
            evals.append({"step": step, "tokens": step * tokens_per_step, "loss": nll})
            log.info("step %d  held-out loss %.4f", step, nll)
            last_t = time.perf_counter()  # the logged rate is of training alone
    seconds = time.perf_counter() - start
    return {"train": history, "heldout": evals, "steps": step, "seconds": seconds,
            "tokens": step * tokens_per_step, "epochs": step * tokens_per_step / len(train_ids),
            "stopped_by": max(used, key=used.get)}


# --- output --------------------------------------------------------------------------------
def save(model: Any, tok: Any, args: argparse.Namespace, eot: int) -> None:
    """bf16 safetensors (the model is cast in place), tokenizer and generation config.

    Files are made world-readable: safetensors writes 0600, which a root ``pip install`` would
    keep, leaving the weights unreadable to other users.
    """
    from transformers import GenerationConfig

    os.makedirs(args.out, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(args.out, safe_serialization=True)
    GenerationConfig(bos_token_id=eot, eos_token_id=eot, pad_token_id=eot).save_pretrained(args.out)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump(demo_data.tokenizer_config(args.max_position), f, indent=2)
    for name in os.listdir(args.out):
        os.chmod(os.path.join(args.out, name), 0o644)


def samples(path: str, device: str, max_new_tokens: int) -> list[dict[str, str]]:
    """Greedy completions of the saved folder, loaded the way a user loads it (float32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    out = []
    for prompt in SAMPLE_PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids.to(device)
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        out.append({"prompt": prompt,
                    "completion": tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)})
    return out


def autocast_for(device: torch.device) -> Callable[[], AbstractContextManager]:
    """bf16 autocast on CUDA (float32 master weights); plain float32 elsewhere."""
    if device.type == "cuda":
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext


def run_facts(args: argparse.Namespace, run: dict[str, Any]) -> dict[str, Any]:
    """What the card needs to say how the model was trained, and on what."""
    import tokenizers
    import transformers

    device = torch.device(args.device)
    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    return {"args": {k: v for k, v in vars(args).items() if k not in ("out", "corpus_out")},
            "steps": run["steps"], "tokens": run["tokens"], "epochs": run["epochs"],
            "stopped_by": run["stopped_by"], "seconds": run["seconds"],
            "tokens_per_s": run["tokens"] / max(run["seconds"], 1e-9),
            "device": hardware or args.device,
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "transformers": transformers.__version__,
                         "tokenizers": tokenizers.__version__}}


def report(args: argparse.Namespace, corpus: dict[str, Any], data: dict[str, Any],
           run: dict[str, Any], n_params: int) -> dict[str, Any]:
    """metrics.json: held-out perplexity of the saved (bf16) weights, run facts, samples."""
    from transformers import AutoModelForCausalLM

    shipped = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32).to(args.device)
    nll, count = heldout_nll(shipped, data["heldout_ids"], args.seq_len, args.batch_size,
                             contextlib.nullcontext)
    base = unigram_nll(data["train_np"], data["heldout_np"], args.vocab_size)
    shape = ("vocab_size", "hidden_size", "layers", "heads", "kv_heads", "intermediate_size",
             "max_position")
    return {
        "corpus": dict(corpus["meta"], train_files=data["train_files"],
                       heldout_files=data["heldout_files"], train_chars=data["train_chars"],
                       train_tokens=len(data["train_np"]), heldout_tokens=len(data["heldout_np"])),
        "model": {"parameters": n_params, "dtype": "bfloat16",
                  **{k: getattr(args, k) for k in shape}},
        "training": run_facts(args, run),
        "heldout": {"tokens": count, "model_loss": nll, "model_ppl": math.exp(nll),
                    "unigram_loss": base, "unigram_ppl": math.exp(base)},
        "samples": samples(args.out, args.device, args.sample_tokens),
    }


def prepare(args: argparse.Namespace, corpus: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(tokenizer, token streams and counts) of the corpus."""
    train_texts, heldout_texts = demo_data.split(corpus)
    t0 = time.perf_counter()
    tok = demo_data.train_tokenizer(train_texts, args.vocab_size)
    train_np = demo_data.encode_stream(tok, train_texts)
    heldout_np = demo_data.encode_stream(tok, heldout_texts)
    log.info("corpus: %d train files (%d tokens), %d held out (%d tokens); tokenizer %.0fs",
             len(train_texts), len(train_np), len(heldout_texts), len(heldout_np),
             time.perf_counter() - t0)
    if len(train_np) < (args.batch_size + 1) * (args.seq_len + 1):
        raise ValueError(f"{len(train_np)} training tokens are too few for a batch of "
                         f"{args.batch_size} x {args.seq_len}; lower --batch-size or --seq-len")
    device = torch.device(args.device)
    return tok, {"train_np": train_np, "heldout_np": heldout_np,
                 "train_ids": torch.as_tensor(train_np.astype(np.int32), device=device),
                 "heldout_ids": torch.as_tensor(heldout_np.astype(np.int32), device=device),
                 "train_files": len(train_texts), "heldout_files": len(heldout_texts),
                 "train_chars": sum(map(len, train_texts))}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    if args.corpus_out:
        corpus = demo_data.build_corpus(args.stdlib)
        demo_data.write_corpus(corpus, args.corpus_out)
        log.info("wrote %d files to %s", len(corpus["docs"]), args.corpus_out)
        return 0
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    if args.corpus:
        corpus = demo_data.read_corpus(args.corpus)
    else:
        corpus = demo_data.build_corpus(args.stdlib)
    tok, data = prepare(args, corpus)
    args.vocab_size = tok.get_vocab_size()  # the trainer may stop short on a tiny corpus
    eot = tok.token_to_id(demo_data.EOT)
    model = make_model(args, args.vocab_size, eot).to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("model: %.2fM parameters on %s", n_params / 1e6, args.device)
    autocast = autocast_for(torch.device(args.device))
    run = train(model, data["train_ids"], data["heldout_ids"], args, autocast)
    log.info("trained %d steps (%.2f epochs) in %.0fs", run["steps"], run["epochs"], run["seconds"])
    save(model, tok, args, eot)
    metrics = report(args, corpus, data, run, n_params)
    with open(os.path.join(args.out, "loss_log.json"), "w") as f:
        json.dump({"train": run["train"], "heldout": run["heldout"]}, f)
    with open(os.path.join(args.out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    h = metrics["heldout"]
    log.info("held-out perplexity %.2f (unigram %.2f) over %d tokens", h["model_ppl"],
             h["unigram_ppl"], h["tokens"])
    for sample in metrics["samples"]:
        log.info("%r -> %r", sample["prompt"], sample["completion"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
