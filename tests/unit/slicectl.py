"""The lab's EndpointSlice controller running against an in-process Store, shared by the tests
that read what it writes (test_slicecontroller, test_topologyhints), so that both start, wait for
and stop it the same way and read its slices through one helper.

A test module imports the fixtures it uses (`from tests.unit.slicectl import controller, store`);
one that needs more in its Store (Nodes with zones) defines its own `store` and imports only
`controller`, which runs on whichever `store` the module has.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from ebpf_proxy.apiserver import Store
from ebpf_proxy.lab.slicecontroller import SERVICE_NAME_LABEL, EndpointSliceController


@contextmanager
def running_controller(store: Store, **options) -> Iterator[EndpointSliceController]:
    """A started controller that has caught up with `store`; stopped on the way out."""
    c = EndpointSliceController(store, **options).start()
    try:
        assert c.wait_synced(), "controller did not sync at start"
        yield c
    finally:
        c.stop()


@pytest.fixture
def store() -> Iterator[Store]:
    s = Store()
    yield s
    s.close()


@pytest.fixture
def controller(store) -> Iterator[EndpointSliceController]:
    with running_controller(store) as c:
        yield c


def slices(store: Store, controller: EndpointSliceController, name: str = "web") -> list[dict]:
    """Service `name`'s EndpointSlices, once the controller has caught up with every change."""
    assert controller.wait_synced(), "controller did not catch up"
    items, _ = store.list("EndpointSlice", "default", label_selector={SERVICE_NAME_LABEL: name})
    return items


def endpoints(store: Store, controller: EndpointSliceController, name: str = "web") -> list[dict]:
    """Every endpoint of service `name` over all its slices, ordered by address."""
    eps = [ep for s in slices(store, controller, name) for ep in s["endpoints"]]
    return sorted(eps, key=lambda ep: ep["addresses"][0])
