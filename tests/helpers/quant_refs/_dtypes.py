"""Scale dtypes: numpy where numpy has the dtype, torch for bfloat16 and float8_e4m3fn."""

from __future__ import annotations

import numpy as np
import torch

_NUMPY = {"float16": np.float16, "float32": np.float32}
_TORCH = {"bfloat16": torch.bfloat16}


def dtype_name(dtype) -> str:
    """Normalise ``"bf16"``, ``torch.bfloat16``, ``np.float16``... to ``"bfloat16"``,
    ``"float16"``, ``"float32"``."""
    aliases = {
        "bf16": "bfloat16",
        "fp16": "float16",
        "half": "float16",
        "fp32": "float32",
        "float": "float32",
    }
    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    elif isinstance(dtype, str):
        name = aliases.get(dtype, dtype)
    else:
        name = np.dtype(dtype).name
    if name not in _NUMPY and name not in _TORCH:
        raise ValueError(f"unsupported scale dtype {dtype!r}")
    return name


def to_f32(x) -> np.ndarray:
    """Any numpy array or torch tensor (bf16, fp8 included) -> float32 numpy, exactly."""
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float32).cpu().numpy()
    return np.asarray(x).astype(np.float32)


def to_int(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def round_up_scale(s, dtype) -> tuple[object, np.ndarray]:
    """Round positive scales up to the nearest value representable in ``dtype``.

    Returns ``(stored, exact)``: the tensor to store (numpy, or torch for bfloat16) and its
    values as float64.  Rounding up (never down) keeps the quantization grid wide enough to cover
    the range the scale was computed from, so no code is clamped by more than half a step.
    """
    name = dtype_name(dtype)
    s = np.asarray(s, dtype=np.float64)
    if name in _NUMPY:
        t = _NUMPY[name]
        stored = s.astype(t)
        low = stored.astype(np.float64) < s
        stored = np.where(low, np.nextafter(stored, t(np.inf)), stored).astype(t)
        return stored, stored.astype(np.float64)
    t = torch.from_numpy(s).to(_TORCH[name])
    low = t.to(torch.float64) < torch.from_numpy(s)
    t = torch.where(low, torch.nextafter(t, torch.full_like(t, float("inf"))), t)
    return t, t.to(torch.float64).numpy()


def eps(dtype) -> float:
    name = dtype_name(dtype)
    if name in _NUMPY:
        return float(np.finfo(_NUMPY[name]).eps)
    return float(torch.finfo(_TORCH[name]).eps)
