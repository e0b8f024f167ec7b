"""Tiny quantized checkpoints made by the tools users quantize with (issue 32, item 4).

Run with a side virtual environment's python (the tools cannot share the main one: gptqmodel
7.6 wants transformers >= 5.20, llm-compressor 0.14 pins transformers <= 5.17; .ci/leg_quant_tools.sh
builds both venvs), the checkout on PYTHONPATH:

    python tests/quantization/tool_checkpoints.py gptqmodel OUT
    python tests/quantization/tool_checkpoints.py llmcompressor OUT

Each writes OUT/float (the float32 source: a random Llama with transformers' LlamaConfig; both
tools start from the same seed, so the same weights) and OUT/<case> per case in CASES[tool]. For
GPTQ and AWQ, which transformers cannot run on this CPU machine, OUT/<case>-dequant is the
checkpoint's float32 twin: every linear dequantized by the tool's own code (gptqmodel's
TorchLinear.dequantize_weight for GPTQ, its AutoAWQ port dequantize_gemm for AWQ), every other
tensor the quantized checkpoint's own, upcast. OUT/<tool>.json records the tool's versions and
the cases written; test_tool_checkpoints.py (main venv) reads it. Calibration is a few random
token-id rows built in-process: no dataset is downloaded.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import sys
from importlib.metadata import version
from typing import Any, Callable

logger = logging.getLogger("tool_checkpoints")

# the float source: hidden 128 (AWQ's clip search batches output channels by 64, llm-compressor's
# W8A16 preset groups inputs by 128), 2 KV heads of 32 channels, intermediate 256 (2 groups of
# 128 in down_proj), vocab 259 (the byte tokenizer)
FLOAT_SHAPE = dict(hidden_size=128, intermediate_size=256)
CALIB_ROWS, CALIB_LEN = 8, 64

# case -> what it is; GPTQ cases: (bits, group_size, sym, desc_act)
GPTQ_CASES: dict[str, tuple[int, int, bool, bool]] = {
    "gptq-4bit-g32-sym": (4, 32, True, False),
    "gptq-4bit-g32-asym": (4, 32, False, False),
    "gptq-4bit-g32-sym-desc_act": (4, 32, True, True),
    "gptq-4bit-g32-asym-desc_act": (4, 32, False, True),
    "gptq-8bit-g32-sym": (8, 32, True, False),
}
# AWQ GEMM (AutoAWQ's layout): zero point on (AutoAWQ's default) and off
AWQ_CASES: dict[str, tuple[int, bool]] = {"awq-4bit-g32-zp": (32, False),
                                          "awq-4bit-g64-sym": (64, True)}
# compressed-tensors: (llm-compressor modifier, preset name or a scheme override)
CT_CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # per-channel FP8 weights, dynamic per-token FP8 activations (the preset)
    "ct-fp8-dynamic": ("QuantizationModifier", "FP8_DYNAMIC", {}),
    # per-tensor FP8 weight scale, dynamic per-token activations
    "ct-fp8-tensor-dynamic": ("QuantizationModifier", "FP8_DYNAMIC", {"strategy": "tensor"}),
    "ct-w8a16": ("GPTQModifier", "W8A16", {}),  # int8 groups of 128, symmetric
    "ct-w4a16-g32": ("GPTQModifier", "W4A16", {"group_size": 32}),
    "ct-w4a16-asym-g32": ("QuantizationModifier", "W4A16_ASYM", {"group_size": 32}),
}
CASES = {"gptqmodel": [*GPTQ_CASES, *AWQ_CASES], "llmcompressor": list(CT_CASES)}
TOOL_PACKAGES = {"gptqmodel": ("gptqmodel", "torch", "transformers"),
                 "llmcompressor": ("llmcompressor", "compressed-tensors", "torch", "transformers")}


def calibration_ids() -> list[list[int]]:
    """CALIB_ROWS rows of CALIB_LEN token ids (3..258: the byte tokenizer's non-special ids)."""
    rng = random.Random(0)
    return [[rng.randint(3, 258) for _ in range(CALIB_LEN)] for _ in range(CALIB_ROWS)]


def float_source(out: str) -> str:
    from pagedllm.testing.checkpoints import make_checkpoint

    path = os.path.join(out, "float")
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        make_checkpoint(path, "llama", **FLOAT_SHAPE)
    return path


def copy_tokenizer(src: str, dst: str) -> None:
    """The tokenizer files and generation_config.json (without it transformers' generate stops
    at config.json's eos_token_id)."""
    for f in os.listdir(src):
        if f.startswith("tokenizer") or f in ("chat_template.jinja", "generation_config.json"):
            shutil.copy(os.path.join(src, f), os.path.join(dst, f))


def write_twin(qpath: str, dst: str, dequantized: dict[str, Any]) -> None:
    """``qpath``'s checkpoint as float32 with its quantized linears replaced by ``dequantized``
    ({"<module>.weight": [out, in] float32}) and quantization_config removed."""
    import torch
    from safetensors.torch import load_file, save_file

    prefixes = {name[:-len(".weight")] for name in dequantized}
    state = load_file(os.path.join(qpath, "model.safetensors"))
    twin = {k: v.float() for k, v in state.items() if k.rsplit(".", 1)[0] not in prefixes}
    missing = [k for k in dequantized if not any(s.startswith(k[:-len("weight")]) for s in state)]
    if missing:
        raise RuntimeError(f"{qpath}: no quantized tensors for {missing[:3]}")
    twin.update({k: v.to(torch.float32).contiguous() for k, v in dequantized.items()})
    os.makedirs(dst, exist_ok=True)
    save_file(twin, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(qpath, "config.json")) as fh:
        cfg = json.load(fh)
    cfg.pop("quantization_config", None)
    cfg["dtype"] = "float32"
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2)
    copy_tokenizer(qpath, dst)


def gptq_case(src: str, dst: str, bits: int, group_size: int, sym: bool, desc_act: bool) -> None:
    import torch
    from gptqmodel import BACKEND, GPTQModel, QuantizeConfig
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear

    cfg = QuantizeConfig(bits=bits, group_size=group_size, sym=sym, desc_act=desc_act)
    model = GPTQModel.load(src, cfg, device="cpu")
    calib = [{"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids),
                                                                          dtype=torch.long)}
             for ids in calibration_ids()]
    model.quantize(calib, batch_size=1)
    model.save(dst)
    del model
    # the twin: the saved checkpoint read back by gptqmodel's torch kernel, dequantized by it
    # (loaded as float16, the dtype of the stored scales, then the scales upcast: the kernel
    # dequantizes in the scales' dtype, and float16/bfloat16 products would round the twin)
    loaded = GPTQModel.load(dst, backend=BACKEND.TORCH, device="cpu", dtype=torch.float16)
    deq = {}
    for name, mod in loaded.model.named_modules():
        if isinstance(mod, TorchLinear):
            mod.scales = mod.scales.float()
            deq[name + ".weight"] = mod.dequantize_weight().T.float()  # [out, in]
    write_twin(dst, dst + "-dequant", deq)


def awq_case(src: str, dst: str, group_size: int, sym: bool) -> None:
    import torch
    from gptqmodel import BACKEND, GPTQModel, QuantizeConfig
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm
    from safetensors.torch import load_file

    cfg = QuantizeConfig(bits=4, group_size=group_size, sym=sym, quant_method="awq",
                         format="gemm")
    model = GPTQModel.load(src, cfg, device="cpu")
    calib = [{"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids),
                                                                          dtype=torch.long)}
             for ids in calibration_ids()]
    # the default kernel choice wants CUDA; AWQ_TORCH quantizes and packs on the CPU
    model.quantize(calib, batch_size=1, backend=BACKEND.AWQ_TORCH)
    model.save(dst)
    del model
    state = load_file(os.path.join(dst, "model.safetensors"))
    deq = {}
    for name in state:
        if name.endswith(".qweight"):
            p = name[:-len(".qweight")]
            # [in, out] in float32 from AutoAWQ's own unpacking (gptqmodel's port)
            w = dequantize_gemm(state[name], state[p + ".qzeros"], state[p + ".scales"].float(),
                                4, group_size)
            deq[p + ".weight"] = w.T
    write_twin(dst, dst + "-dequant", deq)


def ct_case(src: str, dst: str, modifier: str, preset: str, override: dict[str, Any]) -> None:
    import torch
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers import quantization as mods
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    for key, value in override.items():
        setattr(scheme.weights, key, value)
    recipe = getattr(mods, modifier)(config_groups={"group_0": scheme}, ignore=["lm_head"])
    ids = calibration_ids()
    ds = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(r) for r in ids]})
    oneshot(model=model, recipe=recipe, dataset=ds, num_calibration_samples=len(ids),
            max_seq_length=CALIB_LEN)
    # the twin: each linear through compressed-tensors' own fake_quantize with the calibrated
    # scales / zero points (weights only: dynamic activation quantization is not in it)
    deq = {}
    with torch.no_grad():
        for name, mod in model.named_modules():
            if hasattr(mod, "weight_scale") and hasattr(mod, "quantization_scheme"):
                deq[name + ".weight"] = fake_quantize(
                    mod.weight, mod.weight_scale, getattr(mod, "weight_zero_point", None),
                    mod.quantization_scheme.weights).float()
    model.save_pretrained(dst, save_compressed=True)
    copy_tokenizer(src, dst)
    write_twin(dst, dst + "-dequant", deq)


def run(tool: str, out: str, only: list[str] | None = None) -> None:
    os.makedirs(out, exist_ok=True)
    src = float_source(out)
    jobs: dict[str, Callable[[str], None]] = {}
    if tool == "gptqmodel":
        jobs.update({c: (lambda d, a=a: gptq_case(src, d, *a)) for c, a in GPTQ_CASES.items()})
        jobs.update({c: (lambda d, a=a: awq_case(src, d, *a)) for c, a in AWQ_CASES.items()})
    else:
        jobs.update({c: (lambda d, a=a: ct_case(src, d, *a)) for c, a in CT_CASES.items()})
    written = []
    for case, job in jobs.items():
        if only and case not in only:
            continue
        logger.info("%s: writing %s", tool, case)
        job(os.path.join(out, case))
        written.append(case)
    path = os.path.join(out, f"{tool}.json")
    if only and os.path.exists(path):  # a partial rerun keeps the cases written before
        with open(path) as fh:
            written = sorted(set(json.load(fh)["cases"]) | set(written))
    manifest = {"tool": tool, "cases": written,
                "versions": {p: version(p) for p in TOOL_PACKAGES[tool]}}
    with open(path, "w") as fh:
        json.dump(manifest, fh, indent=2)
    logger.info("%s: wrote %s (%s)", tool, written, manifest["versions"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("tool", choices=sorted(CASES))
    parser.add_argument("out", help="folder to write the checkpoints into")
    parser.add_argument("--only", nargs="*", help="cases to write (default: all of the tool's)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stdout)
    bad = sorted(set(args.only or []) - set(CASES[args.tool]))
    if bad:
        parser.error(f"--only: unknown cases {bad} for {args.tool}; allowed: {CASES[args.tool]}")
    run(args.tool, args.out, args.only)


if __name__ == "__main__":
    main()
