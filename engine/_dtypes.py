"""Mapping between torch dtypes and zarr v3 data types.

zarr has no bfloat16 (nor float8): such tensors are stored as their bit pattern in an unsigned
integer of the same width, and the true dtype is kept in the array's ``antifragile`` attribute.
Reading with plain zarr-python gives that bit pattern; ``torch.from_numpy(a).view(torch.bfloat16)``
recovers the values.
"""

from __future__ import annotations

import torch

from .errors import CheckpointCorruptError, CheckpointError

_NATIVE: dict[torch.dtype, str] = {
    torch.bool: "bool",
    torch.uint8: "uint8",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.complex64: "complex64",
    torch.complex128: "complex128",
}
_UINT_BY_SIZE = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}
_TORCH_BY_NAME: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (*_NATIVE, torch.bfloat16, torch.uint16, torch.uint32, torch.uint64)
}
# stored as their bit patterns too (MX scales, packed fp4, half-precision complex)
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
              "float8_e8m0fnu", "float4_e2m1fn_x2", "complex32"):
    if hasattr(torch, _name):
        _TORCH_BY_NAME[_name] = getattr(torch, _name)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The memory of a contiguous tensor as one flat uint8 view (writable in place, any dtype,
    bfloat16 included). Flattened as the memory lies, not with ``reshape(-1)``: the size-1
    dims of a contiguous tensor may have any stride, and reshape keeps one (a transposed row
    vector, strides (1, 5), flattens to stride 5; ``buffer[1::2][:1]`` to stride 2), which a
    view as bytes of a wider dtype refuses."""
    return tensor.as_strided((tensor.numel(),), (1,)).view(torch.uint8)


def check_dtype(dtype: torch.dtype, *, path: str) -> None:
    """Refuse, at the call, a dtype the engine cannot store (sub-byte ``int4``, ``uint1``...)."""
    if dtype_name(dtype) not in _TORCH_BY_NAME:
        raise CheckpointError(f"state path {path!r}: a tensor of dtype {dtype_name(dtype)} "
                              "cannot be stored (no byte-exact zarr data type for it)")


def dtype_name(dtype: torch.dtype) -> str:
    """The torch dtype's name as recorded in attributes: ``bfloat16``."""
    return str(dtype).removeprefix("torch.")


def zarr_data_type(dtype: torch.dtype) -> str:
    """The zarr v3 ``data_type`` a tensor of ``dtype`` is stored as."""
    if dtype in _NATIVE:
        return _NATIVE[dtype]
    size = dtype.itemsize
    if size not in _UINT_BY_SIZE:
        raise TypeError(f"unsupported dtype {dtype}")
    return _UINT_BY_SIZE[size]


def torch_dtype(name: object, *, where: str) -> torch.dtype:
    """Parse a recorded dtype name; anything unknown is corrupt metadata."""
    if not isinstance(name, str) or name not in _TORCH_BY_NAME:
        raise CheckpointCorruptError(f"{where}: unknown dtype {name!r}")
    return _TORCH_BY_NAME[name]


def fill_value(dtype: torch.dtype) -> object:
    """The zarr fill value (JSON) for the stored data type: zero of the right kind."""
    kind = zarr_data_type(dtype)
    if kind == "bool":
        return False
    if kind.startswith("complex"):
        return [0.0, 0.0]
    if kind.startswith("float"):
        return 0.0
    return 0
