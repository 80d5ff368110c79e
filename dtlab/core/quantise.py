"""Quantised communication: a flat tensor as bytes in fp32, bf16, int8 or fp8, with per-block scales.

What ZeRO++ (qwZ, qgZ) and Float8-with-FSDP send instead of fp32: each block of ``block`` consecutive
elements is scaled by its own largest magnitude, so that one outlier costs precision only in its block.

* ``int8``: ``round(x / s)`` with ``s = max|x| / 127`` per block, one float32 scale per block.
* ``fp8``: ``x / s`` rounded to ``float8_e4m3fn`` (4 exponent bits, 3 mantissa bits, largest 448) with
  ``s = max|x| / 448`` per block; its bits travel as bytes, since no backend reduces fp8.
* ``bf16``: the top 16 bits of each float32 (no scale).
* ``fp32``: as is.

``encode`` turns a flat tensor into one uint8 buffer (payload, then the scales); ``decode`` is its inverse
(lossy but for fp32). Every rank decodes the same bytes the same way, so ranks that sum the same decoded
pieces in the same order hold identical results.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["COMM_DTYPES", "PAYLOAD_BYTES", "check_options", "decode", "encode", "encoded_bytes"]

COMM_DTYPES = ("fp32", "bf16", "int8", "fp8")
PAYLOAD_BYTES = {"fp32": 4, "bf16": 2, "int8": 1, "fp8": 1}  # per element, before the scales
_LARGEST = {"int8": 127.0, "fp8": 448.0}  # the largest magnitude each code represents
_SCALE_BYTES = 4  # one float32 per block


def check_options(options: Any, name: str, fields: tuple[str, ...], block: str | None = "comm_block") -> None:
    """A tier's codes knobs: ValueError naming the field unless each of ``fields`` is one of ``COMM_DTYPES`` and
    ``block`` (elements per scale) is a multiple of 4, at least 4."""
    for field in fields:
        if getattr(options, field) not in COMM_DTYPES:
            raise ValueError(f"{name}.{field}={getattr(options, field)!r} is invalid: choose one of "
                             f"{', '.join(COMM_DTYPES)}")
    if block is None:
        return
    size = getattr(options, block)
    if not isinstance(size, int) or isinstance(size, bool) or size < 4 or size % 4:
        raise ValueError(f"{name}.{block}={size!r} is invalid: elements per scale, a multiple of 4 (at least 4)")


def _scaled(dtype: str) -> bool:
    return dtype in _LARGEST


def _blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def encoded_bytes(numel: int, dtype: str, block: int = 128) -> int:
    """Bytes ``encode`` makes of ``numel`` elements: the payload (padded to whole blocks) and the scales."""
    if dtype not in COMM_DTYPES:
        raise ValueError(f"comm dtype {dtype!r} is not one of {', '.join(COMM_DTYPES)}")
    if not _scaled(dtype):
        return numel * PAYLOAD_BYTES[dtype]
    blocks = _blocks(numel, block)
    return blocks * block * PAYLOAD_BYTES[dtype] + blocks * _SCALE_BYTES


def encode(x: torch.Tensor, dtype: str, block: int = 128) -> torch.Tensor:
    """``x`` (any floating dtype, flattened) as a uint8 buffer of ``encoded_bytes(x.numel(), dtype, block)``."""
    flat = x.detach().reshape(-1)
    if dtype == "fp32":
        return flat.to(torch.float32).contiguous().view(torch.uint8)
    if dtype == "bf16":
        return flat.to(torch.bfloat16).contiguous().view(torch.uint8)
    values = flat.to(torch.float32)
    blocks = _blocks(values.numel(), block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=values.device)
    padded[: values.numel()] = values
    padded = padded.view(blocks, block)
    largest = padded.abs().amax(dim=1, keepdim=True)
    # an all-zero block keeps scale 1: zeros encode as zeros either way
    scales = torch.where(largest > 0, largest / _LARGEST[dtype], torch.ones_like(largest))
    scaled = padded / scales
    if dtype == "int8":
        payload = scaled.round().clamp(-127, 127).to(torch.int8).view(torch.uint8)
    else:
        payload = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([payload.reshape(-1), scales.reshape(-1).view(torch.uint8)])


def decode(buf: torch.Tensor, numel: int, dtype: str, block: int = 128,
           out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``numel`` values ``encode`` put into ``buf``, as ``out_dtype``."""
    if dtype == "fp32":
        return buf.view(torch.float32)[:numel].to(out_dtype)
    if dtype == "bf16":
        return buf.view(torch.bfloat16)[:numel].to(out_dtype)
    blocks = _blocks(numel, block)
    payload, scales = buf[: blocks * block], buf[blocks * block: blocks * block + blocks * _SCALE_BYTES]
    code = torch.int8 if dtype == "int8" else torch.float8_e4m3fn
    values = payload.view(code).to(torch.float32).view(blocks, block) * scales.view(torch.float32).view(blocks, 1)
    return values.reshape(-1)[:numel].to(out_dtype)
