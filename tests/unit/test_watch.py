"""k8s/watch.py: list-then-watch against canned event streams (no API server, no sleeping)."""

from __future__ import annotations

import json
import sys
import threading

import pytest

from ebpf_proxy.k8s.client import KubeListWatch, ListError
from ebpf_proxy.k8s.watch import Backoff, Handler, Reflector, keep_version, kept_version
from tests.unit.kobjects import service


def versions(cache: dict) -> dict:
    """The cache's kept versions as the handlers read them (keep_version keeps "5" as 5)."""
    return {key: kept_version(kept) for key, kept in cache.items()}


class ApiError(Exception):
    """Like kubernetes.client.ApiException: an HTTP status in `.status`."""

    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Advance:
    """In a canned watch stream: the server kept the connection open this long."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds


class FakeListWatch:
    """Scripted LIST results and WATCH streams. When the script runs out, the reflector is stopped."""

    kind = "Service"

    def __init__(self, lists: list, watches: list, clock: FakeClock) -> None:
        self.lists = list(lists)
        self.watches = list(watches)
        self.clock = clock
        self.list_calls = 0
        self.watch_rvs: list[str] = []
        self.reflector: Reflector | None = None

    def list(self):
        self.list_calls += 1
        if not self.lists:
            self.reflector.stop()
            raise ApiError(503)
        result = self.lists.pop(0)
        if isinstance(result, Exception):
            raise result
        return result

    def watch(self, resource_version):
        self.watch_rvs.append(resource_version)
        if not self.watches:
            self.reflector.stop()
            return iter(())
        script = self.watches.pop(0)
        if isinstance(script, Exception):
            raise script
        return self._stream(script)

    def _stream(self, script):
        for item in script:
            if isinstance(item, Advance):
                self.clock.t += item.seconds
            elif isinstance(item, Exception):
                raise item
            else:
                yield item


class Recorder(Handler):
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def on_add(self, obj):
        self.events.append(("add", obj["metadata"]["name"], obj["metadata"]["resourceVersion"]))

    def on_update(self, old, new):
        self.events.append(("update", new["metadata"]["name"], new["metadata"]["resourceVersion"]))

    def on_delete(self, obj):
        self.events.append(("delete", obj["metadata"]["name"]))


def ev(etype: str, name: str, rv: str) -> dict:
    return {"type": etype, "object": service(name, rv=rv)}


def bookmark(rv: str) -> dict:
    return {"type": "BOOKMARK", "object": {"kind": "Service", "metadata": {"resourceVersion": rv}}}


def gone() -> dict:
    return {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired",
                                        "message": "too old resource version: 5 (10)"}}


def run(lists: list, watches: list, handler: Handler | None = None, reports: list | None = None):
    """Run a reflector over the script until it is exhausted; returns (reflector, fake, handler, waits)."""
    clock = FakeClock()
    fake = FakeListWatch(lists, watches, clock)
    handler = handler or Recorder()
    waits: list[float] = []

    def wait(seconds: float) -> bool:
        waits.append(seconds)
        return False

    reflector = Reflector(fake, handler, backoff=Backoff(rng=lambda: 0.5), clock=clock, wait=wait,
                          reporter=(reports.append if reports is not None else None))
    fake.reflector = reflector
    reflector.run()
    return reflector, fake, handler, waits


def test_list_then_watch_from_the_list_resource_version():
    reflector, fake, rec, waits = run(
        lists=[([service("a", rv="5"), service("b", rv="6")], "10")],
        watches=[[ev("ADDED", "c", "11"), ev("MODIFIED", "a", "12"), ev("DELETED", "b", "13"), Advance(300)]],
    )
    assert fake.watch_rvs[0] == "10"
    assert rec.events == [("add", "a", "5"), ("add", "b", "6"), ("add", "c", "11"), ("update", "a", "12"),
                          ("delete", "b")]
    assert fake.watch_rvs[1] == "13"  # the server ended the watch: re-watch from the last RV at once
    assert waits == []
    assert reflector.synced.is_set()
    assert sorted(reflector.cache) == ["default/a", "default/c"]


def test_bookmarks_move_the_resource_version_without_events():
    reflector, fake, rec, _ = run(
        lists=[([service("a", rv="5")], "10")],
        watches=[[bookmark("20"), Advance(60), bookmark("30"), Advance(240)], [ev("MODIFIED", "a", "31")]],
    )
    assert fake.watch_rvs[:2] == ["10", "30"]
    assert rec.events == [("add", "a", "5"), ("update", "a", "31")]
    assert fake.list_calls == 1


def test_410_error_event_relists_and_delivers_only_the_difference():
    reflector, fake, rec, waits = run(
        lists=[
            ([service("a", rv="5"), service("b", rv="6"), service("c", rv="7")], "10"),
            ([service("a", rv="5"), service("c", rv="40"), service("d", rv="41")], "50"),
        ],
        watches=[[Advance(10), gone()], [Advance(300)]],
    )
    assert fake.list_calls >= 2
    assert rec.events[3:] == [("delete", "b"), ("update", "c", "40"), ("add", "d", "41")]
    assert fake.watch_rvs[:2] == ["10", "50"]
    assert waits == []  # a 410 is not an error to back off from


def test_http_410_on_the_watch_request_relists():
    reflector, fake, rec, waits = run(
        lists=[([service("a", rv="5")], "10"), ([], "60")],
        watches=[ApiError(410), [Advance(300)]],
    )
    assert rec.events == [("add", "a", "5"), ("delete", "a")]
    assert fake.watch_rvs[:2] == ["10", "60"]


def test_disconnect_backs_off_and_rewatches_from_the_last_rv_without_relisting():
    reflector, fake, rec, waits = run(
        lists=[([], "10")],
        watches=[[ev("ADDED", "a", "11"), ConnectionResetError("peer reset")],
                 ConnectionRefusedError("api down"), ConnectionRefusedError("api down"),
                 [ev("MODIFIED", "a", "12"), Advance(300)]],
    )
    assert fake.list_calls == 1
    assert fake.watch_rvs[:4] == ["10", "11", "11", "11"]
    assert waits[:3] == pytest.approx([0.8, 1.6, 3.2])  # doubling (jitter fixed at its midpoint)
    assert rec.events == [("add", "a", "11"), ("update", "a", "12")]


def test_backoff_is_capped_and_resets_after_a_successful_list():
    backoff = Backoff(initial=1.0, cap=8.0, rng=lambda: 0.5)
    assert [backoff.next() for _ in range(6)] == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    backoff.reset()
    assert backoff.next() == 1.0


def test_backoff_jitter_spreads_around_the_base():
    assert Backoff(initial=4.0, jitter=0.5, rng=lambda: 0.0).next() == 3.0
    assert Backoff(initial=4.0, jitter=0.5, rng=lambda: 1.0).next() == 5.0


def test_failed_relist_changes_nothing_and_is_retried():
    reflector, fake, rec, waits = run(
        lists=[([service("a", rv="5"), service("b", rv="6")], "10"), ApiError(500), ConnectionError("timeout"),
               ([service("a", rv="5"), service("b", rv="6")], "70")],
        watches=[[Advance(5), gone()], [Advance(300)]],
    )
    # the failed lists delivered no deletes; the successful relist found nothing changed
    assert rec.events == [("add", "a", "5"), ("add", "b", "6")]
    assert waits[:2] == pytest.approx([0.8, 1.6])
    assert fake.watch_rvs[:2] == ["10", "70"]


def test_first_list_failure_is_retried_and_not_synced_meanwhile():
    observed = []

    class Probe(Recorder):
        def on_add(self, obj):
            observed.append(reflector_box[0].synced.is_set())
            super().on_add(obj)

    reflector_box = []
    clock = FakeClock()
    fake = FakeListWatch([ApiError(403), ([service("a", rv="5")], "10")], [[Advance(300)]], clock)
    waits: list[float] = []
    reflector = Reflector(fake, Probe(), backoff=Backoff(rng=lambda: 0.5), clock=clock,
                          wait=lambda s: waits.append(s) or False)
    reflector_box.append(reflector)
    fake.reflector = reflector
    reflector.run()
    assert waits[0] == pytest.approx(0.8)
    assert observed == [False]  # delivered before `synced` is announced
    assert reflector.synced.is_set() and reflector.lists == 1


def test_410_on_list_restarts_the_list_once_without_waiting():
    reflector, fake, rec, waits = run(
        lists=[ApiError(410), ([service("a", rv="5")], "10")],
        watches=[[Advance(300)]],
    )
    assert fake.list_calls == 2 and rec.events == [("add", "a", "5")]
    assert waits == []


def test_repeated_410_on_list_backs_off():
    reflector, fake, rec, waits = run(
        lists=[ApiError(410), ApiError(410), ([service("a", rv="5")], "10")],
        watches=[[Advance(300)]],
    )
    assert fake.list_calls == 3 and rec.events == [("add", "a", "5")]
    assert waits == [pytest.approx(0.8)]


def test_other_error_event_backs_off_and_rewatches():
    reflector, fake, rec, waits = run(
        lists=[([], "10")],
        watches=[[ev("ADDED", "a", "11"), {"type": "ERROR", "object": {"kind": "Status", "code": 500}}],
                 [Advance(300)]],
    )
    assert fake.watch_rvs[:2] == ["10", "11"]
    assert waits[0] == pytest.approx(0.8)
    assert fake.list_calls == 1


def test_a_watch_that_closes_at_once_counts_as_an_error():
    reflector, fake, rec, waits = run(lists=[([], "10")], watches=[[], [Advance(300)]])
    assert waits[0] == pytest.approx(0.8)


def test_malformed_events_are_reported_and_skipped():
    reports: list = []
    reflector, fake, rec, waits = run(
        lists=[(["not an object", {"metadata": {}}, service("a", rv="5")], "10")],
        watches=[["garbage", {"type": "ADDED", "object": {"spec": {}}}, {"type": "SURPRISE", "object": {}},
                  ev("ADDED", "b", "11"), Advance(300)]],
        reports=reports,
    )
    assert rec.events == [("add", "a", "5"), ("add", "b", "11")]
    assert [r.reason for r in reports] == ["malformed", "malformed", "malformed", "malformed", "invalid_value"]
    assert all(r.kind == "Service" and r.skipped == "event" for r in reports)


def test_handler_errors_do_not_stop_the_watch():
    class Broken(Recorder):
        def on_add(self, obj):
            super().on_add(obj)
            raise KeyError("bug")

    reflector, fake, rec, waits = run(
        lists=[([service("a", rv="5")], "10")],
        watches=[[ev("ADDED", "b", "11"), ev("MODIFIED", "b", "12"), Advance(300)]],
        handler=Broken(),
    )
    assert rec.events == [("add", "a", "5"), ("add", "b", "11"), ("update", "b", "12")]


def test_stop_interrupts_a_blocked_watch():
    listed = threading.Event()

    class Blocking:
        kind = "Service"

        def __init__(self) -> None:
            self.unblock = threading.Event()

        def list(self):
            return [], "1"

        def watch(self, rv):
            outer = self

            class Stream:
                def __iter__(self):
                    listed.set()
                    outer.unblock.wait()
                    raise ConnectionResetError("socket shut down")
                    yield  # pragma: no cover

                def interrupt(self):
                    outer.unblock.set()

            return Stream()

    reflector = Reflector(Blocking(), Handler())
    thread = reflector.start()
    assert listed.wait(10)
    reflector.stop(timeout=10)
    assert not thread.is_alive()


# ---- the kubernetes-client adapter ----------------------------------------------------------------


class FakeResponse:
    def __init__(self, body: bytes = b"", lines: list[bytes] | None = None) -> None:
        self.data = body
        self._lines = lines or []
        self.released = False

    def stream(self, amt=None, decode_content=False):
        yield from self._lines

    def release_conn(self):
        self.released = True

    def close(self):
        pass


def test_kube_list_watch_pages_and_parses_dicts():
    pages = [
        {"kind": "ServiceList", "metadata": {"resourceVersion": "7", "continue": "tok"}, "items": [service("a")]},
        {"kind": "ServiceList", "metadata": {"resourceVersion": "7"}, "items": [service("b")]},
    ]
    calls = []

    def call(**kwargs):
        calls.append(kwargs)
        return FakeResponse(json.dumps(pages[len(calls) - 1]).encode())

    lw = KubeListWatch("Service", call, label_selector="!x")
    items, rv = lw.list()
    assert [i["metadata"]["name"] for i in items] == ["a", "b"] and rv == "7"
    assert calls[0]["_preload_content"] is False and calls[0]["label_selector"] == "!x"
    assert "_continue" not in calls[0] and calls[1]["_continue"] == "tok"


@pytest.mark.parametrize("body", [b"<html>", b"[]", b'{"items": "x"}'])
def test_kube_list_watch_rejects_a_non_list_answer(body):
    lw = KubeListWatch("Service", lambda **kw: FakeResponse(body))
    with pytest.raises(ListError, match="Service list"):
        lw.list()


def test_kube_watch_stream_yields_dicts_and_fails_on_garbage():
    lines = [json.dumps(ev("ADDED", "a", "2")).encode() + b"\n", b"\n", json.dumps(bookmark("3")).encode()[:10],
             json.dumps(bookmark("3")).encode()[10:] + b"\n", b"{not json\n"]
    seen = {}

    def call(**kwargs):
        seen.update(kwargs)
        return FakeResponse(lines=lines)

    stream = KubeListWatch("Service", call).watch("1")
    assert seen["watch"] is True and seen["allow_watch_bookmarks"] is True and seen["resource_version"] == "1"
    assert next(stream)["type"] == "ADDED"
    assert next(stream)["type"] == "BOOKMARK"
    with pytest.raises(ListError, match="unparsable"):
        next(stream)


class Pages:
    """A re-iterable LIST result, like k8s.client.ListPages: counts how often it is walked."""

    def __init__(self, items):
        self.items, self.passes = items, 0

    def __iter__(self):
        self.passes += 1
        return iter([json.loads(json.dumps(i)) for i in self.items])  # fresh objects each pass


def test_the_cache_keeps_what_keep_retains_and_relists_still_deliver_deletes():
    """The agent's cache keeps only versions: watch events and relists are delivered as before
    (full objects to add/update, deletions first), and a delete after a relist names the object."""
    first = Pages([service("a", rv="5"), service("b", rv="6")])
    second = Pages([service("a", rv="5"), service("c", rv="40")])
    clock = FakeClock()
    fake = FakeListWatch([(first, "10"), (second, "50")], [[ev("MODIFIED", "a", "11"), Advance(10), gone()],
                                                            [Advance(300)]], clock)
    full: list[dict] = []

    deleted: list[dict] = []

    class Keeper(Recorder):
        def on_add(self, obj):
            full.append(obj)
            super().on_add(obj)

        def on_delete(self, obj):
            deleted.append(obj)
            super().on_delete(obj)

    rec = Keeper()
    reflector = _run_keeping_versions(fake, rec, clock)
    assert rec.events == [("add", "a", "5"), ("add", "b", "6"), ("update", "a", "11"),
                          ("delete", "b"), ("update", "a", "5"), ("add", "c", "40")]
    assert all("spec" in obj for obj in full), "handlers get whole objects"
    assert versions(reflector.cache) == {"default/a": "5", "default/c": "40"}, "only versions are kept"
    assert deleted == [{"metadata": {"name": "b", "namespace": "default", "resourceVersion": "6"}}], \
        "a delete found by a relist names the object"
    assert first.passes == 2 and second.passes == 2, "one pass for the names, one to deliver"


def _run_keeping_versions(fake, rec, clock):
    """Run a Reflector over `fake` that keeps only versions (the agent's keep_version), to the end."""
    reflector = Reflector(fake, rec, backoff=Backoff(rng=lambda: 0.5), clock=clock, wait=lambda s: False,
                          keep=keep_version)
    fake.reflector = reflector
    reflector.run()
    return reflector


@pytest.mark.parametrize("rv", ["5", "0", "-7", "123456789", "12345678901234567890"])
def test_a_decimal_version_is_kept_as_an_int_that_reads_back_as_the_same_text(rv):
    kept = keep_version(service("a", rv=rv))
    assert type(kept) is int and kept_version(kept) == rv and type(kept_version(kept)) is str
    if len(rv) > 1:
        assert sys.getsizeof(kept) < sys.getsizeof(rv), "what the int form is for"


@pytest.mark.parametrize("rv", ["007", "+7", " 7", "7 ", "1_0", "\u0667", "-0", "abc", "7.0", "9" * 5000])
def test_any_other_version_is_kept_as_its_text(rv):
    kept = keep_version(service("a", rv=rv))
    assert kept == rv and type(kept) is str and kept_version(kept) is kept


def test_versions_kept_as_ints_are_text_to_the_handlers_and_to_the_relist_decisions():
    # "6" kept as 6 is the same version at the relist (no update), "007" kept as text is not "7"
    first = Pages([service("a", rv="5"), service("b", rv="007"), service("c", rv="8")])
    second = Pages([service("a", rv="5"), service("b", rv="7")])
    clock = FakeClock()
    fake = FakeListWatch([(first, "10"), (second, "50")], [[ev("MODIFIED", "a", "6"), ev("MODIFIED", "a", "5"),
                                                            Advance(10), gone()], [Advance(300)]], clock)
    olds: list = []
    deleted: list = []

    class Keeper(Recorder):
        def on_update(self, old, new):
            olds.append(old)
            super().on_update(old, new)

        def on_delete(self, obj):
            deleted.append(obj)
            super().on_delete(obj)

    rec = Keeper()
    reflector = _run_keeping_versions(fake, rec, clock)
    assert rec.events == [("add", "a", "5"), ("add", "b", "007"), ("add", "c", "8"), ("update", "a", "6"),
                          ("update", "a", "5"), ("delete", "c"), ("update", "b", "7")]
    assert olds == ["5", "6", "007"] and all(type(old) is str for old in olds), "the kept version, as text"
    assert deleted == [{"metadata": {"name": "c", "namespace": "default", "resourceVersion": "8"}}]
    assert reflector.cache == {"default/a": 5, "default/b": 7}, "decimal versions kept as ints"


@pytest.mark.parametrize("intern_keys", [True, False])
def test_interned_cache_keys_are_the_one_string_object_of_their_text(intern_keys):
    canonical = sys.intern("".join(["default/", "a"]))  # what the trackers hold (model/tracker.py)
    clock = FakeClock()
    fake = FakeListWatch([(Pages([service("a", rv="5")]), "10")], [[ev("ADDED", "b", "6"), Advance(300)]], clock)
    reflector = Reflector(fake, Recorder(), clock=clock, wait=lambda s: False, keep=keep_version,
                          intern_keys=intern_keys)
    fake.reflector = reflector
    reflector.run()
    keys = {key: key for key in reflector.cache}
    assert sorted(keys) == ["default/a", "default/b"]
    assert (keys["default/a"] is canonical) is intern_keys
    assert (keys["default/b"] is sys.intern("".join(["default/", "b"]))) is intern_keys
