"""Events: stored once as core/v1, served as core/v1 and as events.k8s.io/v1.

The real server keeps one storage for both API groups, so an event the agent writes through
`events.k8s.io/v1` shows up in `kubectl get events` (core/v1) and vice versa. The two
versions differ only in field names (`regarding` vs `involvedObject`, `note` vs `message`,
...), mapped here both ways. Validation is the part that catches client bugs: events.k8s.io
requires `eventTime`, `reportingController`, `reportingInstance`, `action` and `reason`.
"""

from __future__ import annotations

import copy
from typing import Any

from ebpf_proxy.apiserver.errors import FieldError, invalid, not_supported, required

# core/v1 name -> events.k8s.io/v1 name, for the fields that differ.
_CORE_TO_V1 = {
    "involvedObject": "regarding",
    "message": "note",
    "source": "deprecatedSource",
    "firstTimestamp": "deprecatedFirstTimestamp",
    "lastTimestamp": "deprecatedLastTimestamp",
    "count": "deprecatedCount",
    "reportingComponent": "reportingController",
}
_V1_TO_CORE = {v: k for k, v in _CORE_TO_V1.items()}
EVENT_TYPES = ("Normal", "Warning")


def to_events_v1(event: dict[str, Any]) -> dict[str, Any]:
    """A stored core/v1 Event as events.k8s.io/v1."""
    out = {_CORE_TO_V1.get(k, k): copy.deepcopy(v) for k, v in event.items()}
    out["apiVersion"] = "events.k8s.io/v1"
    out["kind"] = "Event"
    return out


def from_events_v1(event: dict[str, Any]) -> dict[str, Any]:
    """An events.k8s.io/v1 Event as core/v1, for storage."""
    out = {_V1_TO_CORE.get(k, k): copy.deepcopy(v) for k, v in event.items()}
    out["apiVersion"] = "v1"
    out["kind"] = "Event"
    return out


def validate_events_v1(event: dict[str, Any]) -> list[FieldError]:
    """What `pkg/apis/core/validation/events.go` demands of a new-style event (checked in v1 names)."""
    errs: list[FieldError] = []
    for field in ("eventTime", "reportingController", "reportingInstance", "action", "reason"):
        if not event.get(field):
            errs.append(required(field))
    if len(str(event.get("reportingController") or "")) > 128:
        errs.append(invalid("reportingController", event["reportingController"], "can have at most 128 characters"))
    if len(str(event.get("reportingInstance") or "")) > 128:
        errs.append(invalid("reportingInstance", event["reportingInstance"], "can have at most 128 characters"))
    if len(str(event.get("note") or "")) > 1024:
        errs.append(invalid("note", "...", "can have at most 1024 characters"))
    return errs + _validate_common(event, "regarding")


def validate_core(event: dict[str, Any]) -> list[FieldError]:
    return _validate_common(event, "involvedObject")


def _validate_common(event: dict[str, Any], regarding_field: str) -> list[FieldError]:
    errs: list[FieldError] = []
    kind = event.get("type")
    if kind is not None and kind not in EVENT_TYPES:
        errs.append(not_supported("type", kind, EVENT_TYPES))
    regarding = event.get(regarding_field) or {}
    event_ns = (event.get("metadata") or {}).get("namespace", "")
    obj_ns = regarding.get("namespace") if isinstance(regarding, dict) else None
    if obj_ns and event_ns and obj_ns != event_ns:
        errs.append(invalid(f"{regarding_field}.namespace", obj_ns, f"does not match event.namespace ({event_ns!r})"))
    return errs
