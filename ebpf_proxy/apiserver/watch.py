"""Watchers: one queue of events per watch, filled by the store under its lock.

Because the store appends to every queue while it still holds the write lock, each watcher
sees events in resource-version order with no gaps, and a BOOKMARK (also queued under the
lock) never claims a version whose events are still on their way. Consumers (an HTTP watch
stream, the slice controller) drain the queue from their own thread.

A watcher whose consumer stops reading is closed once its queue holds `queue_limit` events,
as the real server drops slow watchers; the client then resumes from its last version.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from ebpf_proxy.apiserver.jsontree import clone
from ebpf_proxy.apiserver.selectors import FieldSelector, LabelSelector

ADDED, MODIFIED, DELETED, BOOKMARK = "ADDED", "MODIFIED", "DELETED", "BOOKMARK"
INITIAL_EVENTS_END = "k8s.io/initial-events-end"


@dataclass(frozen=True)
class Change:
    """One committed write: the history entry the store keeps (objects are never mutated)."""

    rv: int
    type: str
    kind: str
    object: dict[str, Any]
    prev: dict[str, Any] | None


@dataclass(frozen=True)
class WatchEvent:
    type: str
    kind: str
    object: dict[str, Any]  # shared with the store's history: treat as read-only
    resource_version: int


class Watcher:
    """A filtered, ordered stream of changes to one or more kinds."""

    def __init__(
        self,
        kinds: tuple[str, ...],
        *,
        namespace: str | None = None,
        label_selector: LabelSelector | None = None,
        field_selector: FieldSelector | None = None,
        bookmarks: bool = False,
        queue_limit: int = 10000,
        on_stop: Callable[["Watcher"], None] | None = None,
    ) -> None:
        self.kinds = kinds
        self.namespace = namespace
        self.label_selector = label_selector or LabelSelector()
        self.field_selector = field_selector or FieldSelector()
        self.bookmarks = bookmarks
        self.queue_limit = queue_limit
        self._on_stop = on_stop
        self._cond = threading.Condition()
        self._queue: deque[WatchEvent] = deque()
        self._stopped = False
        self.stop_reason = ""
        self.last_offered_rv = 0  # highest rv queued (for "has the consumer caught up?")

    # -- producer side (store, under its lock) --------------------------------------------

    def matches(self, kind: str, obj: dict[str, Any] | None) -> bool:
        if obj is None or kind not in self.kinds:
            return False
        meta = obj.get("metadata") or {}
        if self.namespace and meta.get("namespace") != self.namespace:
            return False
        return self.label_selector.matches(meta.get("labels")) and self.field_selector.matches(obj)

    def translate(self, change: Change) -> WatchEvent | None:
        """The event this watcher sees for `change`, as the real server filters watches:
        an object that stops matching the selector is DELETED for this watcher, one that
        starts matching is ADDED."""
        if change.kind not in self.kinds:
            return None
        if change.type == MODIFIED:
            was, now = self.matches(change.kind, change.prev), self.matches(change.kind, change.object)
            if was and now:
                kind = MODIFIED
            elif now:
                kind = ADDED
            elif was:
                kind = DELETED
            else:
                return None
        elif self.matches(change.kind, change.object):
            kind = change.type
        else:
            return None
        return WatchEvent(kind, change.kind, change.object, change.rv)

    def offer(self, event: WatchEvent) -> None:
        with self._cond:
            if self._stopped:
                return
            if len(self._queue) >= self.queue_limit:
                self._stop_locked(f"the consumer fell {self.queue_limit} events behind")
                return
            self._queue.append(event)
            self.last_offered_rv = max(self.last_offered_rv, event.resource_version)
            self._cond.notify_all()

    def bookmark(self, rv: int, annotations: dict[str, str] | None = None) -> None:
        meta: dict[str, Any] = {"resourceVersion": str(rv)}
        if annotations:
            meta["annotations"] = annotations
        self.offer(WatchEvent(BOOKMARK, self.kinds[0], {"kind": self.kinds[0], "metadata": meta}, rv))

    # -- consumer side --------------------------------------------------------------------

    def get(self, timeout: float | None = None) -> WatchEvent | None:
        """The next event, or None after `timeout` seconds or once stopped and drained."""
        with self._cond:
            if not self._queue and not self._stopped:
                self._cond.wait(timeout)
            if self._queue:
                return self._queue.popleft()
            return None

    def next_copy(self, timeout: float | None = None) -> WatchEvent | None:
        """Like get(), with a private copy of the object that the caller may modify."""
        event = self.get(timeout)
        if event is None:
            return None
        return WatchEvent(event.type, event.kind, clone(event.object), event.resource_version)

    @property
    def stopped(self) -> bool:
        """True once stopped and every queued event has been taken."""
        with self._cond:
            return self._stopped and not self._queue

    def pending(self) -> int:
        with self._cond:
            return len(self._queue)

    def __iter__(self) -> Iterator[WatchEvent]:
        while True:
            event = self.get()
            if event is None:
                if self.stopped:
                    return
                continue
            yield event

    def stop(self, reason: str = "stopped by its consumer") -> None:
        with self._cond:
            first = self._stop_locked(reason)
        # Outside our lock: the store takes its own lock to unregister us, and it takes ours
        # (in offer) while holding its own, so the order must never be ours-then-store's.
        if first and self._on_stop is not None:
            self._on_stop(self)

    def _stop_locked(self, reason: str) -> bool:
        if self._stopped:
            return False
        self._stopped = True
        self.stop_reason = reason
        self._cond.notify_all()
        return True

    @property
    def stopping(self) -> bool:
        """Stopped (possibly with events still queued): the store stops feeding it."""
        return self._stopped

    def __enter__(self) -> "Watcher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
