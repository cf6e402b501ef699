"""Checkpoint tensors as layers receive them: lazily read, so a tensor-parallel rank reads only its slice.

The loader yields ``CheckpointTensor``\\ s (a tensor in a safetensors file, read when asked and only as much as
asked); code that needs the whole tensor calls ``materialize``, parallel layers ``narrow`` their shard. Both also
take plain tensors, so tests and converters can feed state dicts directly.
"""
from __future__ import annotations

import torch


class WeightLoadError(ValueError):
    """A checkpoint that does not fit the model: a missing, foreign, misshapen or unreadable tensor."""


# safetensors dtype names -> torch dtypes
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}


class CheckpointTensor:
    """One tensor of an open safetensors file. Holds the file handle, so it stays readable as long as it lives."""

    def __init__(self, handle, name: str, file_name: str) -> None:
        self._handle = handle
        self.name = name
        self.file_name = file_name
        self._slice = handle.get_slice(name)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._slice.get_shape())

    @property
    def dtype(self) -> torch.dtype:
        code = self._slice.get_dtype()
        if code not in _DTYPES:
            raise ValueError(f"tensor {self.name!r} in {self.file_name}: unsupported dtype {code}")
        return _DTYPES[code]

    def dim(self) -> int:
        return len(self.shape)

    def load(self) -> torch.Tensor:
        try:
            return self._handle.get_tensor(self.name)
        except Exception as e:  # safetensors raises its own error types
            raise WeightLoadError(f"cannot read tensor {self.name!r} from {self.file_name}: {e} "
                                  "(file truncated or corrupt?)") from None

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * self.dim()
        index[dim] = slice(start, start + length)
        try:
            return self._slice[tuple(index)]
        except Exception as e:
            raise WeightLoadError(f"cannot read a slice of tensor {self.name!r} from {self.file_name}: {e} "
                                  "(file truncated or corrupt?)") from None

    def __repr__(self) -> str:
        return f"CheckpointTensor({self.name!r}, {tuple(self.shape)}, {self.dtype})"


def materialize(t: torch.Tensor | CheckpointTensor) -> torch.Tensor:
    return t.load() if isinstance(t, CheckpointTensor) else t


def narrow(t: torch.Tensor | CheckpointTensor, dim: int, start: int, length: int) -> torch.Tensor:
    """``t.narrow(dim, start, length)``, reading only that part from the file for a ``CheckpointTensor``."""
    return t.narrow(dim, start, length)
