"""LoRA (plugin API 2.2, ``Capabilities.lora``): the op table's ``lora_shrink`` / ``lora_expand``
against the float64 reference over ranks, slot counts, stacked slices and batches mixing base
tokens with several adapters (also given the device slot map alone, as a captured graph runs
them); and through ``LLM(..., enable_lora=True)`` a batch mixing two PEFT-format adapters and
the base model gives Hugging Face's greedy tokens on checkpoints with each adapter merged into
the weights (W + scaling * B A), float32. Checked only where the backend declares ``lora``."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from pagedllm.contract.backend import Backend
from pagedllm.contract.capabilities import Capabilities
from pagedllm.contract.lora import NO_LORA, LoRAMapping
from pagedllm.reference import lora as reference
from pagedllm.reference.ops import Ops
from pagedllm.testing.e2e import engine_greedy, first_mismatch, hf_greedy, prompts

AREA = "LoRA"
pytestmark = pytest.mark.capability("lora")
CAPABILITY_OF = {"test_lora_ops": "LoRA shrink/expand",
                 "test_lora_ops_from_the_device_map": "LoRA shrink/expand (graph-safe)",
                 "test_lora_end_to_end": "LoRA (HF equality)"}
# tolerance against float64, relative to the largest output (docs/porting.md's op tolerances)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 4e-3}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SLICES = {"one": (0, 96), "qkv": (0, 64, 80, 96)}  # stacked outputs (rows of each slice)


def _ops(backend: Backend) -> Ops:
    ops = Ops()
    backend.register_ops(ops)
    return ops


def _case(rank: int, num_slots: int, slices: tuple[int, ...], rng: torch.Generator,
          tokens: int = 37, k: int = 200) -> tuple:
    """Inputs in float64: x, lora_a, lora_b, scales, y and each token's slot: every slot used,
    some tokens without an adapter, slot 0 holding a lower-rank adapter (zeros past its rank)."""
    n = len(slices) - 1
    x = torch.randn(tokens, k, generator=rng, dtype=torch.float64)
    a = torch.randn(num_slots, n * rank, k, generator=rng, dtype=torch.float64) / k ** 0.5
    b = torch.randn(num_slots, slices[-1], rank, generator=rng, dtype=torch.float64) / rank ** 0.5
    if rank > 1:
        low = max(1, rank // 2)
        a[0].view(n, rank, k)[:, low:] = 0
        b[0, :, low:] = 0
    scales = torch.rand(num_slots, n, generator=rng, dtype=torch.float64).float() + 0.5
    y = torch.randn(tokens, slices[-1], generator=rng, dtype=torch.float64)
    slots = [t % (num_slots + 1) - 1 for t in range(tokens)]  # -1, 0, 1, ...: base tokens too
    perm = torch.randperm(tokens, generator=rng).tolist()
    slots = [slots[i] for i in perm]
    return x, a, b, scales, y, slots


def _check(backend: Backend, device: torch.device, dtype: torch.dtype, case: tuple,
           slices: tuple[int, ...], with_host: bool) -> None:
    x, a, b, scales, y, slots = case
    host = LoRAMapping(torch.tensor(slots, dtype=torch.int32), list(slots))
    want_h = reference.lora_shrink(x, a, host)
    want = y.clone()
    reference.lora_expand(want, want_h, b, scales.double(), host, slices)
    ops = _ops(backend)
    token_slots = torch.tensor(slots, dtype=torch.int32, device=device)
    mapping = LoRAMapping(token_slots, list(slots) if with_host else None)
    got_h = ops.lora_shrink(x.to(dtype).to(device), a.to(dtype).to(device), mapping)
    got = y.to(dtype).to(device)
    ops.lora_expand(got, got_h, b.to(dtype).to(device), scales.to(device), mapping, slices)
    assert got_h.shape == want_h.shape and got_h.dtype == dtype, \
        f"lora_shrink returned {tuple(got_h.shape)} {got_h.dtype}, expected {tuple(want_h.shape)} {dtype}"
    tol = TOLERANCE[dtype]
    base = [t for t, s in enumerate(slots) if s == NO_LORA]
    assert torch.equal(got.cpu()[base], y.to(dtype)[base]), \
        "lora_expand changed the outputs of tokens without an adapter (slot -1)"
    for name, g, w in (("lora_shrink", got_h, want_h), ("lora_expand", got, want)):
        err = float((g.cpu().double() - w).abs().max())
        limit = tol * float(w.abs().max()) + tol
        assert err <= limit, f"{name}: max error {err:.3g} > {limit:.3g} against float64"


@pytest.mark.parametrize("slices", list(SLICES))
@pytest.mark.parametrize("num_slots", [1, 4, 8])
@pytest.mark.parametrize("rank", [1, 8, 16, 64])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_lora_ops(conformance_backend: Backend, conformance_caps: Capabilities,
                  conformance_device: torch.device, conformance_rng: torch.Generator,
                  dtype: str, rank: int, num_slots: int, slices: str) -> None:
    """Shrink then expand over a batch mixing every slot and base tokens, in each declared
    dtype."""
    if dtype not in conformance_caps.dtypes:
        pytest.skip(f"dtype {dtype} not declared by {conformance_backend.name}")
    case = _case(rank, num_slots, SLICES[slices], conformance_rng)
    _check(conformance_backend, conformance_device, DTYPES[dtype], case, SLICES[slices], True)


@pytest.mark.parametrize("rank", [8, 16])
def test_lora_ops_from_the_device_map(conformance_backend: Backend,
                                      conformance_device: torch.device,
                                      conformance_rng: torch.Generator, rank: int) -> None:
    """Given only the device's token -> slot map (no host copy: how a captured graph runs the
    ops), the results are the same."""
    case = _case(rank, 4, SLICES["qkv"], conformance_rng)
    _check(conformance_backend, conformance_device, torch.float32, case, SLICES["qkv"], False)


# --- end to end -----------------------------------------------------------------------------
TARGETS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
           "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapter(base: str, out: str, merged: str, rank: int, alpha: float,
                  seed: int) -> None:
    """A PEFT-format adapter on every attention and MLP linear of ``base`` (adapter_config.json
    + adapter_model.safetensors) at ``out``, and ``base`` with it merged into the weights at
    ``merged``: W + (alpha / rank) * B A, computed in float64."""
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name in sorted(os.listdir(base)):
        if name.endswith(".safetensors"):
            weights.update(load_file(os.path.join(base, name)))
    tensors, modules = {}, set()
    for name in list(weights):
        parts = name.split(".")  # model.layers.N.<block>.<proj>.weight
        if len(parts) != 6 or parts[3] not in TARGETS or parts[4] not in TARGETS[parts[3]]:
            continue
        module = name[:-len(".weight")]
        w = weights[name].double()
        a = torch.randn(rank, w.shape[1], generator=gen, dtype=torch.float64) / w.shape[1] ** .5
        b = torch.randn(w.shape[0], rank, generator=gen, dtype=torch.float64) * 0.5
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.float().contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.float().contiguous()
        weights[name] = (w + (alpha / rank) * (b.float().double() @ a.float().double())).float()
        modules.add(parts[4])
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"))
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "bias": "none",
                   "target_modules": sorted(modules), "task_type": "CAUSAL_LM"}, f)
    shutil.copytree(base, merged, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({k: v.contiguous() for k, v in weights.items()},
              os.path.join(merged, "model.safetensors"), metadata={"format": "pt"})


def test_lora_end_to_end(conformance_backend: Backend, conformance_caps: Capabilities,
                         conformance_checkpoint: str, conformance_hf_reference: tuple,
                         tmp_path_factory: pytest.TempPathFactory) -> None:
    """Two adapters and the base model in one batch, one device slot each (max_loras=2)."""
    from pagedllm import LLM, LoRARequest

    stand_in = getattr(type(conformance_backend), "conformance_kernels_only", None)
    if stand_in:  # as sample.engine_skip does for whole NEEDS_ENGINE modules
        pytest.skip(f"engine-level check not run for this kernel-level backend: {stand_in}")

    ps, want_base = conformance_hf_reference
    root = tmp_path_factory.mktemp("conformance-lora")
    requests, wants = [], []
    for i, (rank, alpha) in enumerate(((8, 16.0), (16, 8.0))):
        adapter, merged = str(root / f"adapter{i}"), str(root / f"merged{i}")
        write_adapter(conformance_checkpoint, adapter, merged, rank, alpha, seed=i)
        requests.append(LoRARequest(f"adapter{i}", i + 1, adapter))
        wants.append(hf_greedy(merged, ps))
    llm = LLM(conformance_checkpoint, device=conformance_backend.name, dtype="float32",
              block_size=conformance_caps.preferred_block_size, max_model_len=512,
              enforce_eager=True, enable_lora=True, max_loras=2, max_lora_rank=16)
    try:
        loras = [requests[0], requests[1], None] * len(ps)
        batch = [p for p in ps for _ in range(3)]
        got = llm.generate([{"prompt_token_ids": p} for p in batch],
                           _greedy_params(), lora_request=loras, use_tqdm=False)
        got = [list(o.outputs[0].token_ids) for o in got]
        for j, want in enumerate((wants[0], wants[1], want_base)):
            what = f"adapter{j}" if j < 2 else "the base model"
            mismatch = first_mismatch(got[j::3], want)
            assert not mismatch, f"{what}: {mismatch}"
    finally:
        llm.shutdown()


def _greedy_params():
    from pagedllm import SamplingParams
    from pagedllm.testing.e2e import MAX_TOKENS

    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


__all__ = ["engine_greedy", "prompts", "write_adapter"]
