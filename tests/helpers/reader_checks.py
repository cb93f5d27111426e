"""Checks every file-backed reader must pass, shared by the reader tests."""

from __future__ import annotations

import threading

import pytest

from shardload.readers.base import copy_progress


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
