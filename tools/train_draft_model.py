"""Train the demo model's speculative-decoding proposers: a small draft model and an EAGLE head.

    python tools/train_draft_model.py --corpus .carry/stdlib-3.11.7.jsonl.gz   # < 3 min on one GPU

Both learn from the demo model (``--target``, default pagedllm/models/demo_model) on its own
training split of the CPython standard library (tools/demo_data.py: the same held-out files),
with its tokenizer, by distillation: the targets are the demo model's next-token
distributions (and, for the head, its hidden states), computed on the fly by the frozen target.

- the draft (``--out-draft``, default <target>/draft): a Llama with the target's vocabulary,
  tied embeddings and head size 64, ``--draft-*`` shape; loss: cross-entropy against the
  target's distribution;
- the EAGLE head (``--out-eagle``, default <target>/eagle), in vLLM's formats for Llama targets:
  EAGLE-3 by default (tools/eagle3_head.py: the target's states entering three of its layers
  fused by ``fc``, one decoder layer, a final norm, its own LM head over the 2,048 most frequent
  training tokens (``d2t``), so a draft step reads a quarter of the target's LM head; loss:
  cross-entropy against the target's distribution over ``--eagle-ttt-steps`` unrolled draft
  steps with EAGLE-3's training-time-test attention); or ``--eagle-version 1`` (``fc`` over
  concat(embedding of token i + 1, target hidden state at i), one decoder layer without input
  norm, the target's LM head; loss: smooth-L1 to the target's next hidden state plus
  cross-entropy against its next-token distribution, over two unrolled steps).

Each writes config.json and model.safetensors (bf16) and metrics.json (held-out top-1
agreement with the target per draft position and the mean accepted length it implies for
k = 4 drafts); the run prints the shipped size (budget: 8 MB together). On CPU everything
works at toy sizes (tests/spec_decode/test_train_tool.py runs it for seconds).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import demo_data  # noqa: E402
import eagle3_head  # noqa: E402
from eagle1_head import EagleHead, eagle_losses, soft_ce, target_pass  # noqa: E402
import train_demo_model as base  # noqa: E402

log = logging.getLogger("train_draft_model")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_DIR = os.path.join(REPO, "pagedllm", "models", "demo_model")
BUDGET_BYTES = 8 * 1024 * 1024
K = 4  # drafts per step the reported acceptance length assumes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=DEMO_DIR, help="the target model folder")
    p.add_argument("--out-draft", default=None, help="draft folder (default: <target>/draft)")
    p.add_argument("--out-eagle", default=None, help="EAGLE head folder (default: <target>/eagle)")
    p.add_argument("--what", default="draft,eagle", help="which to train: draft, eagle or both")
    p.add_argument("--stdlib", default=demo_data.default_stdlib(), help="stdlib folder to read")
    p.add_argument("--corpus", help="read the corpus from this file instead of --stdlib")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--draft-hidden-size", type=int, default=128)
    p.add_argument("--draft-layers", type=int, default=3)
    p.add_argument("--draft-heads", type=int, default=2)
    p.add_argument("--draft-kv-heads", type=int, default=1)
    p.add_argument("--draft-intermediate-size", type=int, default=384)
    p.add_argument("--eagle-version", type=int, default=3, choices=(1, 3),
                   help="3: EAGLE-3 (fused states of three target layers, a draft vocabulary, "
                        "training-time test); 1: EAGLE-1 (the final hidden state, the target's "
                        "LM head)")
    p.add_argument("--eagle-intermediate-size", type=int, default=512)
    p.add_argument("--eagle-draft-vocab", type=int, default=2048,
                   help="EAGLE-3: the most frequent training tokens the head predicts")
    p.add_argument("--eagle-ttt-steps", type=int, default=3,
                   help="EAGLE-3: draft steps unrolled in training (training-time test)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=64, help="sequences per step")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--max-steps", type=int, default=0, help="per model (0: no limit)")
    p.add_argument("--time-budget-s", type=float, default=60.0,
                   help="training seconds per model (0: no limit)")
    p.add_argument("--max-epochs", type=float, default=4.0,
                   help="passes over the training tokens per model (0: no limit)")
    p.add_argument("--eval-windows", type=int, default=64,
                   help="held-out windows of --seq-len for the agreement figures")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    if args.max_steps <= 0 and args.time_budget_s <= 0 and args.max_epochs <= 0:
        p.error("give --max-steps, --time-budget-s or --max-epochs, so training ends")
    args.what = [w.strip() for w in args.what.split(",") if w.strip()]
    for w in args.what:
        if w not in ("draft", "eagle"):
            p.error(f"--what {w!r}: allowed values are draft, eagle")
    args.out_draft = args.out_draft or os.path.join(args.target, "draft")
    args.out_eagle = args.out_eagle or os.path.join(args.target, "eagle")
    return args


# --- data and target -----------------------------------------------------------------------
def load_data(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """The target's training split and held-out split, encoded with the target's tokenizer."""
    from tokenizers import Tokenizer

    corpus = (demo_data.read_corpus(args.corpus) if args.corpus
              else demo_data.build_corpus(args.stdlib))
    train_texts, heldout_texts = demo_data.split(corpus)
    tok = Tokenizer.from_file(os.path.join(args.target, "tokenizer.json"))
    train = demo_data.encode_stream(tok, train_texts).astype(np.int32)
    heldout = demo_data.encode_stream(tok, heldout_texts).astype(np.int32)
    if len(train) < (args.batch_size + 1) * (args.seq_len + 1):
        raise ValueError(f"{len(train)} training tokens are too few for a batch of "
                         f"{args.batch_size} x {args.seq_len}; lower --batch-size or --seq-len")
    log.info("data: %d train tokens, %d held out", len(train), len(heldout))
    dev = torch.device(args.device)
    return {"train": torch.as_tensor(train, device=dev),
            "heldout": torch.as_tensor(heldout, device=dev)}


def load_target(args: argparse.Namespace) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    model = model.to(args.device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


# --- the two students ----------------------------------------------------------------------
def make_draft(args: argparse.Namespace, target: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    t = target.config
    config = LlamaConfig(vocab_size=t.vocab_size, hidden_size=args.draft_hidden_size,
                         num_hidden_layers=args.draft_layers,
                         num_attention_heads=args.draft_heads,
                         num_key_value_heads=args.draft_kv_heads,
                         head_dim=args.draft_hidden_size // args.draft_heads,
                         intermediate_size=args.draft_intermediate_size,
                         max_position_embeddings=t.max_position_embeddings, rope_theta=10000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=True,
                         bos_token_id=t.bos_token_id, eos_token_id=t.eos_token_id,
                         initializer_range=0.02)
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config).to(args.device)


def draft_loss(draft: Any, target: Any, tokens: torch.Tensor) -> tuple[torch.Tensor, list]:
    _, logits = target_pass(target, tokens)
    pred = draft(input_ids=tokens).logits
    agree = (pred.argmax(-1) == logits.argmax(-1)).float().mean().detach()
    return soft_ce(pred, logits), [agree]


# --- training and evaluation ---------------------------------------------------------------
def train(name: str, model: nn.Module, loss_fn: Any, data: dict[str, torch.Tensor],
          args: argparse.Namespace) -> dict[str, Any]:
    """The demo trainer's loop (AdamW, warmup + cosine by the largest budget used)."""
    autocast = base.autocast_for(torch.device(args.device))
    opt = base.make_optimizer(model, args)
    train_ids = data["train"]
    tokens_per_step = args.batch_size * args.seq_len
    step, start, history = 0, time.perf_counter(), []
    used = base.budgets_used(0, 0.0, 0.0, args)
    model.train()
    for starts in base.batches(len(train_ids), args.seq_len, args.batch_size, args.seed,
                               train_ids.device):
        used = base.budgets_used(step, time.perf_counter() - start,
                                 step * tokens_per_step / len(train_ids), args)
        if max(used.values()) >= 1.0:
            break
        lr = args.lr * base.lr_factor(step, max(used.values()), args)
        for group in opt.param_groups:
            group["lr"] = lr
        with autocast():
            loss, agree = loss_fn(base.windows(train_ids, starts, args.seq_len + 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % args.log_every == 0 or step == 1:
            entry = {"step": step, "loss": loss.item(), "lr": lr,
                     "agree": [a.item() for a in agree],
                     "elapsed_s": time.perf_counter() - start}
            history.append(entry)
            log.info("%s step %d  loss %.4f  agreement %s  %.0fs", name, step, entry["loss"],
                     " ".join(f"{a:.3f}" for a in entry["agree"]), entry["elapsed_s"])
    model.eval()
    return {"steps": step, "seconds": time.perf_counter() - start, "log": history,
            "tokens": step * tokens_per_step, "stopped_by": max(used, key=used.get)}


def expected_length(alphas: list[float], k: int = K) -> float:
    """Mean tokens per verification for ``k`` drafts whose i-th is accepted with probability
    alphas[min(i, len - 1)] given the ones before: 1 + sum over i of prod(alpha_1..alpha_i)."""
    total, run = 1.0, 1.0
    for i in range(k):
        run *= alphas[min(i, len(alphas) - 1)]
        total += run
    return total


@torch.no_grad()
def evaluate(loss_fn: Any, data: dict[str, torch.Tensor], args: argparse.Namespace) -> list[float]:
    """Top-1 agreement with the target on held-out windows, per draft step."""
    ids = data["heldout"]
    n = min(args.eval_windows, (len(ids) - 1) // (args.seq_len + 1))
    if n <= 0:
        return []
    starts = torch.arange(n, device=ids.device) * (args.seq_len + 1)
    sums: list[float] = []
    for i in range(0, n, args.batch_size):
        with base.autocast_for(torch.device(args.device))():
            _, agree = loss_fn(base.windows(ids, starts[i:i + args.batch_size], args.seq_len + 1))
        part = len(starts[i:i + args.batch_size])
        sums = [s + a.item() * part for s, a in zip(sums or [0.0] * len(agree), agree)]
    return [s / n for s in sums]


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in ("config.json", "model.safetensors"))


def save_draft(draft: Any, args: argparse.Namespace, report: dict[str, Any]) -> None:
    os.makedirs(args.out_draft, exist_ok=True)
    draft.config.architectures = ["LlamaForCausalLM"]
    draft.to(torch.bfloat16).save_pretrained(args.out_draft, safe_serialization=True)
    for extra in ("generation_config.json",):
        path = os.path.join(args.out_draft, extra)
        if os.path.exists(path):
            os.remove(path)
    _finish(args.out_draft, report, args)


def save_eagle(head: nn.Module, target: Any, args: argparse.Namespace,
               report: dict[str, Any]) -> None:
    sys.path.insert(0, REPO)
    from pagedllm.spec_decode.checkpoints import eagle_config
    from pagedllm.spec_decode.checkpoints import save_eagle as write

    if args.eagle_version == 3:
        cfg = eagle_config(target.config, 3, intermediate_size=args.eagle_intermediate_size,
                           draft_vocab_size=len(head.draft_ids), aux_layer_ids=head.aux_layers)
        state = head.export(target.config.vocab_size)
    else:
        cfg = eagle_config(target.config, 1, intermediate_size=args.eagle_intermediate_size)
        state = head.export()
    cfg["torch_dtype"] = "bfloat16"
    write(args.out_eagle, cfg, {k: v.to(torch.bfloat16).cpu() if v.is_floating_point()
                                else v.cpu() for k, v in state.items()})
    _finish(args.out_eagle, report, args)


CARD = """# pagedllm-demo {title}

{what}

    from pagedllm import LLM
    llm = LLM("pagedllm-demo", speculative_config={{"method": "{method}",
                                                    "num_speculative_tokens": 4}})
    # pagedllm generate "def fibonacci(n):" --speculative-config '{{"method": "{method}", "num_speculative_tokens": 4}}'

Greedy output with it is the demo model's own, token for token; it only makes decoding faster.

## How it was made

`tools/train_draft_model.py` ({when}): distilled from the demo model on the demo model's
training split of the CPython standard library (tools/demo_data.py; the same held-out files are
left out), {steps} steps of {batch} x {seq_len} tokens in {seconds:.0f} s on {device}.
{loss}

{params:,} parameters, bfloat16, {size:.2f} MB.

## How well it drafts

Top-1 agreement with the demo model on held-out code (teacher-forced, {windows} windows of
{seq_len} tokens){by_step}: {agree}. For k = 4 drafts that suggests about {length:.2f} tokens per
verification (1 + the accepted drafts); the measured figure on held-out completions is in
benchmarks/RESULTS.md (`benchmarks/spec_decode.py`).
"""


def write_card(path: str, report: dict[str, Any], args: argparse.Namespace) -> None:
    draft = report["kind"] == "draft_model"
    agree = report.get("heldout_top1_agreement") or report.get("heldout_top1_agreement_by_step")
    text = CARD.format(
        title="draft model" if draft else "EAGLE head",
        what=("A small Llama with the demo model's tokenizer that drafts tokens for it "
              f"({args.draft_layers} layers, hidden size {args.draft_hidden_size})." if draft else
              "An EAGLE-3 head (vLLM's checkpoint format) that drafts from the demo model's own "
              "hidden states at three of its layers: one decoder layer, and an LM head over the "
              f"{args.eagle_draft_vocab} most frequent tokens." if args.eagle_version == 3 else
              "An EAGLE-1 head (vLLM's checkpoint format) that drafts from the demo model's own "
              "hidden states: one decoder layer over its embedding and LM head."),
        method="draft" if draft else "eagle", when=time.strftime("%Y-%m-%d"),
        steps=report["training"]["steps"], batch=args.batch_size, seq_len=args.seq_len,
        seconds=report["training"]["seconds"], device=report["device"],
        loss=("Loss: cross-entropy against the demo model's next-token distribution." if draft
              else "Loss: cross-entropy against the demo model's next-token distribution over "
                   f"{args.eagle_ttt_steps} unrolled draft steps (EAGLE-3's training-time test)."
              if args.eagle_version == 3 else
              "Loss: smooth-L1 to the demo model's next hidden state plus cross-entropy "
              "against its next-token distribution, over two unrolled draft steps."),
        params=report["parameters"], size=folder_bytes(path) / 2**20,
        windows=args.eval_windows, by_step="" if draft else " by draft step",
        agree=", ".join(f"{a:.3f}" for a in agree or []) or "not measured",
        length=report.get("expected_mean_accepted_length_k4") or 1.0)
    with open(os.path.join(path, "README.md"), "w") as f:
        f.write(text)


def _finish(path: str, report: dict[str, Any], args: argparse.Namespace) -> None:
    with open(os.path.join(path, "metrics.json"), "w") as f:
        json.dump(report, f, indent=2)
    write_card(path, report, args)
    for name in os.listdir(path):
        os.chmod(os.path.join(path, name), 0o644)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    data = load_data(args)
    target = load_target(args)
    facts = {"target": os.path.basename(os.path.normpath(args.target)), "device":
             torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
             "args": {k: v for k, v in vars(args).items()
                      if k not in ("out_draft", "out_eagle", "target")}}
    shipped = []
    if "draft" in args.what:
        draft = make_draft(args, target)
        run = train("draft", draft, lambda t: draft_loss(draft, target, t), data, args)
        agree = evaluate(lambda t: draft_loss(draft, target, t), data, args)
        report = {**facts, "kind": "draft_model",
                  "parameters": sum(p.numel() for p in draft.parameters()),
                  "training": run, "heldout_top1_agreement": agree,
                  "expected_mean_accepted_length_k4": expected_length(agree) if agree else None}
        save_draft(draft, args, report)
        shipped.append(args.out_draft)
        log.info("draft: held-out agreement %s -> ~%.2f tokens per verification (k=%d)", agree,
                 report["expected_mean_accepted_length_k4"] or 0, K)
    if "eagle" in args.what:
        if args.eagle_version == 3:
            ids = eagle3_head.draft_vocabulary(data["train"], target.config.vocab_size,
                                               args.eagle_draft_vocab).to(args.device)
            aux = eagle3_head.default_aux_layers(target.config.num_hidden_layers)
            head = eagle3_head.Eagle3Head(target, args.eagle_intermediate_size, ids,
                                          aux).to(args.device)
            covered = torch.isin(data["heldout"].long(), ids).float().mean().item()
            log.info("eagle-3: draft vocabulary of %d tokens covers %.1f%% of held-out tokens",
                     len(ids), 100 * covered)

            def loss_fn(t: torch.Tensor) -> Any:
                return eagle3_head.eagle3_losses(head, target, t, args.eagle_ttt_steps)
            exported = head.export(target.config.vocab_size)
        else:
            head = EagleHead(target, args.eagle_intermediate_size).to(args.device)

            def loss_fn(t: torch.Tensor) -> Any:
                return eagle_losses(head, target, t)
            exported = head.export()
            covered = 1.0
        run = train("eagle", head, loss_fn, data, args)
        agree = evaluate(loss_fn, data, args)
        report = {**facts, "kind": "eagle", "eagle_version": args.eagle_version,
                  "draft_vocab_heldout_coverage": covered,
                  "parameters": sum(p.numel() for k, p in exported.items()
                                    if p.is_floating_point()),
                  "training": run, "heldout_top1_agreement_by_step": agree,
                  "expected_mean_accepted_length_k4": expected_length(agree) if agree else None}
        save_eagle(head, target, args, report)
        shipped.append(args.out_eagle)
        log.info("eagle: held-out agreement by step %s -> ~%.2f tokens per verification (k=%d)",
                 agree, report["expected_mean_accepted_length_k4"] or 0, K)
    total = sum(folder_bytes(p) for p in shipped)
    log.info("shipped weights: %.2f MB (%s; budget %.0f MB)", total / 2**20,
             ", ".join(f"{p}: {folder_bytes(p) / 2**20:.2f} MB" for p in shipped),
             BUDGET_BYTES / 2**20)
    if total > BUDGET_BYTES:
        log.warning("over the %.0f MB budget: shrink --draft-* or --eagle-intermediate-size",
                    BUDGET_BYTES / 2**20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
