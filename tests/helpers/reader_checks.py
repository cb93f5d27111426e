"""Checks every file-backed reader must pass, shared by the reader tests: bitwise equality of
tensors (``as_bytes``, ``same``), the narrow reads hypothesis draws (``narrow_cases``), and a
close while a read is in flight."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import strategies as st

from shardload.readers.base import copy_progress


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, so that equality is bitwise (NaNs, float8 and bool included)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, same shape, same bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))


@st.composite
def narrow_cases(draw, dtypes: list):
    """(shape, dtype of ``dtypes``, dim, start, length) of a ``torch.narrow`` within the shape."""
    shape = draw(st.lists(st.integers(0, 5), min_size=1, max_size=4))
    dim = draw(st.integers(-len(shape), len(shape) - 1))
    size = shape[dim]
    begin = draw(st.integers(0, size))
    length = draw(st.integers(0, size - begin))
    # torch.narrow also takes a start counted from the end
    start = begin - size if begin < size and draw(st.booleans()) else begin
    return shape, draw(st.sampled_from(dtypes)), dim, start, length


def check_close_while_a_read_is_in_flight(ckpt, name: str, expected, same, monkeypatch) -> None:
    """close() from another thread while a read of ``name`` (96 bytes) is copying out of a map
    (holding a view of it): the map refuses to close (BufferError), close() must not raise, and
    the read goes on from still-mapped memory, without crashing, to the right bytes."""
    monkeypatch.setattr("shardload.readers.base.COPY_CHUNK_BYTES", 8)  # the copy reports every 8
    calls, raised = [], []

    def close() -> None:
        try:
            ckpt.close()
        except BaseException as exc:  # noqa: BLE001  (reported below)
            raised.append(exc)

    def hook() -> None:  # called by the copy after each 8 bytes
        calls.append(1)
        if len(calls) == 1:
            closer = threading.Thread(target=close)
            closer.start()
            closer.join()

    with copy_progress(hook):
        got = ckpt.read(name)
    assert raised == []
    assert len(calls) == 12  # the read went on after the close
    assert same(got, expected)
    with pytest.raises(ValueError, match="closed"):
        ckpt.read(name)
