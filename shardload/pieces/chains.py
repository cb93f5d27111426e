"""Running a chain of shard functions on one tensor, on the worker's device.

A chain is the steps of a parameter that is computed rather than read by its byte runs
(``readplan``: a step without a ``ranges`` rule, or more than one step): the stored tensor goes
in, each step's output is allocated with its declared shape and dtype, and the function fills it
(destination-passing style), given torch tensors, numpy arrays or cupy arrays as it registered.
"""

from __future__ import annotations

import importlib.util

import torch

from .. import dtypes
from ..errors import ShardloadError, annotate
from ..registry import ShardFunc, get_shard_func

__all__ = ["cupy_missing", "run_steps"]


def cupy_missing() -> str | None:
    """Why ``import cupy`` fails here, with what to install; None where it works. CuPy's wheel
    is named for the CUDA it is built for (``cupy-cuda12x``, ``cupy-cuda13x``): any of them
    gives the module ``cupy``, which is all shardload asks for.

    >>> cupy_missing() is None or "pip install cupy-cuda" in cupy_missing()
    True
    """
    if importlib.util.find_spec("cupy") is not None:
        return None
    major = (torch.version.cuda or "").split(".")[0]
    wheel = (
        f"cupy-cuda{major}x (this torch is built for CUDA {torch.version.cuda})"
        if major
        else "the cupy-cuda wheel of your CUDA (cupy-cuda12x, cupy-cuda13x)"
    )
    return f"cupy is not installed: pip install {wheel}"


def _as_array(tensor: torch.Tensor, kind: str):
    if kind == "torch":
        return tensor
    if kind == "numpy":
        return tensor.numpy()  # zero-copy; CPU only
    import cupy  # optional dependency, only for cupy shard functions

    return cupy.from_dlpack(tensor)


def _call(func: ShardFunc, x: torch.Tensor, extra: tuple, out: torch.Tensor) -> None:
    if func.array == "numpy" and x.device.type != "cpu":
        x = x.cpu()
    if func.array == "numpy" and out.device.type != "cpu":
        host = torch.empty_like(out, device="cpu")
        func.func(_as_array(x, "numpy"), *extra, _as_array(host, "numpy"))
        out.copy_(host)
        return
    if func.array == "cupy" and (x.device.type != "cuda" or out.device.type != "cuda"):
        raise ShardloadError(
            f"{func.name} takes cupy arrays, which need a CUDA device; "
            f"this worker's device is {out.device}"
        )
    func.func(_as_array(x, func.array), *extra, _as_array(out, func.array))


def run_steps(steps, x: torch.Tensor, name: str = "?") -> torch.Tensor:
    """Apply ``steps`` (``(func, out_shape, dtype, extra)`` each) to ``x``; the last output.

    >>> x = torch.arange(4)
    >>> run_steps([("shardload.split", (2, 2), "int64", (0,))], x).tolist()
    [[0, 1], [2, 3]]
    """
    for index, (func_name, out_shape, dtype, extra) in enumerate(steps):
        func = get_shard_func(func_name)
        out = torch.empty(tuple(out_shape), dtype=dtypes.to_torch(dtype), device=x.device)
        try:
            _call(func, x.contiguous(), tuple(extra), out)
        except Exception as exc:
            annotate(exc, f"parameter {name!r}, step {index} ({func_name})")
            raise
        x = out
    return x
