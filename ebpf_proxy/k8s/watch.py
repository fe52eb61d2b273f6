"""List-then-watch one collection and keep handlers in step with it (client-go's Reflector, small).

Protocol, as the API server defines it:
1. LIST the collection; the list's `metadata.resourceVersion` (RV) is where the watch starts.
2. WATCH from that RV with `allowWatchBookmarks`: ADDED/MODIFIED/DELETED carry objects (and their
   RV), BOOKMARK carries only a newer RV, so a reconnect does not replay or miss anything.
3. The server ends watches on its own (timeout): re-watch from the last RV, at once.
4. If the RV is too old (compacted), the server answers 410 Gone, either as the watch request's
   HTTP status or as an ERROR event with code 410: LIST again and deliver the *difference* between
   the new list and the cache (objects missing from the new list are deleted).
5. Any other failure: reconnect after a capped exponential backoff with jitter, from the last RV.
   client-go's Reflector does the same (backoff 800ms doubling up to 30s), and so do we across
   an API server outage: connection refused while it is stopped, and, while it is frozen
   (overloaded, SIGSTOPped: the TCP connection stays open and nothing comes), the list-watch's
   read timeout (k8s/client.py `WatchIdleTimeout`: no event or BOOKMARK within the idle
   timeout). The first event of a watch (a bookmark counts) resets the backoff: the server is
   back, and the next outage starts from the shortest wait again.
6. An API server restarted with other objects (a restore from backup) no longer has our RV: its
   410 "too old resource version" (reason Expired) takes us to step 4, so whatever disappeared
   while we were not watching is deleted.

Why not `kubernetes.watch.Watch().stream`: it deserializes into generated models (a malformed
object raises inside the client) and retries one 410 by itself from a stale RV. Here the raw event
stream is read as dicts and every case above is handled in one place.

A failed LIST never changes what the handlers saw: an API outage must not look like "every service
was deleted". A relist is held until its last page is in, then its difference from the cache is
delivered. The first LIST is delivered as its pages arrive, where the collection offers that
(`ListWatch.stream`): with nothing delivered yet there is nothing to delete, so nothing to hold
(at 100,000 Services and slices, ~200 MB of page text and one decode of it). Should it fail half
way, what it delivered stays in the cache and `synced` stays unset (the agent does not sync a
partial view: Agent.wait_until_listed); the retry is then a relist like any other, whose
difference deletes what the failed attempt delivered and the new list no longer has.

The cache holds what `keep` retains of each object (client-go's informer transform): all of it by
default; the agent keeps only the resourceVersion (`keep_version`), since its handlers turn every
object into the model at once and never look back at the API form (at 10,000 Services and
slices the full objects are ~50 MB of dicts, their metadata alone ~8 MB). A delete found by a
relist then names the object by its namespace/name and last resourceVersion. A LIST's items may
be any iterable, such as pages decoded one at a time (k8s.client.ListPages), so a relist never
holds every decoded object at once either.

Tests drive `Reflector` with any object that has `kind`, `list()` and `watch(rv)` (see `ListWatch`),
a fake `wait` (no sleeping) and a fake clock.
"""

from __future__ import annotations

import contextlib
import logging
import random
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any, Callable, ContextManager, Protocol

from ebpf_proxy.k8s import invalid as inv
from ebpf_proxy.k8s.convert import object_ref
from ebpf_proxy.k8s.invalid import Invalid, Reporter

log = logging.getLogger(__name__)

GONE = 410
# client-go treats a watch that ends within a second without a single event as an error (a server
# or proxy that closes at once would otherwise make us spin).
SHORT_WATCH_SECONDS = 1.0
# a list's items handed on per turn (Reflector `turn`): a page of the agent's LIST (PAGE_SIZE),
# few enough that a turn is short (~12 ms of slices) and a chunk holds no more decoded objects
# than a page
DELIVERY_CHUNK = 500


class ListWatch(Protocol):
    """One collection of the API: what the Reflector needs from the API client."""

    kind: str

    def list(self) -> tuple[Iterable[Any], str]:
        """All objects (an iterable the Reflector walks twice) and the list's resourceVersion.
        Raises on any failure (HTTP status in `.status`)."""

    # Optional: `stream()`, an iterable of the objects as they arrive, that raises as `list()`
    # does where the LIST fails and has the list's `resource_version` once walked to its end
    # (k8s.client.ListStream). Without it the first LIST is held like any relist.

    def watch(self, resource_version: str) -> Iterable[Any]:
        """Raw watch events ({"type": ..., "object": {...}}) from `resource_version` on. May have
        `interrupt()` (called from another thread to stop a blocked read) and `close()`."""


class Handler:
    """Receives the collection's changes as plain dicts. Override what you need."""

    def on_add(self, obj: dict) -> None:
        """A new object."""

    def on_update(self, old: dict, new: dict) -> None:
        """An object changed (its resourceVersion moved). `old` is what the cache kept of it."""

    def on_delete(self, obj: dict) -> None:
        """An object is gone: the DELETED event's object, or after a relist what the cache kept."""


def keep_all(obj: dict) -> dict:
    """The default cache transform: the whole object."""
    return obj


def keep_version(obj: dict) -> str | int:
    """The cache transform for handlers that need no more than a deleted object's identity: its
    resourceVersion (the cache key is its namespace/name).

    A decimal version (what etcd-backed API servers give: a revision number) is kept as the int
    whose str() is that exact text, else as the text: an int of up to 9 digits is 28 bytes (a
    32-byte block), its text 49 + its length (56-byte blocks): ~24 bytes less a Service and a
    slice (0.5 MiB less traced after the first sync at 10,000 Services, bench/cpscale.py
    --tracemalloc: 39.7 -> 39.2 MiB; ~5 MiB at 100,000). The version is opaque to
    the agent; read it back with `kept_version`, which gives the exact text again, and the
    handlers only ever see that text (on_update's `old`, a relist's on_delete)."""
    rv = _rv(obj)
    if rv is None:
        return ""
    try:
        number = int(rv)
    except ValueError:  # not decimal, or longer than int() reads (sys.get_int_max_str_digits)
        return rv
    return number if str(number) == rv else rv  # not "007", "+7", " 7", "1_0", non-ASCII digits: kept as text


def kept_version(kept: Any) -> Any:
    """What the cache kept, as the handlers see it: a version `keep_version` kept as an int as its
    text again (what it was read as); anything else as it is."""
    return str(kept) if type(kept) is int else kept


def _kept_rv(kept: Any) -> str | None:
    kept = kept_version(kept)
    return (kept or None) if isinstance(kept, str) else _rv(kept)


def _deleted(key: str, kept: Any) -> dict:
    """What on_delete gets for an object a relist no longer lists: what the cache kept of it, or
    (kept as its version) its identity rebuilt from the cache key, as "namespace/name"."""
    kept = kept_version(kept)
    if not isinstance(kept, str):
        return kept
    namespace, _, name = key.rpartition("/")
    return {"metadata": {"name": name, "namespace": namespace, "resourceVersion": kept}}


class Backoff:
    """Capped exponential backoff with jitter, like client-go's (0.8s doubling up to 30s)."""

    def __init__(self, initial: float = 0.8, cap: float = 30.0, factor: float = 2.0, jitter: float = 0.5,
                 rng: Callable[[], float] = random.random) -> None:
        self.initial, self.cap, self.factor, self.jitter, self._rng = initial, cap, factor, jitter, rng
        self._attempt = 0

    def next(self) -> float:
        """The next delay: the base doubles up to `cap`; jitter spreads it ±jitter/2 so that many
        agents reconnecting to a restarted API server do not arrive in lockstep."""
        base = min(self.cap, self.initial * self.factor ** self._attempt)
        self._attempt += 1
        return base * (1 + self.jitter * (self._rng() - 0.5))

    def reset(self) -> None:
        self._attempt = 0


def _status(exc: BaseException) -> int | None:
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) else None


def describe_error(exc: BaseException) -> str:
    """One line for a log: the client's ApiException renders headers and body over many lines."""
    status = _status(exc)
    if status is not None:
        reason = getattr(exc, "reason", None) or type(exc).__name__
        return f"HTTP {status} {reason}"
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _rv(obj: Any) -> str | None:
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    rv = meta.get("resourceVersion") if isinstance(meta, dict) else None
    return rv if isinstance(rv, str) and rv else None


class Reflector:
    """Keeps `handler` in step with one collection until `stop()`; see the module docstring."""

    def __init__(self, lw: ListWatch, handler: Handler, *, backoff: Backoff | None = None,
                 clock: Callable[[], float] = time.monotonic, wait: Callable[[float], bool] | None = None,
                 reporter: Reporter | None = None, keep: Callable[[dict], Any] = keep_all,
                 bulk: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
                 intern_keys: bool = False, turn: ContextManager[Any] | None = None) -> None:
        self.lw = lw
        self.keep = keep
        # the cache keys ("namespace/name") as one string object shared with whatever else interns
        # the same text: the agent's Services, whose key the trackers hold too (model/tracker.py
        # _service_key): ~64 bytes a Service saved. Not for slices: their keys are held once,
        # an intern table entry (~45 bytes) would only add to them
        self._intern_keys = intern_keys
        # around each list's delivery (millions of objects made at once): the agent's pauses the
        # garbage collector (agent/heap.py paused())
        self._bulk = bulk
        # held while each DELIVERY_CHUNK of a list's items is handed on, never while a page is
        # fetched or decoded: the agent gives its reflectors one lock, so that their first lists,
        # which start together, take turns a chunk at a time instead of interleaving object by
        # object through the locks every handler takes (the trackers', the sync runner's, the
        # metrics'). Interleaved, two threads handing Services and slices on at once cost ~1.8 s
        # more CPU than in turns at 100,000 Services (bench/cpscale.py, the agent's share of
        # list+convert 7.6 -> 5.8 s)
        self._turn = turn if turn is not None else threading.Lock()
        self.kind = lw.kind
        self.handler = handler
        self.backoff = backoff or Backoff()
        self.clock = clock
        self._stop = threading.Event()
        self._wait = wait or self._stop.wait
        self.reporter = reporter
        self.synced = threading.Event()  # set once the first LIST has been delivered
        self.resource_version = ""
        self.cache: dict[str, Any] = {}  # what `keep` retains, by namespace/name
        self.lists = 0  # successful LISTs (1 + relists), for tests and logs
        self._stream: Any = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self) -> threading.Thread:
        self._thread = threading.Thread(target=self.run, name=f"watch-{self.kind}", daemon=True)
        self._thread.start()
        return self._thread

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop watching: wakes a backoff wait and interrupts a blocked read."""
        self._stop.set()
        stream = self._stream
        if stream is not None and hasattr(stream, "interrupt"):
            try:
                stream.interrupt()
            except Exception:  # best effort: the thread also checks the stop flag between events
                log.debug("interrupting the %s watch failed", self.kind, exc_info=True)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def _sleep(self, reason: str) -> bool:
        """Back off; True if stopped meanwhile."""
        delay = self.backoff.next()
        log.warning("%s: retrying in %.1fs", reason, delay, extra={"kind": self.kind, "delay_s": round(delay, 3)})
        return bool(self._wait(delay)) or self._stop.is_set()

    # ---- the loop --------------------------------------------------------------------------------

    def run(self) -> None:
        need_list = True
        list_gone_retried = False
        while not self._stop.is_set():
            if need_list:
                try:
                    rv = self._list()
                except Exception as exc:
                    # 410 on a LIST (an expired continue token): start over at once, but only once.
                    if _status(exc) == GONE and not list_gone_retried:
                        list_gone_retried = True
                        continue
                    if self._sleep(f"{self.kind} list failed: {describe_error(exc)}"):
                        break
                    continue
                list_gone_retried = False
                self.resource_version = rv if isinstance(rv, str) else ""
                self.lists += 1
                self.backoff.reset()
                self.synced.set()
                log.info("%s listed", self.kind,
                         extra={"kind": self.kind, "objects": len(self.cache), "resource_version": self.resource_version})
                need_list = False
                if self._stop.is_set():
                    break
            outcome = self._watch_once()
            if outcome == "relist":
                need_list = True
            elif outcome == "error":
                if self._sleep(f"{self.kind} watch failed"):
                    break
        log.info("%s watch stopped", self.kind, extra={"kind": self.kind})

    def _watch_once(self) -> str:
        """One watch connection. Returns "relist", "rewatch" (ended normally) or "error"."""
        started = self.clock()
        events = 0
        try:
            self._stream = self.lw.watch(self.resource_version)
            for event in self._stream:
                if self._stop.is_set():
                    return "rewatch"
                events += 1
                if events == 1:
                    self.backoff.reset()
                outcome = self._handle_event(event)
                if outcome is not None:
                    return outcome
        except Exception as exc:
            if self._stop.is_set():
                return "rewatch"
            if _status(exc) == GONE:
                log.info("%s watch: resourceVersion %s is gone (410): relisting", self.kind, self.resource_version,
                         extra={"kind": self.kind, "resource_version": self.resource_version})
                return "relist"
            log.warning("%s watch error: %s", self.kind, describe_error(exc), extra={"kind": self.kind})
            return "error"
        finally:
            stream, self._stream = self._stream, None
            if stream is not None and hasattr(stream, "close"):
                try:
                    stream.close()
                except Exception:
                    log.debug("closing the %s watch failed", self.kind, exc_info=True)
        if events == 0 and self.clock() - started < SHORT_WATCH_SECONDS and not self._stop.is_set():
            log.warning("%s watch closed at once without events", self.kind, extra={"kind": self.kind})
            return "error"
        return "rewatch"

    def _handle_event(self, event: Any) -> str | None:
        if not isinstance(event, dict):
            self._invalid("?", "", inv.MALFORMED, f"watch event is not an object: {event!r:.80}")
            return None
        etype, obj = event.get("type"), event.get("object")
        if etype == "ERROR":
            code = obj.get("code") if isinstance(obj, dict) else None
            message = obj.get("message") if isinstance(obj, dict) else obj
            if code == GONE:
                log.info("%s watch: %s (410): relisting", self.kind, message,
                         extra={"kind": self.kind, "resource_version": self.resource_version})
                return "relist"
            log.warning("%s watch: error event %s: %s", self.kind, code, message,
                        extra={"kind": self.kind, "code": code})
            return "error"
        if etype == "BOOKMARK":
            rv = _rv(obj)
            if rv:
                self.resource_version = rv
            return None
        if etype not in ("ADDED", "MODIFIED", "DELETED"):
            self._invalid("?", "type", inv.INVALID_VALUE, f"unknown watch event type {etype!r}")
            return None
        ref = object_ref(obj)
        rv = _rv(obj)
        if ref is None:
            if rv:
                self.resource_version = rv
            self._invalid("?", "object.metadata.name", inv.MALFORMED, f"{etype} event without a usable object")
            return None
        key = sys.intern(str(ref)) if self._intern_keys else str(ref)
        old = self.cache.get(key)
        if etype == "DELETED":
            if old is not None:
                del self.cache[key]
                self._call(self.handler.on_delete, obj)
        else:
            self.cache[key] = self.keep(obj)
            if old is None:
                self._call(self.handler.on_add, obj)
            else:
                self._call(self.handler.on_update, kept_version(old), obj)
        # Only after the handler: "resource_version" then means "everything up to here was handed on",
        # which the agent's synced-resourceVersion report relies on.
        if rv:
            self.resource_version = rv
        return None

    def _list(self) -> Any:
        """One LIST, delivered; returns its resourceVersion. Raises where the LIST fails: a relist
        before anything is delivered; a streamed first list at the page that failed, after the
        items of the pages before it (the module docstring)."""
        stream = getattr(self.lw, "stream", None)
        if stream is not None and not self.cache and not self.synced.is_set():
            items = stream()
            # the pages are fetched inside the bulk too (the stream requests each one as it is
            # walked): a slow API server keeps the collector paused for as long as this list
            # lasts, which only delays collecting garbage (heap.paused); nothing is lost
            with self._bulk():
                self._deliver(items, {})
            return items.resource_version
        listed, rv = self.lw.list()
        self._replace(listed)
        return rv

    def _replace(self, items: Iterable[Any]) -> None:
        """A (re)list: deliver the difference between the new list and the cache, deletions first.

        Two passes over `items`: the names (what is gone), then each object delivered and what
        `keep` retains of it cached, so a lazy iterable is never held decoded all at once. Items
        that can be drained (k8s.client.ListPages: decoding is most of a pass) skip the names
        pass when the cache is empty (a first list deletes nothing), and are drained by the
        delivery pass, their text freed page by page."""
        if isinstance(items, (str, bytes, dict)) or not isinstance(items, Iterable):
            items = []
        drain = getattr(items, "drain", None)
        old = self.cache
        listed: set[str] = set()
        if old or drain is None:
            for item in items:  # an iterable that fails here (run() retries) has changed nothing
                ref = object_ref(item)
                if ref is not None:
                    listed.add(str(ref))
        self.cache = {}
        for key in sorted(old.keys() - listed):
            self._call(self.handler.on_delete, _deleted(key, old[key]))
        with self._bulk():
            self._deliver(drain() if drain is not None else items, old)

    def _deliver(self, items: Iterable[Any], old: dict[str, Any]) -> None:
        """The delivery pass of a (re)list: adds and updates, in list order, DELIVERY_CHUNK items
        per turn (see `turn`). Items are taken from `items` outside the turn (taking them may
        fetch and decode a page); should that raise, the items taken before it are delivered
        first, as they would have been one by one."""
        chunk: list[Any] = []
        start = 0
        try:
            for item in items:
                chunk.append(item)
                if len(chunk) == DELIVERY_CHUNK:
                    full, chunk = chunk, []  # out of `chunk` first: should it raise, it is not handed on twice
                    self._deliver_chunk(full, start, old)
                    start += len(full)
        finally:
            if chunk:
                self._deliver_chunk(chunk, start, old)

    def _deliver_chunk(self, items: list[Any], start: int, old: dict[str, Any]) -> None:
        """Items `start`.. of a list, in one turn."""
        with self._turn:
            for i, item in enumerate(items, start):
                ref = object_ref(item)
                if ref is None:
                    self._invalid("?", f"items[{i}].metadata.name", inv.MALFORMED,
                                  "listed object without a usable name")
                    continue
                key = sys.intern(str(ref)) if self._intern_keys else str(ref)
                kept = self.cache[key] = self.keep(item)
                before = old.get(key)
                if before is None:
                    self._call(self.handler.on_add, item)
                elif _kept_rv(before) != _rv(item) or (_rv(item) is None and before != kept):
                    self._call(self.handler.on_update, kept_version(before), item)

    def _call(self, fn: Callable[..., None], *args: dict) -> None:
        try:
            fn(*args)
        except Exception:  # a handler bug must not stop the watch (the agent never crashes on API content)
            ref = object_ref(args[-1])
            log.exception("%s handler failed", self.kind, extra={"kind": self.kind, "object": str(ref) if ref else "?"})

    def _invalid(self, obj: str, field: str, reason: str, detail: str) -> None:
        inv.report(self.reporter, Invalid(kind=self.kind, obj=obj, field=field, reason=reason, detail=detail,
                                          skipped="event"))
