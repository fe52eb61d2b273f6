"""Kubernetes service semantics as pure Python (no kubernetes client, no bcc, no netlink)."""

from ebpf_proxy.model.categorize import EndpointSets, categorize
from ebpf_proxy.model.tracker import ChangeTracker, NodeState
from ebpf_proxy.model.types import (
    DEFAULT_AFFINITY_TIMEOUT_SECONDS,
    ChangeSet,
    ConntrackLimits,
    Endpoint,
    LocalDetector,
    LocalMode,
    NodeConfig,
    NodeTopology,
    Protocol,
    ProxyState,
    ServicePort,
    ServicePortName,
    networks_of_family,
    of_family,
)

__all__ = [
    "DEFAULT_AFFINITY_TIMEOUT_SECONDS",
    "ChangeSet",
    "ChangeTracker",
    "ConntrackLimits",
    "Endpoint",
    "EndpointSets",
    "LocalDetector",
    "LocalMode",
    "NodeConfig",
    "NodeState",
    "NodeTopology",
    "Protocol",
    "ProxyState",
    "ServicePort",
    "ServicePortName",
    "categorize",
    "networks_of_family",
    "of_family",
]
