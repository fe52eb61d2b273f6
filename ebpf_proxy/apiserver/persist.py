"""The API server's objects on disk, so that a restarted lab API server keeps them (etcd's role).

kube-apiserver itself is stateless: its objects live in etcd and survive any restart of it. The
lab's API server keeps them in memory, so `--state-file` gives it the same property: the objects
are written there (atomically: a temporary file, fsync, rename, so a crash mid-write leaves the
previous state) shortly after every change and on shutdown, and read back at start.

What a restart keeps and what it does not, as with a real control plane:
- every object, with its uid, creationTimestamp and resourceVersion;
- resourceVersions keep increasing: the new instance starts above both the saved version and the
  clock (store.py starts from the clock in ms), so no version is ever issued twice;
- the watch history is *not* kept: a client resuming a watch from a version of the old instance
  gets 410 Expired ("too old resource version"), which is what makes client-go's Reflector (and
  ours, k8s/watch.py) relist and so see whatever changed while the server was down, including
  an edited state file (a restore from backup).

The file is JSON: {"apiVersion": "ebpf-proxy.lab/v1", "kind": "ApiServerState",
"resourceVersion": "N", "objects": [ {apiVersion, kind, metadata, ...}, ... ]}. Editing it while
the server is stopped is the supported way to start the server with another object set.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from ebpf_proxy.apiserver.store import Store

log = logging.getLogger(__name__)

API_VERSION = "ebpf-proxy.lab/v1"
KIND = "ApiServerState"
SAVE_INTERVAL = 0.2  # seconds between checks for changes to write


class StateFileError(ValueError):
    """The state file cannot be used; the message names the file and the field."""


def write_atomically(path: str | Path, text: str | bytes) -> None:
    """Write `text` to `path` so that readers (and a crash) see the old or the new file, never half."""
    path = str(path)
    tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
    try:
        with open(tmp, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def save(store: Store, path: str | Path) -> str:
    """Write the store's objects to `path`; returns the resourceVersion written.

    The text is json.dumps of {"apiVersion", "kind", "resourceVersion", "objects"} (the module
    docstring's format) with separators (",", ":"), byte for byte, but its objects are joined
    from the store's per-version encodings (Store.encoded, what a list serves) rather than
    encoded again: at 100,000 Services and their slices a save encoding all of them held the
    server's GIL ~3 s, and an endpoint change written meanwhile waited for it (2.8 s in the 100k
    bench of 2026-11-27, whose changes the agent had in the kernel in ~7 ms)."""
    rv, objects = store.export_encoded()
    head = json.dumps({"apiVersion": API_VERSION, "kind": KIND, "resourceVersion": rv}, separators=(",", ":"))
    write_atomically(path, head[:-1].encode() + b',"objects":[' + b",".join(objects) + b"]}")
    return rv


def read(path: str | Path) -> tuple[int, list[dict[str, Any]]]:
    """(saved resourceVersion, objects) from a state file; StateFileError names what is wrong."""
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        raise StateFileError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise StateFileError(f"{path}: not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise StateFileError(f"{path}: expected an object with apiVersion {API_VERSION!r} and kind {KIND!r}")
    for field, want in (("apiVersion", API_VERSION), ("kind", KIND)):
        if doc.get(field) != want:
            raise StateFileError(f"{path}: {field}: expected {want!r}, got {doc.get(field)!r}")
    try:
        rv = int(doc.get("resourceVersion"))
        if rv < 0:
            raise ValueError
    except (TypeError, ValueError):
        raise StateFileError(f"{path}: resourceVersion: {doc.get('resourceVersion')!r} is not a "
                             "non-negative integer") from None
    objects = doc.get("objects")
    if not isinstance(objects, list):
        raise StateFileError(f"{path}: objects: expected a list, got {type(objects).__name__}")
    return rv, objects


def load_store(path: str | Path, **store_args: Any) -> Store:
    """A Store holding the objects saved in `path`, issuing versions above the saved one.

    `store_args` go to Store (service CIDR, node-port range, ...); `initial_resource_version`
    is chosen here. The default namespaces the Store creates are replaced by the saved ones."""
    rv, objects = read(path)
    store_args.pop("initial_resource_version", None)
    store = Store(initial_resource_version=max(rv + 1, int(time.time() * 1000)), **store_args)
    try:
        store.restore_objects(objects)
    except ValueError as exc:
        store.close()
        raise StateFileError(f"{path}: {exc}") from None
    return store


def open_store(path: str | Path | None, **store_args: Any) -> Store:
    """The saved store if `path` exists, else a new one (the first start of a lab)."""
    if path is not None and Path(path).exists():
        return load_store(path, **store_args)
    return Store(**store_args)


class StateSaver:
    """Writes the store to its state file whenever its resourceVersion moved, and once at stop.

    Polling the version (every SAVE_INTERVAL) batches a burst of writes into one file write, and
    needs no hook in the store's write path. A write of a large store (10,000 Services in the
    benchmarks) takes a while and holds the GIL, so the next check waits at least WRITE_SHARE
    times as long as the last write took: saving never takes more than ~1/WRITE_SHARE of the
    server's time, however busy it is. The shutdown save makes stop/start lossless regardless.
    A failed write is logged and retried next round."""

    WRITE_SHARE = 10

    def __init__(self, store: Store, path: str | Path, interval: float = SAVE_INTERVAL) -> None:
        self.store, self.path, self.interval = store, Path(path), interval
        self._last_cost = 0.0
        self._saved_rv: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="apiserver-state-saver", daemon=True)

    def start(self) -> "StateSaver":
        self.save_if_changed()
        self._thread.start()
        return self

    def save_if_changed(self) -> bool:
        if self.store.resource_version == self._saved_rv:
            return False
        started = time.monotonic()
        try:
            self._saved_rv = save(self.store, self.path)
            self._last_cost = time.monotonic() - started
        except OSError as exc:
            log.error("cannot write the API server state to %s: %s", self.path, exc)
            return False
        return True

    def _run(self) -> None:
        while not self._stop.wait(max(self.interval, self.WRITE_SHARE * self._last_cost)):
            self.save_if_changed()

    def stop(self) -> None:
        """Stop the thread and write what changed since the last write (the shutdown save)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.save_if_changed()
