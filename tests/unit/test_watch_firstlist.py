"""A first LIST is delivered as its pages arrive (k8s.client.ListStream), each page decoded once;
a relist is still held until its last page is in. A first LIST that fails half way leaves the
collection unlisted (`synced` unset: the agent syncs nothing), and its retry, a relist, ends with
exactly the objects of the list that succeeded: what the failed attempt delivered and the new list
no longer has is deleted."""

from __future__ import annotations

import json
import threading

import pytest

from ebpf_proxy.agent.agent import Agent
from ebpf_proxy.agent.config import load_config
from ebpf_proxy.k8s import client, watch
from ebpf_proxy.k8s.client import KubeListWatch, ListError, ListPages, ListStream
from ebpf_proxy.k8s.watch import Backoff, Reflector, keep_version
from ebpf_proxy.model import Protocol, ServicePortName
from tests.unit.kobjects import service
from tests.unit.test_agent import RecordingDatapath, wait_for
from tests.unit.test_watch import ApiError, FakeClock, FakeResponse, Recorder, ev, gone, versions


def page(items: list, rv: str = "10", token: str | None = None) -> bytes:
    meta = {"resourceVersion": rv}
    if token:
        meta["continue"] = token
    return json.dumps({"kind": "ServiceList", "metadata": meta, "items": items}).encode()


class PagedApi:
    """A list call of the kubernetes client over scripted LISTs: each LIST a list of pages (bytes)
    or exceptions (raised when that page is asked for); the watch streams are canned too. Records
    every call, and stops the reflector when the script runs out."""

    def __init__(self, lists: list[list], watches: list[list] | None = None) -> None:
        self.lists = list(lists)
        self.watches = list(watches or [])
        self.calls: list[dict] = []
        self.reflector: Reflector | None = None
        self._current: list = []

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        if kwargs.get("watch"):
            if not self.watches:
                self.reflector.stop()
                return FakeResponse(lines=[])
            return FakeResponse(lines=[json.dumps(e).encode() + b"\n" for e in self.watches.pop(0)])
        if "_continue" not in kwargs:
            if not self.lists:
                self.reflector.stop()
                raise ApiError(503)
            self._current = list(self.lists.pop(0))
        answer = self._current.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return FakeResponse(answer)


def reflect(api: PagedApi, handler=None, waits: list | None = None, clock: FakeClock | None = None):
    clock = clock or FakeClock()
    handler = handler or Recorder()
    reflector = Reflector(KubeListWatch("Service", api), handler, backoff=Backoff(rng=lambda: 0.5), clock=clock,
                          wait=lambda s: (waits.append(s) if waits is not None else None) or False,
                          keep=keep_version)
    api.reflector = reflector
    return reflector, handler


class Decodes:
    """Counts the JSON decodes of LIST pages (k8s.client's loads)."""

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        real = client.loads

        def counting(data):
            self.count += 1
            return real(data)

        monkeypatch.setattr(client, "loads", counting)


def test_a_first_list_is_delivered_page_by_page_each_page_decoded_once(monkeypatch):
    # chunks as long as the pages, as the agent's (PAGE_SIZE): a page is handed on before the next is asked for
    monkeypatch.setattr(watch, "DELIVERY_CHUNK", 2)
    decodes = Decodes(monkeypatch)
    api = PagedApi([[page([service("a", rv="5"), service("b", rv="6")], token="t1"),
                     page([service("c", rv="7")])]])
    asked: list[int] = []

    class Probe(Recorder):
        def on_add(self, obj):
            asked.append(len(api.calls))  # how many pages were requested when this object came
            super().on_add(obj)

    reflector, rec = reflect(api, Probe())
    reflector.run()
    assert rec.events == [("add", "a", "5"), ("add", "b", "6"), ("add", "c", "7")]
    assert asked == [1, 1, 2], "page 1's objects are delivered before page 2 is asked for"
    assert decodes.count == 2, "each page decoded once"
    assert reflector.synced.is_set() and reflector.lists == 1 and reflector.resource_version == "10"
    assert versions(reflector.cache) == {"default/a": "5", "default/b": "6", "default/c": "7"}
    assert api.calls[1]["_continue"] == "t1"


class RecordingTurn:
    """A `turn` lock that records, per turn, the objects handed on while it was held."""

    def __init__(self) -> None:
        self.turns: list[list[str]] = []
        self.held = False

    def __enter__(self):
        assert not self.held
        self.held = True
        self.turns.append([])

    def __exit__(self, *exc) -> None:
        self.held = False


def test_a_list_is_handed_on_in_turns_of_a_chunk_and_what_came_before_a_failed_page_too(monkeypatch):
    """The agent's reflectors share one `turn` (agent.start_watches): each hands a list on a
    DELIVERY_CHUNK at a time, holding the turn, never while it fetches a page. Items taken before
    a page that fails are handed on too, as they were one by one."""
    monkeypatch.setattr(watch, "DELIVERY_CHUNK", 2)
    names = [service(n, rv=str(i)) for i, n in enumerate("abcde", 5)]
    turn = RecordingTurn()
    fetched_in_turn: list[bool] = []
    added_in_turn: list[bool] = []

    class Probe(Recorder):
        def on_add(self, obj):  # records, not asserts: the Reflector logs a handler's exception away
            added_in_turn.append(turn.held)
            turn.turns[-1].append(obj["metadata"]["name"])
            super().on_add(obj)

    class Api(PagedApi):
        def __call__(self, **kwargs):
            fetched_in_turn.append(turn.held)
            return super().__call__(**kwargs)

    api = Api([[page(names[:3], token="t1"), page(names[3:], token="t2"), ConnectionResetError("reset")]])
    reflector = Reflector(KubeListWatch("Service", api), Probe(), backoff=Backoff(rng=lambda: 0.5),
                          clock=FakeClock(), wait=lambda s: False, keep=keep_version, turn=turn)
    api.reflector = reflector
    reflector.run()
    assert turn.turns[:3] == [["a", "b"], ["c", "d"], ["e"]], "two per turn; e, taken before the failed page, too"
    assert all(added_in_turn) and len(added_in_turn) >= 5, "every object is handed on inside a turn"
    assert not any(fetched_in_turn), "no page is fetched while the turn is held"


def test_a_chunk_whose_delivery_raises_is_not_handed_on_again(monkeypatch):
    """Should handing a chunk on raise (here `keep`, on b), the objects of it already handed on
    (a) are not handed on a second time on the way out."""
    monkeypatch.setattr(watch, "DELIVERY_CHUNK", 2)
    api = PagedApi([[page([service(n, rv=str(i)) for i, n in enumerate("abc", 5)])]])

    def keep(obj):
        if obj["metadata"]["name"] == "b":
            raise RuntimeError("b cannot be kept")
        return keep_version(obj)

    rec = Recorder()
    reflector = Reflector(KubeListWatch("Service", api), rec, backoff=Backoff(rng=lambda: 0.5), clock=FakeClock(),
                          wait=lambda s: False, keep=keep)
    api.reflector = reflector
    with pytest.raises(RuntimeError):
        reflector._list()
    assert rec.events == [("add", "a", "5")]


def test_a_relist_is_held_until_its_last_page_and_then_diffed(monkeypatch):
    api = PagedApi([[page([service("a", rv="5"), service("b", rv="6")])],
                    [page([service("a", rv="5")], rv="50", token="t"), page([service("c", rv="40")], rv="50")]],
                   watches=[[gone()]])
    reflector, rec = reflect(api)
    decodes = Decodes(monkeypatch)
    reflector.run()
    assert rec.events == [("add", "a", "5"), ("add", "b", "6"), ("delete", "b"), ("add", "c", "40")]
    # first list: 1 decode; the watch's 410 event: 1; relist: each of its 2 pages checked on
    # arrival, walked for the names, drained
    assert decodes.count == 1 + 1 + 3 * 2
    assert versions(reflector.cache) == {"default/a": "5", "default/c": "40"} and reflector.lists == 2


def test_a_relist_that_fails_on_its_second_page_changes_nothing():
    api = PagedApi([[page([service("a", rv="5"), service("b", rv="6")])],
                    [page([service("a", rv="5")], rv="50", token="t"), ConnectionResetError("reset")],
                    [page([service("a", rv="5"), service("b", rv="6")], rv="60")]],
                   watches=[[gone()]])
    waits: list[float] = []
    reflector, rec = reflect(api, waits=waits)
    reflector.run()
    assert rec.events == [("add", "a", "5"), ("add", "b", "6")], "the failed relist delivered nothing"
    assert waits[0] == pytest.approx(0.8) and reflector.lists == 2


class SyncedProbe(Recorder):
    """Records, with every event, whether the reflector said "listed" by then."""

    def __init__(self) -> None:
        super().__init__()
        self.reflector: Reflector | None = None
        self.synced_at: list[bool] = []

    def on_add(self, obj):
        self.synced_at.append(self.reflector.synced.is_set())
        super().on_add(obj)

    def on_update(self, old, new):
        self.synced_at.append(self.reflector.synced.is_set())
        super().on_update(old, new)

    def on_delete(self, obj):
        self.synced_at.append(self.reflector.synced.is_set())
        super().on_delete(obj)


@pytest.mark.parametrize("failure, waits_expected", [
    (ApiError(410), []),  # an expired continue token: started over at once
    (ConnectionResetError("connection reset by peer"), [0.8]),  # backed off first
    (ApiError(500), [0.8]),
])
def test_a_first_list_failing_half_way_is_retried_as_a_relist_that_deletes_what_is_gone(failure, waits_expected):
    api = PagedApi([
        [page([service("a", rv="5"), service("b", rv="6")], token="t1"), failure],
        # the retry: b is gone, a changed, c is new
        [page([service("a", rv="8")], rv="20", token="t2"), page([service("c", rv="9")], rv="20")],
    ])
    waits: list[float] = []
    probe = SyncedProbe()
    reflector, rec = reflect(api, probe, waits=waits)
    probe.reflector = reflector
    states: list[tuple] = []
    reflector._wait = lambda s: states.append((reflector.synced.is_set(), versions(reflector.cache))) or \
        waits.append(s) or False
    reflector.run()
    assert rec.events == [("add", "a", "5"), ("add", "b", "6"), ("delete", "b"), ("update", "a", "8"),
                          ("add", "c", "9")]
    assert probe.synced_at == [False] * 5, "nothing is announced as listed before the list that succeeded"
    assert versions(reflector.cache) == {"default/a": "8", "default/c": "9"}
    assert reflector.lists == 1 and reflector.synced.is_set() and reflector.resource_version == "20"
    assert waits == pytest.approx(waits_expected)
    if waits_expected:  # while backing off: not listed, the failed attempt's objects in the cache
        assert states[0] == (False, {"default/a": "5", "default/b": "6"})


def test_a_first_list_failing_on_its_first_page_delivers_nothing_and_streams_again(monkeypatch):
    decodes = Decodes(monkeypatch)
    api = PagedApi([[ApiError(503)], [page([service("a", rv="5")])]])
    waits: list[float] = []
    reflector, rec = reflect(api, waits=waits)
    reflector.run()
    assert rec.events == [("add", "a", "5")] and waits == [pytest.approx(0.8)]
    assert decodes.count == 1, "the retry streamed too: nothing had been delivered"


def test_a_relist_after_an_empty_first_list_is_held_too():
    """Listed with nothing in it, the cache is empty: a relist is still a relist (held, then diffed)."""
    api = PagedApi([[page([])], [page([service("a", rv="5")], rv="20", token="t"), ConnectionResetError("reset")],
                    [page([service("b", rv="7")], rv="30")]], watches=[[gone()]])
    reflector, rec = reflect(api)
    reflector.run()
    assert rec.events == [("add", "b", "7")], "the relist that failed half way delivered nothing"
    assert reflector.lists == 2


@pytest.mark.parametrize("body, message", [
    (b"<html>", "Service list: response is not JSON"),
    (b"[]", "Service list: response is not a list object"),
    (b'{"items": "x"}', "Service list: response has no items list"),
])
def test_a_streamed_list_rejects_a_malformed_page_where_it_comes(body, message):
    answers = [FakeResponse(page([service("a")], token="t")), FakeResponse(body)]
    stream = KubeListWatch("Service", lambda **kw: answers.pop(0)).stream()
    seen = []
    with pytest.raises(ListError, match=message):
        for item in stream:
            seen.append(item["metadata"]["name"])
    assert seen == ["a"] and stream.resource_version is None


def test_list_and_stream_give_the_same_items_and_version():
    pages = [page([service("a"), service("b")], rv="7", token="t"), page([service("c")], rv="7")]
    answers = pages * 2
    lw = KubeListWatch("Service", lambda **kw: FakeResponse(answers.pop(0)))
    held, rv = lw.list()
    stream = lw.stream()
    assert isinstance(held, ListPages) and isinstance(stream, ListStream)
    assert list(stream) == list(held) and stream.resource_version == rv == "7"


# ---- the agent: a first list that fails half way is never synced --------------------------------


class FlakyFirstList:
    """Services: the first LIST streams `web` and `old`, then its connection resets; the retry,
    held at `gate` until the test lets it go, lists `web` and `api`. Watches stay idle."""

    kind = "Service"

    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate
        self.retried = threading.Event()
        self.interrupted = threading.Event()

    def stream(self):
        def items():
            yield service("web", rv="5")
            yield service("old", cluster_ip="10.96.0.12", rv="6")
            raise ConnectionResetError("connection reset by peer")
        return _Items(items())

    def list(self):
        self.retried.set()
        self.gate.wait(20)
        return [service("web", rv="5"), service("api", cluster_ip="10.96.0.11", rv="7")], "20"

    def watch(self, rv):
        lw = self

        class Idle:
            def __iter__(self):
                lw.interrupted.wait()
                return iter(())

            def interrupt(self):
                lw.interrupted.set()

        return Idle()


class _Items:
    """An iterable with a resource_version, as ListStream (never reached: the stream fails)."""

    def __init__(self, it) -> None:
        self._it, self.resource_version = it, None

    def __iter__(self):
        return self._it


class Listed:
    """A collection listed at once (Node, EndpointSlice)."""

    def __init__(self, kind: str, items: list) -> None:
        self.kind, self.items = kind, items
        self.interrupted = threading.Event()

    def list(self):
        return list(self.items), "1"

    watch = FlakyFirstList.watch


def test_the_agent_does_not_sync_a_first_list_that_failed_half_way():
    from tests.unit.kobjects import node

    RecordingDatapath.created = []
    gate = threading.Event()
    services = FlakyFirstList(gate)
    config = load_config({"hostname_override": "n1", "mode": "iptables", "min_sync_period": "0s",
                          "sync_period": "1h"})
    agent = Agent(config, collections={"Service": services, "EndpointSlice": Listed("EndpointSlice", []),
                                       "Node": Listed("Node", [node("n1")])},
                  local_addresses=lambda: ["192.168.1.10"], serve_http=False,
                  datapath_factory=lambda mode, n, **o: RecordingDatapath(n),
                  backoff=lambda: Backoff(initial=0.001, jitter=0))
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", agent.run()), daemon=True)
    thread.start()
    try:
        assert services.retried.wait(20), "the first list is retried"
        old = ServicePortName("default", "old", "http", Protocol.TCP)
        assert old in agent.tracker.take()[0].services, "the failed attempt's objects reached the tracker"
        agent.tracker.abort()
        # the datapath needs the Node alone: it is created (its programs load) while the
        # Services still list, and syncs nothing until they have
        wait_for(lambda: RecordingDatapath.created, "the datapath, once the Node is listed")
        assert not agent.reflectors[0].synced.is_set() and RecordingDatapath.created[0].syncs == [], \
            "nothing is synced while the Service list has not succeeded"
        gate.set()
        wait_for(lambda: RecordingDatapath.created and RecordingDatapath.created[0].syncs, "the first sync")
        (dp,) = RecordingDatapath.created
        first_state = dp.syncs[0][0]
        assert {spn.name for spn in first_state.services} == {"web", "api"}, "exactly the successful list"
    finally:
        gate.set()
        agent.stop()
        thread.join(20)
    assert result.get("code") == 0


class FailingOnce:
    """A relist's items that fail on their first walk (a lazy iterable: its names pass raises)."""

    def __init__(self, items: list) -> None:
        self.items, self.walks = items, 0

    def __iter__(self):
        self.walks += 1
        if self.walks == 1:
            raise ConnectionResetError("reset while reading the list")
        return iter(self.items)


def test_a_relist_whose_items_fail_to_read_changes_nothing_and_is_retried():
    from tests.unit.test_watch import FakeListWatch

    clock = FakeClock()
    fake = FakeListWatch([([service("a", rv="5"), service("b", rv="6")], "10"),
                          (FailingOnce([service("c", rv="7")]), "20"), ([service("a", rv="5")], "30")],
                         [[gone()]], clock)
    rec = Recorder()
    waits: list[float] = []
    reflector = Reflector(fake, rec, backoff=Backoff(rng=lambda: 0.5), clock=clock,
                          wait=lambda s: waits.append(s) or False, keep=keep_version)
    fake.reflector = reflector
    reflector.run()
    assert rec.events == [("add", "a", "5"), ("add", "b", "6"), ("delete", "b")]
    assert versions(reflector.cache) == {"default/a": "5"} and waits == [pytest.approx(0.8)]
