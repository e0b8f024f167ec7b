"""The csrc/ launchers compiled for the CPU with the SIMT emulator (simt_emu/), behind the same
Python signatures as pagedllm.backends.cuda.ops, on CPU tensors.

This runs the real kernel source (indexing, masking, shuffles, barriers) without a GPU; it does not
run torch_bindings.cpp, so argument checking is not covered here (the CUDA tests cover it).
Built with g++ on first use into $PAGEDLLM_CACHE_DIR/emu or ~/.cache/pagedllm/emu (~20 s).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import torch

_HERE = Path(__file__).resolve().parent
_EMU_DIR = _HERE / "simt_emu"
_CSRC = _HERE.parents[1] / "csrc"
_UNITS = (_CSRC / "paged_attention.cu", _CSRC / "cache_kernels.cu", _CSRC / "layer_kernels.cu",
          _EMU_DIR / "emu_entry.cpp")
_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_lib: ctypes.CDLL | None = None


def emulator_available() -> tuple[bool, str]:
    if shutil.which("g++") is None:
        return False, "g++ not found"
    if not _CSRC.is_dir():
        return False, f"{_CSRC} not found"
    return True, ""


def _build() -> ctypes.CDLL:
    files = sorted(list(_UNITS) + list(_CSRC.glob("*.h")) + list(_CSRC.glob("*.cuh")) + [_EMU_DIR / "simt_emu.h"])
    digest = hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in files)).hexdigest()[:16]
    root = Path(os.environ.get("PAGEDLLM_CACHE_DIR") or Path.home() / ".cache" / "pagedllm") / "emu"
    lib_path = root / f"pagedllm_emu_{digest}.so"
    if not lib_path.exists():
        root.mkdir(parents=True, exist_ok=True)
        flags = ["g++", "-std=c++17", "-O1", "-fPIC", "-Wall", "-Wno-unknown-pragmas",
                 "-include", str(_EMU_DIR / "simt_emu.h"), f"-I{_CSRC}", "-x", "c++", "-c"]

        def compile_unit(src: Path) -> Path:
            obj = root / f"{src.stem}_{digest}_{os.getpid()}.o"
            subprocess.run(flags + [str(src), "-o", str(obj)], check=True, capture_output=True, text=True)
            return obj

        with ThreadPoolExecutor(max_workers=len(_UNITS)) as pool:
            objs = list(pool.map(compile_unit, _UNITS))
        tmp = lib_path.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run(["g++", "-shared", "-o", str(tmp)] + [str(o) for o in objs], check=True)
        tmp.replace(lib_path)
        for obj in objs:
            obj.unlink(missing_ok=True)
    lib = ctypes.CDLL(str(lib_path))
    lib.emu_last_error.restype = ctypes.c_char_p
    lib.emu_reset.argtypes = [ctypes.c_uint64]
    return lib


def _load() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        _lib = _build()
    return _lib


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(0 if t is None else t.data_ptr())


def _i64(*values: int) -> list[ctypes.c_int64]:
    return [ctypes.c_int64(int(v)) for v in values]


def _check(lib: ctypes.CDLL, rc: int, op: str) -> None:
    message = lib.emu_last_error().decode()
    if rc != 0 or message:
        raise RuntimeError(f"{op} (emulated) failed: rc={rc} {message}")


def reset(seed: int) -> None:
    _load().emu_reset(seed)


def paged_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, num_kv_heads: int, scale: float,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                    max_seq_len: int, partition_size: int | None = None,
                    num_warps: int = 0, sliding_window: int | None = None,
                    soft_cap: float | None = None) -> torch.Tensor:
    lib = _load()
    num_seqs, num_heads, head_size = query.shape
    if partition_size is None:
        partition_size = decode_partition_size(num_seqs, num_heads, num_kv_heads, max_seq_len)
    num_partitions = max(1, -(-max_seq_len // partition_size))
    tmp_out = exp_sums = max_logits = None
    if num_partitions > 1:
        tmp_out = torch.full((num_seqs, num_heads, num_partitions, head_size), float("nan"))
        exp_sums = torch.full((num_seqs, num_heads, num_partitions), float("nan"))
        max_logits = torch.full((num_seqs, num_heads, num_partitions), float("nan"))
    rc = lib.emu_paged_attention(
        ctypes.c_int(_DTYPES[query.dtype]), _ptr(out), *_i64(out.stride(0), out.stride(1)),
        _ptr(query), *_i64(query.stride(0), query.stride(1)),
        _ptr(key_cache), *_i64(*key_cache.stride()[:3]),
        _ptr(value_cache), *_i64(*value_cache.stride()[:3]),
        _ptr(block_tables), *_i64(block_tables.stride(0)), ctypes.c_int(block_tables.shape[1]),
        _ptr(seq_lens), _ptr(tmp_out), _ptr(exp_sums), _ptr(max_logits),
        *[ctypes.c_int(v) for v in (num_seqs, num_heads, num_kv_heads, head_size, block_size,
                                    key_cache.shape[0], max_seq_len, partition_size,
                                    num_warps)],
        ctypes.c_float(scale), ctypes.c_int(sliding_window or 0), ctypes.c_float(soft_cap or 0.0),
    )
    _check(lib, rc, "paged_attention")
    return out


def decode_partition_size(num_seqs: int, num_heads: int, num_kv_heads: int, max_seq_len: int) -> int:
    """csrc/ops.h paged_attention_partition_size (the rule the extension applies)."""
    return int(_load().emu_decode_partition_size(num_seqs, num_heads, num_kv_heads, max_seq_len))


def decode_narrow_blocks(grid_blocks: int, partition_size: int) -> bool:
    """csrc/ops.h paged_attention_narrow_blocks: whether a launch uses 2-warp thread blocks."""
    return bool(_load().emu_decode_narrow_blocks(ctypes.c_int64(grid_blocks),
                                                 ctypes.c_int(partition_size)))


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    lib = _load()
    num_tokens, num_kv_heads, head_size = key.shape
    rc = lib.emu_reshape_and_cache(
        ctypes.c_int(_DTYPES[key.dtype]), _ptr(key), *_i64(key.stride(0), key.stride(1)),
        _ptr(value), *_i64(value.stride(0), value.stride(1)),
        _ptr(key_cache), *_i64(*key_cache.stride()[:3]),
        _ptr(value_cache), *_i64(*value_cache.stride()[:3]),
        _ptr(slot_mapping), ctypes.c_int(num_tokens), ctypes.c_int(num_kv_heads),
        ctypes.c_int(head_size), ctypes.c_int(key_cache.shape[1]), *_i64(key_cache.shape[0]),
    )
    _check(lib, rc, "reshape_and_cache")


def copy_blocks(key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor],
                block_mapping: torch.Tensor) -> None:
    lib = _load()
    first = key_caches[0]
    key_ptrs = torch.tensor([t.data_ptr() for t in key_caches], dtype=torch.int64)
    value_ptrs = torch.tensor([t.data_ptr() for t in value_caches], dtype=torch.int64)
    alignment = 16
    for t in list(key_caches) + list(value_caches):
        while t.data_ptr() % alignment:
            alignment //= 2
    mapping = block_mapping.contiguous()
    rc = lib.emu_copy_blocks(
        _ptr(key_ptrs), _ptr(value_ptrs), _ptr(mapping), ctypes.c_int(len(key_caches)),
        *_i64(mapping.shape[0], first.stride(0) * first.element_size(),
              first[0].numel() * first.element_size(), first.shape[0], alignment),
    )
    _check(lib, rc, "copy_blocks")


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    lib = _load()
    mapping = block_mapping.contiguous()
    rc = lib.emu_swap_blocks(
        _ptr(src), _ptr(dst), *_i64(src.stride(0) * src.element_size(), dst.stride(0) * dst.element_size(),
                                    src[0].numel() * src.element_size()),
        _ptr(mapping), *_i64(mapping.shape[0]),
    )
    _check(lib, rc, "swap_blocks")


# ---- layer ops: outputs are allocated here (as the binding does), poisoned with NaN -------------


def _nan(*shape: int, like: torch.Tensor) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=like.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    lib = _load()
    num_tokens, hidden = x.shape
    out = _nan(num_tokens, hidden, like=x)
    new_residual = _nan(num_tokens, hidden, like=x) if residual is not None else x
    with_residual = residual is not None
    rc = lib.emu_rms_norm(
        ctypes.c_int(_DTYPES[x.dtype]), _ptr(out), _ptr(new_residual if with_residual else None),
        _ptr(x), *_i64(x.stride(0)), _ptr(residual), *_i64(residual.stride(0) if with_residual else 0),
        _ptr(weight), ctypes.c_int(num_tokens), ctypes.c_int(hidden), ctypes.c_float(eps),
    )
    _check(lib, rc, "rms_norm")
    return out, new_residual


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    lib = _load()
    num_tokens, num_heads, head_size = x.shape
    out = _nan(num_tokens, num_heads, head_size, like=x)
    rc = lib.emu_rotary(
        ctypes.c_int(_DTYPES[x.dtype]), _ptr(out), _ptr(x), *_i64(x.stride(0), x.stride(1)),
        _ptr(cos), *_i64(cos.stride(0)), _ptr(sin), *_i64(sin.stride(0)),
        ctypes.c_int(num_tokens), ctypes.c_int(num_heads), ctypes.c_int(head_size),
    )
    _check(lib, rc, "rotary")
    return out


def rotary_and_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     key_cache: torch.Tensor, value_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, num_heads: int) -> None:
    lib = _load()
    num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
    rc = lib.emu_rotary_and_cache(
        ctypes.c_int(_DTYPES[qkv.dtype]), _ptr(qkv), *_i64(qkv.stride(0)),
        _ptr(cos), *_i64(cos.stride(0)), _ptr(sin), *_i64(sin.stride(0)),
        _ptr(key_cache), *_i64(*key_cache.stride()[:3]),
        _ptr(value_cache), *_i64(*value_cache.stride()[:3]),
        _ptr(slot_mapping), *[ctypes.c_int(v) for v in (qkv.shape[0], num_heads, num_kv_heads,
                                                         head_size, block_size)],
        *_i64(num_blocks),
    )
    _check(lib, rc, "rotary_and_cache")


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    lib = _load()
    num_tokens, width = x.shape
    out = _nan(num_tokens, width // 2, like=x)
    rc = lib.emu_silu_and_mul(ctypes.c_int(_DTYPES[x.dtype]), _ptr(out), _ptr(x),
                              *_i64(x.stride(0)), ctypes.c_int(num_tokens), ctypes.c_int(width // 2))
    _check(lib, rc, "silu_and_mul")
    return out
