"""Parsing quantization_config: malformed or unsupported settings are refused naming the field;
forcing a method that disagrees with the checkpoint, or one the backend does not run, is
refused naming the method and the backends that run it."""
from __future__ import annotations

import types

import pytest
import torch

from pagedllm.models.layers.quantization import get_quantization_config, resolve_method
from pagedllm.models.layers.quantization.base import pack_int32, unpack_int32


def hf(qcfg: dict | None) -> types.SimpleNamespace:
    return types.SimpleNamespace(quantization_config=qcfg)


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}


@pytest.mark.parametrize("qcfg, field", [
    ({**GPTQ, "bits": 3}, "quantization_config.bits=3"),
    ({**GPTQ, "group_size": 0}, "quantization_config.group_size=0"),
    ({**GPTQ, "checkpoint_format": "marlin"}, "quantization_config.checkpoint_format='marlin'"),
    ({k: v for k, v in GPTQ.items() if k != "bits"}, "quantization_config.bits is missing"),
    ({**AWQ, "group_size": 96}, "quantization_config.group_size=96"),
    ({**AWQ, "version": "gemv"}, "quantization_config.version='gemv'"),
    ({**AWQ, "zero_point": "yes"}, "quantization_config.zero_point='yes'"),
    ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'"),
    ({"bits": 4}, "no quant_method"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme='static'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 2, "type": "int",
                                                       "strategy": "group", "group_size": 32}}}},
     "weights.num_bits=2"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                                       "strategy": "tensor"},
                    "input_activations": {"num_bits": 8, "type": "float",
                                          "strategy": "tensor", "dynamic": False}}}},
     "input_activations"),
    ({"quant_method": "compressed-tensors", "format": "sparse-24", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int",
                                                       "strategy": "channel"}}}},
     "format='sparse-24'"),
])
def test_bad_config_names_the_field(qcfg: dict, field: str) -> None:
    with pytest.raises(ValueError, match=None) as exc:
        get_quantization_config(hf(qcfg), None)
    assert field in str(exc.value)


def test_forced_method_must_match_checkpoint() -> None:
    assert resolve_method(hf(GPTQ), None) == "gptq"
    assert resolve_method(hf(None), "fp8") == "fp8"
    with pytest.raises(ValueError, match="quantization='awq' does not match.*'gptq'"):
        resolve_method(hf(GPTQ), "awq")
    with pytest.raises(ValueError, match="quantization='int3' is invalid"):
        resolve_method(hf(None), "int3")


def test_engine_arg_validated() -> None:
    from pagedllm.config import CacheConfig, ModelConfig

    with pytest.raises(ValueError, match="quantization='q4'"):
        ModelConfig(model="m", tokenizer="m", quantization="q4")
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'"):
        CacheConfig(cache_dtype="int8")
    assert CacheConfig(cache_dtype="fp8_e4m3").cache_dtype == "fp8"


def test_backend_refuses_undeclared_method(monkeypatch, tmp_path) -> None:
    """A backend that does not declare the method refuses it, naming the backends that do."""
    from dataclasses import replace

    from pagedllm.backends.cpu.backend import CpuBackend
    from pagedllm.engine.arg_utils import EngineArgs
    from quant_writers import float_checkpoint

    path = float_checkpoint(str(tmp_path / "f"))
    config = EngineArgs(model=path, device="cpu", quantization="fp8").create_engine_config()
    backend = CpuBackend()
    monkeypatch.setattr(CpuBackend, "capabilities",
                        replace(CpuBackend.capabilities, quantizations=("gptq",)))
    from pagedllm.engine.config_validation import validate_config

    with pytest.raises(ValueError, match=r"quantization='fp8' is not supported by the cpu backend; "
                                         r"backends that support it: .*"):
        backend.check_and_update_config(config)
        validate_config(config, backend)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("order", [None, (0, 2, 4, 6, 1, 3, 5, 7)])
def test_pack_roundtrip(bits: int, order) -> None:
    if order is not None and bits != 4:
        pytest.skip("the AWQ interleave is 4-bit")
    vals = torch.randint(0, 1 << bits, (6, 64), dtype=torch.int64)
    for dim in (0, 1):
        v = vals if dim == 1 else vals.t().contiguous()
        packed = pack_int32(v, bits, dim, order)
        assert packed.dtype == torch.int32
        assert torch.equal(unpack_int32(packed, bits, dim, order).long(), v)


def test_unpack_bit_order() -> None:
    """Field i of a word sits at bits [i * bits, (i + 1) * bits): 0x76543210 -> 0..7."""
    word = torch.tensor([[0x76543210]], dtype=torch.int64).to(torch.int32)
    assert unpack_int32(word, 4, dim=1).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    # AWQ: field i holds column AWQ_ORDER[i]
    assert unpack_int32(word, 4, dim=1, order=(0, 2, 4, 6, 1, 3, 5, 7)).tolist() == \
        [[0, 4, 1, 5, 2, 6, 3, 7]]


def test_awq_without_zero_point() -> None:
    """zero_point=False (GPTQModel's symmetric AWQ): qzeros are used where stored and the
    midpoint 8 where absent; with zero_point=True a missing qzeros is an error."""
    from pagedllm.models.layers.quantization.awq import AWQ_ORDER, AWQConfig

    codes = torch.randint(0, 16, (64, 16))  # [in, out]
    qweight = pack_int32(codes, 4, dim=1, order=AWQ_ORDER)
    scales = torch.rand(2, 16).half()  # 2 groups of 32
    cfg = AWQConfig.from_config({**AWQ, "group_size": 32, "zero_point": False})
    got = dict(cfg.convert([("m.qweight", qweight), ("m.scales", scales)]))
    assert torch.equal(got["m.quant.zero"], torch.full((16, 2), 8.0))
    assert torch.equal(got["m.weight"], codes.t().to(got["m.weight"].dtype))
    zeros = torch.randint(0, 16, (2, 16))
    qzeros = pack_int32(zeros, 4, dim=1, order=AWQ_ORDER)
    got = dict(cfg.convert([("m.qweight", qweight), ("m.qzeros", qzeros), ("m.scales", scales)]))
    assert torch.equal(got["m.quant.zero"], zeros.t().float())
    with pytest.raises(ValueError, match="qzeros"):
        dict(AWQConfig.from_config({**AWQ, "group_size": 32}).convert(
            [("m.qweight", qweight), ("m.scales", scales)]))
