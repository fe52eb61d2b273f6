"""How k8s/ reports API content it cannot use, without ever raising.

The agent must never crash on what the API server sends, but silently dropping a broken object
hides real problems. So every rejection goes through one place: one structured log line that names
the object (kind, namespace/name) and the field at fault, plus a callback the agent wires to the
`ebpf_proxy_invalid_objects_total{kind,reason}` counter. k8s/ cannot import agent/ (layering), hence
the callback rather than a metric imported here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger(__name__)

# Reasons are metric label values: a small closed set, never free text.
MISSING_FIELD = "missing_field"
WRONG_TYPE = "wrong_type"
INVALID_IP = "invalid_ip"
INVALID_CIDR = "invalid_cidr"
WRONG_FAMILY = "wrong_family"
PORT_OUT_OF_RANGE = "port_out_of_range"
UNKNOWN_PROTOCOL = "unknown_protocol"
INVALID_VALUE = "invalid_value"
MALFORMED = "malformed"


@dataclass(frozen=True)
class Invalid:
    """One rejected object (or part of one)."""

    kind: str  # "Service", "EndpointSlice", "Node"
    obj: str  # namespace/name ("?" when the object has no usable name)
    field: str  # JSON path of the offending field, e.g. "spec.ports[1].port"
    reason: str  # one of the constants above
    detail: str  # the offending value or why it is wrong
    skipped: str  # what was dropped: "object", "port", "endpoint", "ip", "event", "hints", "label"


Reporter = Callable[[Invalid], None]


def ignore(_: Invalid) -> None:
    """Default reporter: the log line is still written by `report`."""


def report(reporter: Reporter | None, problem: Invalid) -> None:
    """Log one line for `problem` and hand it to `reporter` (which must not raise into k8s/)."""
    log.warning(
        "invalid %s %s: %s: %s (skipping the %s)",
        problem.kind, problem.obj, problem.field, problem.detail, problem.skipped,
        extra={"kind": problem.kind, "object": problem.obj, "field": problem.field,
               "reason": problem.reason, "skipped": problem.skipped},
    )
    if reporter is None:
        return
    try:
        reporter(problem)
    except Exception:  # a broken metrics hook must not turn bad input into a crash
        log.exception("invalid-object reporter failed", extra={"kind": problem.kind, "object": problem.obj})
