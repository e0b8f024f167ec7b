"""Tiny quantized checkpoints for the quantization tests of the main environment.

compressed-tensors ones are written by the compressed-tensors library itself (the format library
llm-compressor saves through; llm-compressor pins transformers<=5.17 and cannot be installed
beside transformers 5.25). GPTQ and AWQ ones are written here: neither gptqmodel (>= 7.7 needs
torch>=2.14.1, 7.6 transformers>=5.20 beside llm-compressor's <=5.17) nor autoawq installs in the
main environment; test_awq_packing.py checks this writer's AWQ packing against autoawq's own
packing code where autoawq is importable. The checkpoints the tools themselves write are
tool_checkpoints.py's (side venvs, .ci/leg_quant_tools.sh). Every quantized checkpoint here comes
with its dequantized float32 twin, the reference transformers runs.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from pagedllm.models.layers.quantization.awq import AWQ_ORDER
from pagedllm.models.layers.quantization.base import pack_int32
from pagedllm.models.layers.quantization.gptq import v1_zero_offset
from pagedllm.testing.checkpoints import byte_tokenizer, make_checkpoint

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_TOKENS = 12


def is_linear(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in LINEARS


def layer_input(name: str) -> str:
    """Linears fed the same activations (q/k/v; gate/up) share a key."""
    proj = name.split(".")[-2]
    kind = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "gate_proj": "mlp",
            "up_proj": "mlp"}.get(proj, proj)
    return name.rsplit(".", 2)[0].rsplit(".", 1)[0] + "." + kind


def float_checkpoint(path: str, **overrides: Any) -> str:
    return make_checkpoint(path, "llama", **overrides)


def _rewrite(src: str, dst: str, tensors: dict[str, torch.Tensor],
             quant_config: dict[str, Any] | None) -> str:
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if not f.endswith(".safetensors"):
            shutil.copy(os.path.join(src, f), os.path.join(dst, f))
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    cfg_path = os.path.join(dst, "config.json")
    with open(cfg_path) as fh:
        cfg = json.load(fh)
    if quant_config is None:
        cfg.pop("quantization_config", None)
    else:
        cfg["quantization_config"] = quant_config
    with open(cfg_path, "w") as fh:
        json.dump(cfg, fh, indent=2)
    return dst


def minmax_int(w: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor,
                                                                  torch.Tensor]:
    """w [out, n] of one group -> (codes [out, n] int, scale [out] fp16-valued, zero [out])."""
    maxq = (1 << bits) - 1
    if sym:
        amax = w.abs().amax(1).clamp(min=1e-8)
        scale = (2 * amax / maxq).half().float()
        zero = torch.full_like(scale, float((maxq + 1) // 2))
    else:
        lo, hi = w.amin(1).clamp(max=0), w.amax(1).clamp(min=0)
        scale = ((hi - lo).clamp(min=1e-8) / maxq).half().float()
        zero = torch.round(-lo / scale).clamp(0, maxq)
    codes = torch.clamp(torch.round(w / scale[:, None]) + zero[:, None], 0, maxq)
    return codes.to(torch.int64), scale, zero


def quantize_groups(w: torch.Tensor, bits: int, group_size: int, sym: bool,
                    g_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] -> codes [out, in], scales [out, G], zeros [out, G] (groups by g_idx)."""
    out, inp = w.shape
    groups = int(g_idx.max()) + 1
    codes = torch.zeros(out, inp, dtype=torch.int64)
    scales, zeros = torch.zeros(out, groups), torch.zeros(out, groups)
    for g in range(groups):
        cols = (g_idx == g).nonzero().squeeze(1)
        c, s, z = minmax_int(w[:, cols], bits, sym)
        codes[:, cols], scales[:, g], zeros[:, g] = c, s, z
    return codes, scales, zeros


def dequant(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
            g_idx: torch.Tensor) -> torch.Tensor:
    return (codes.float() - zeros[:, g_idx.long()]) * scales[:, g_idx.long()]


def gptq_checkpoint(src: str, dst: str, bits: int, group_size: int, sym: bool,
                    desc_act: bool) -> tuple[str, str]:
    """(GPTQ v1 checkpoint, its dequantized float32 twin) from the float checkpoint ``src``."""
    state = load_file(os.path.join(src, "model.safetensors"))
    qt, ft = {}, {}
    for name, w in state.items():
        if not is_linear(name):
            qt[name] = ft[name] = w
            continue
        out, inp = w.shape
        gs = group_size if group_size > 0 else inp
        if desc_act:  # act order: groups of a random column permutation, one per layer input
            perm = list(range(inp))  # (GPTQ orders by the input's Hessian: q/k/v share it)
            random.Random(f"{layer_input(name)}-{bits}").shuffle(perm)
            g_idx = torch.empty(inp, dtype=torch.int32)
            g_idx[torch.tensor(perm)] = torch.arange(inp, dtype=torch.int32) // gs
        else:
            g_idx = torch.arange(inp, dtype=torch.int32) // gs
        codes, scales, zeros = quantize_groups(w.float(), bits, gs, sym, g_idx)
        prefix = name[:-len(".weight")]
        qt[prefix + ".qweight"] = pack_int32(codes.t(), bits, dim=0)  # [in * bits / 32, out]
        words = pack_int32(zeros.t(), bits, dim=1).to(torch.int64)  # [G, out * bits / 32]
        words = (words - v1_zero_offset(bits)) & 0xFFFFFFFF  # v1: each zero stored minus one
        qt[prefix + ".qzeros"] = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
        qt[prefix + ".scales"] = scales.t().half()
        qt[prefix + ".g_idx"] = g_idx
        ft[name] = dequant(codes, scales, zeros, g_idx)
    qcfg = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act,
            "sym": sym, "checkpoint_format": "gptq"}
    return _rewrite(src, dst, qt, qcfg), _rewrite(src, dst + "-dequant", ft, None)


def awq_pack(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes [out, in], zeros/scales [out, G] -> AutoAWQ GEMM's qweight [in, out / 8],
    qzeros [G, out / 8] (int32, AWQ_ORDER interleave) and scales [G, out] fp16."""
    return (pack_int32(codes.t(), 4, dim=1, order=AWQ_ORDER),
            pack_int32(zeros.t().to(torch.int64), 4, dim=1, order=AWQ_ORDER),
            scales.t().half())


def awq_checkpoint(src: str, dst: str, group_size: int) -> tuple[str, str]:
    """(AutoAWQ GEMM checkpoint, its dequantized float32 twin) from ``src``."""
    state = load_file(os.path.join(src, "model.safetensors"))
    qt, ft = {}, {}
    for name, w in state.items():
        if not is_linear(name):
            qt[name] = ft[name] = w
            continue
        g_idx = torch.arange(w.shape[1], dtype=torch.int32) // group_size
        codes, scales, zeros = quantize_groups(w.float(), 4, group_size, False, g_idx)
        prefix = name[:-len(".weight")]
        qt[prefix + ".qweight"], qt[prefix + ".qzeros"], qt[prefix + ".scales"] = \
            awq_pack(codes, zeros, scales)
        ft[name] = dequant(codes, scales, zeros, g_idx)
    qcfg = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
            "version": "gemm"}
    return _rewrite(src, dst, qt, qcfg), _rewrite(src, dst + "-dequant", ft, None)


def fp8_dequant_checkpoint(src: str, dst: str) -> str:
    """``src`` with every linear weight rounded through per-channel e4m3 (what
    quantization="fp8" computes with), float32."""
    from pagedllm.models.layers.quantization.fp8 import quantize_fp8_per_channel

    state = load_file(os.path.join(src, "model.safetensors"))
    out = {}
    for name, w in state.items():
        if is_linear(name):
            values, scale = quantize_fp8_per_channel(w)
            w = values.float() * scale
        out[name] = w
    return _rewrite(src, dst, out, None)


def compressed_tensors_checkpoint(src: str, dst: str, scheme: Any) -> str:
    """``src`` quantized by the compressed-tensors library with ``scheme`` (a preset name or a
    QuantizationScheme), weight scales from min/max observers as llm-compressor's default.
    ``dst + "-dequant"`` gets the float32 twin (weights through the library's fake_quantize),
    for schemes transformers cannot load."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config, preset_name_to_scheme)
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    if not isinstance(scheme, QuantizationScheme):
        scheme = preset_name_to_scheme(scheme, ["Linear"])
        if scheme.weights.group_size:
            scheme.weights.group_size = 32
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme},
                                                        ignore=["lm_head"]))
    twin = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if not hasattr(module, "weight_scale"):
                continue
            args = module.quantization_scheme.weights
            w = module.weight.data
            if args.strategy == "group":
                wg = w.reshape(w.shape[0], -1, args.group_size)
                lo, hi = wg.amin(-1), wg.amax(-1)
            elif args.strategy == "channel":
                lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
            else:
                lo, hi = w.amin().reshape(1), w.amax().reshape(1)
            scale, zp = calculate_qparams(lo, hi, args)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zp.reshape(module.weight_zero_point.shape))
            zero = getattr(module, "weight_zero_point", None)
            twin[name + ".weight"] = fake_quantize(w, module.weight_scale, zero, args).clone()
    state = load_file(os.path.join(src, "model.safetensors"))
    _rewrite(src, dst + "-dequant", {k: twin.get(k, v) for k, v in state.items()}, None)
    fmt = "float-quantized" if scheme.weights.type == "float" else "pack-quantized"
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(dst)
    byte_tokenizer().save_pretrained(dst)
    return dst


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randint(3, 258) for _ in range(n)] for n in (5, 17, 33, 2)]


def hf_reference(path: str, ps: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    """transformers' greedy tokens and each chosen token's logprob (float32)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    # generate() fills unset fields from the checkpoint's generation_config.json: without this
    # its eos_token_id would stop a row that pagedllm (ignore_eos) continues
    model.generation_config.eos_token_id = None
    cfg = GenerationConfig(max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    tokens, logprobs = [], []
    with torch.no_grad():
        for p in ps:
            out = model.generate(torch.tensor([p]), generation_config=cfg, output_logits=True,
                                 return_dict_in_generate=True)
            toks = out.sequences[0, len(p):].tolist()
            lps = [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, toks)]
            tokens.append(toks)
            logprobs.append(lps)
    return tokens, logprobs


def assert_matches(path: str, reference: str, atol: float = 1e-3, **engine_kwargs: Any) -> None:
    """pagedllm on ``path`` vs transformers on ``reference``: greedy tokens equal, each chosen
    token's logprob within ``atol``."""
    from pagedllm import LLM, SamplingParams

    ps = prompts()
    exp_tokens, exp_lps = hf_reference(reference, ps)
    llm = LLM(path, device="cpu", dtype="float32", **engine_kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    got = [o.outputs[0].token_ids for o in outs]
    assert got == exp_tokens
    for out, lps in zip(outs, exp_lps):
        got_lps = [pos[t] for pos, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
        assert got_lps == pytest_approx(lps, atol), (got_lps, lps)


def pytest_approx(values: list[float], atol: float) -> Any:
    import pytest

    return pytest.approx(values, abs=atol)
