"""``sources.sparse``: the span set an object's fetched bytes are tracked with, against a
brute-force set of byte positions; ``ObjectBytes`` against a fake client that records what it
was asked for (the real object-storage servers are in test_sources_store.py and
test_objects.py)."""

from __future__ import annotations

import itertools
import random
import threading
import time

import pytest

pytest.importorskip("obstore")

from shardload.sources.sparse import ObjectBytes, Spans, merged
from shardload.sources.store import ObjectInfo


def _positions(spans) -> set[int]:
    return {x for b, e in spans for x in range(b, e)}


def test_spans_follow_a_set_of_positions():
    rng = random.Random(5)
    for _ in range(200):
        spans, ref = Spans(), set()
        for _ in range(rng.randrange(1, 12)):
            b = rng.randrange(0, 60)
            e = b + rng.randrange(0, 15)
            if rng.random() < 0.65:
                spans.add(b, e)
                ref |= set(range(b, e))
            else:
                spans.remove(b, e)
                ref -= set(range(b, e))
            assert _positions(spans) == ref
            pairs = list(spans)
            # sorted, disjoint and never touching: one span per run of positions
            assert all(e1 < b2 for (_, e1), (b2, _) in itertools.pairwise(pairs))
            assert all(b < e for b, e in pairs)
        want = merged((b, b + rng.randrange(0, 10)) for b in rng.sample(range(70), 6))
        missing = spans.missing(want)
        assert _positions(missing) == _positions(want) - ref
        assert all(b < e for b, e in missing)


class _FakeClient:
    """Serves an in-memory object; records the spans each fetch asked for."""

    max_gap = 0

    def __init__(self, data: bytes, delay: float = 0.0):
        self.data, self.delay, self.asked = data, delay, []
        self.lock = threading.Lock()

    def fetch(self, info, spans, write=None, *, into=None):
        with self.lock:
            self.asked.append(list(spans))
        time.sleep(self.delay)
        for b, e in spans:
            if into is not None:
                into[b:e] = self.data[b:e]
            else:
                write(b, memoryview(self.data)[b:e])
        return sum(e - b for b, e in spans)


def _object(size: int):
    data = bytes(random.Random(size).randrange(256) for _ in range(size))
    return data, ObjectInfo(url="s3://models/x.bin", size=size, etag='"e"', last_modified="t")


def test_object_bytes_fetch_once_and_again_after_release():
    data, info = _object(5 * 4096 + 100)
    client = _FakeClient(data)
    obj = ObjectBytes(info, client)
    obj.need_spans([(10, 20), (15, 4000), (9000, 9100)])
    assert client.asked == [[(10, 4000), (9000, 9100)]]
    assert obj.map[10:4000] == data[10:4000] and obj.map[9000:9100] == data[9000:9100]
    obj.need(100, 200)  # present: nothing fetched
    assert len(client.asked) == 1
    obj.need(3990, 4100)  # only the part not present
    assert client.asked[-1] == [(4000, 4100)]
    # a release gives back the pages wholly inside it, and they are fetched again when needed
    obj.release(0, 8192)
    assert not obj.present(0, 10) and not obj.present(4096, 4100)
    obj.need(4090, 4100)
    assert client.asked[-1] == [(4090, 4100)] and obj.map[4090:4100] == data[4090:4100]
    # the object's last, partial page is released too
    obj.need(len(data) - 50, len(data))
    obj.release(5 * 4096, len(data))
    assert not obj.present(len(data) - 50, len(data))
    obj.close()


def test_threads_asking_for_the_same_bytes_fetch_them_once():
    data, info = _object(64 * 1024)
    client = _FakeClient(data, delay=0.2)
    obj = ObjectBytes(info, client)
    waits = []
    threads = [
        threading.Thread(target=obj.need_spans, args=([(0, 40000)], lambda: waits.append(1)))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sum(len(a) for a in client.asked) == 1 and client.asked[0] == [(0, 40000)]
    assert obj.map[:40000] == data[:40000]
    obj.close()


def test_a_failed_fetch_is_raised_and_fetched_again_by_the_next_need():
    data, info = _object(10000)

    class Flaky(_FakeClient):
        fail = True

        def fetch(self, info, spans, write=None, *, into=None):
            if self.fail:
                self.fail = False
                raise OSError("dropped")
            return super().fetch(info, spans, write, into=into)

    obj = ObjectBytes(info, Flaky(data))
    with pytest.raises(OSError):
        obj.need(0, 100)
    assert not obj.present(0, 100)
    obj.need(0, 100)
    assert obj.map[:100] == data[:100]
    obj.close()


def test_a_huge_object_costs_nothing_until_bytes_land():
    info = ObjectInfo(url="s3://models/big.bin", size=1 << 40, etag='"e"', last_modified="t")
    obj = ObjectBytes(info, _FakeClient(b""))  # a terabyte, never reserved
    assert len(obj.map) == 1 << 40
    obj.close()
