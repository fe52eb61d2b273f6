"""A LIST held as pages of JSON text (k8s.client.ListPages) is decoded once per pass and drained by
the Reflector's delivery pass: a first list skips the names pass (nothing to delete), a relist
still deletes what is gone, and the delivery runs inside the Reflector's `bulk` context."""

from __future__ import annotations

import contextlib
import json

from ebpf_proxy.k8s.client import ListPages
from ebpf_proxy.k8s.watch import Backoff, Reflector, keep_version
from tests.unit.kobjects import service
from tests.unit.test_watch import FakeClock, FakeListWatch, Recorder, versions


class CountingPages(ListPages):
    """ListPages that counts its passes: plain iterations and drains."""

    def __init__(self, items: list[dict], per_page: int = 2) -> None:
        super().__init__()
        self.walks = self.drains = 0
        for i in range(0, len(items), per_page):
            page = items[i:i + per_page]
            self.add(json.dumps({"items": page}).encode(), len(page))

    def __iter__(self):
        self.walks += 1
        return super().__iter__()

    def drain(self):
        self.drains += 1
        return super().drain()


def test_drain_yields_every_item_in_order_and_releases_the_pages():
    pages = CountingPages([service(f"s{i}", rv=str(i)) for i in range(5)])
    assert [o["metadata"]["name"] for o in pages.drain()] == [f"s{i}" for i in range(5)]
    assert len(pages) == 0 and list(pages) == []


def test_a_first_list_is_decoded_once_a_relist_twice_and_deletes_still_come_first():
    first = CountingPages([service("a", rv="5"), service("b", rv="6"), service("c", rv="7")])
    second = CountingPages([service("a", rv="5"), service("d", rv="40")])
    clock = FakeClock()
    fake = FakeListWatch([(first, "10"), (second, "50")], [[{"type": "ERROR", "object": {"code": 410}}], []], clock)
    entered: list[str] = []

    @contextlib.contextmanager
    def bulk():
        entered.append("in")
        yield
        entered.append("out")

    rec = Recorder()
    reflector = Reflector(fake, rec, backoff=Backoff(rng=lambda: 0.5), clock=clock, wait=lambda s: False,
                          keep=keep_version, bulk=bulk)
    fake.reflector = reflector
    reflector.run()
    assert rec.events == [("add", "a", "5"), ("add", "b", "6"), ("add", "c", "7"),
                          ("delete", "b"), ("delete", "c"), ("add", "d", "40")]
    assert (first.walks, first.drains) == (0, 1), "a first list: no names pass, one drain"
    assert (second.walks, second.drains) == (1, 1), "a relist: the names pass, then the drain"
    assert entered == ["in", "out", "in", "out"]
    assert versions(reflector.cache) == {"default/a": "5", "default/d": "40"}
