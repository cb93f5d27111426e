"""Messages between a ProcessSession controller and its workers: JSON and raw bytes, no pickle.

A message is one JSON object (a frame), followed by one raw frame when it carries a tensor:
the JSON then holds ``{"tensor": {"dtype": ..., "shape": [...]}}`` and the raw frame the
tensor's bytes in C order. Frames go over ``multiprocessing.connection.Connection`` with its
byte methods (``send_bytes`` / ``recv_bytes``), which only frame bytes and never unpickle.
"""

from __future__ import annotations

import json
import math
from multiprocessing import BufferTooShort
from multiprocessing.connection import Connection
from typing import Any

import torch

from .. import dtypes, strict_json
from ..errors import ShardloadError


class ProtocolError(Exception):
    """A peer sent something that is not a valid message."""


class UnsendableError(ShardloadError, ValueError):
    """A message holds a value strict JSON cannot carry (NaN, an infinite float such as a plan's
    ``1e400``, an object): a ``ShardloadError`` with a readable message, never a raw
    ``ValueError`` from the json module. Also a ``ValueError``, as it was before."""


def send(conn: Connection, message: dict, tensor: torch.Tensor | None = None) -> None:
    """Send ``message`` (JSON-able) and, if given, ``tensor``'s bytes."""
    if tensor is not None:
        tensor = tensor.detach().to("cpu").contiguous()
        message = {
            **message,
            "tensor": {"dtype": dtypes.from_torch(tensor.dtype), "shape": list(tensor.shape)},
        }
    try:
        data = json.dumps(message, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        what = message.get("op") or "reply"
        raise UnsendableError(
            f"cannot send the {what!r} message to a worker process: it holds "
            f"a value strict JSON cannot carry ({exc}); only JSON values "
            "(finite numbers, no NaN or Infinity) and tensors travel between "
            "processes"
        ) from None
    conn.send_bytes(data)
    if tensor is not None:
        conn.send_bytes(_as_bytes(tensor))


def recv(conn: Connection) -> tuple[dict, torch.Tensor | None]:
    """Receive one message and its tensor (an owned CPU tensor), if it carries one."""
    try:
        message = strict_json.loads(conn.recv_bytes())
    except ValueError as exc:
        raise ProtocolError(f"malformed message: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolError("a message must be a JSON object")
    spec = message.pop("tensor", None)
    if spec is None:
        return message, None
    try:
        dtype = dtypes.canonical(spec["dtype"])
        shape = tuple(int(d) for d in spec["shape"])
        if any(d < 0 for d in shape):
            raise ValueError("negative dim")
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"bad tensor header {spec!r}: {exc}") from None
    nbytes = math.prod(shape) * dtypes.itemsize(dtype)
    out = torch.empty(shape, dtype=dtypes.to_torch(dtype))
    # Received straight into the tensor's memory; a frame longer than the header says is refused
    # by recv_bytes_into itself, a shorter one below.
    buffer = out.view(-1).view(torch.uint8).numpy() if nbytes else bytearray(1)
    try:
        got = conn.recv_bytes_into(buffer)
    except BufferTooShort:
        raise ProtocolError(f"tensor header says {nbytes} bytes, more arrived") from None
    if got != nbytes:
        raise ProtocolError(f"tensor header says {nbytes} bytes, {got} arrived")
    return message, out


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    if tensor.numel() == 0:
        return memoryview(b"")
    flat = tensor.reshape(-1).view(torch.uint8)
    return flat.numpy().data.cast("B")


def to_jsonable(value: Any) -> Any:
    """``value`` if it can travel as strict JSON; ``TypeError`` for a type JSON lacks,
    ``ValueError`` for NaN or Infinity (as ``json.dumps`` would raise them)."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise type(exc)(
            f"{type(value).__name__} value cannot be sent between processes: "
            f"only JSON values (without NaN or Infinity) and torch tensors can "
            f"({exc})"
        ) from None
    return value


__all__ = ["ProtocolError", "UnsendableError", "recv", "send", "to_jsonable"]
