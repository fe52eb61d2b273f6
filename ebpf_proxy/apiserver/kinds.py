"""The resource types this server serves, described once.

Routing, discovery documents, OpenAPI stubs, Table printing and the store all read this table,
so adding a resource is one entry here rather than a change in five places. A resource names
its *storage kind*: `events.k8s.io/v1` events are stored as `core/v1` events (as the real
server does) and converted at the edge.
"""

from __future__ import annotations

from dataclasses import dataclass

ALL_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")


@dataclass(frozen=True)
class ResourceType:
    group: str  # "" for the core group
    version: str
    plural: str
    kind: str
    namespaced: bool
    storage_kind: str
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    verbs: tuple[str, ...] = ALL_VERBS
    status_subresource: bool = False

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def singular(self) -> str:
        return self.kind.lower()

    @property
    def group_version_path(self) -> str:
        """`api/v1` or `apis/<group>/<version>`: the URL prefix without the leading slash."""
        return f"apis/{self.group}/{self.version}" if self.group else f"api/{self.version}"

    def collection_path(self, namespace: str | None = None) -> str:
        base = "/" + self.group_version_path
        if self.namespaced and namespace:
            return f"{base}/namespaces/{namespace}/{self.plural}"
        return f"{base}/{self.plural}"


SERVICES = ResourceType("", "v1", "services", "Service", True, "Service", ("svc",), ("all",), status_subresource=True)
PODS = ResourceType("", "v1", "pods", "Pod", True, "Pod", ("po",), ("all",), status_subresource=True)
NODES = ResourceType("", "v1", "nodes", "Node", False, "Node", ("no",), status_subresource=True)
NAMESPACES = ResourceType(
    "",
    "v1",
    "namespaces",
    "Namespace",
    False,
    "Namespace",
    ("ns",),
    verbs=("create", "delete", "get", "list", "patch", "update", "watch"),
    status_subresource=True,
)
EVENTS = ResourceType("", "v1", "events", "Event", True, "Event", ("ev",))
ENDPOINT_SLICES = ResourceType("discovery.k8s.io", "v1", "endpointslices", "EndpointSlice", True, "EndpointSlice")
EVENTS_V1 = ResourceType("events.k8s.io", "v1", "events", "Event", True, "Event", ("ev",))

RESOURCES: tuple[ResourceType, ...] = (SERVICES, PODS, NODES, NAMESPACES, EVENTS, ENDPOINT_SLICES, EVENTS_V1)

# The storage kinds, each with the resource type that is its canonical (stored) form.
STORAGE: dict[str, ResourceType] = {rt.kind: rt for rt in RESOURCES if rt.storage_kind == rt.kind and rt.group == ""}
STORAGE["EndpointSlice"] = ENDPOINT_SLICES

# group -> versions served, in preference order.
GROUPS: dict[str, tuple[str, ...]] = {"discovery.k8s.io": ("v1",), "events.k8s.io": ("v1",)}


def lookup(group: str, version: str, plural: str) -> ResourceType | None:
    for rt in RESOURCES:
        if rt.group == group and rt.version == version and rt.plural == plural:
            return rt
    return None


def storage_type(kind: str) -> ResourceType:
    """The canonical resource type of a storage kind; a clear error for anything unknown."""
    try:
        return STORAGE[kind]
    except KeyError:
        raise ValueError(f"unknown kind {kind!r}: this API server stores {sorted(STORAGE)}") from None


def resources_in(group: str, version: str) -> list[ResourceType]:
    return [rt for rt in RESOURCES if rt.group == group and rt.version == version]
