"""API errors as the real server reports them: a `meta/v1 Status` with reason, code and causes.

Clients branch on `reason` and `code` (the agent relists on 410 Expired, kubectl prints
`message`), so every failure is raised as an `ApiError` carrying exactly what the real API
server would send, and field-level problems name the offending field (`spec.clusterIP`) the
way `field.ErrorList` does in Kubernetes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FieldError:
    """One problem with one field, formatted like Kubernetes' `field.Error`."""

    field: str
    type: str  # Required, Invalid, Duplicate, NotSupported, Forbidden
    value: Any = None
    detail: str = ""

    _REASONS = {
        "Required": ("FieldValueRequired", "Required value"),
        "Invalid": ("FieldValueInvalid", "Invalid value"),
        "Duplicate": ("FieldValueDuplicate", "Duplicate value"),
        "NotSupported": ("FieldValueNotSupported", "Unsupported value"),
        "Forbidden": ("FieldValueForbidden", "Forbidden"),
        "TooMany": ("FieldValueTooMany", "Too many"),
    }

    @property
    def reason(self) -> str:
        return self._REASONS[self.type][0]

    def body(self) -> str:
        """The message without the field path, as in a Status cause."""
        label = self._REASONS[self.type][1]
        parts = [label]
        if self.type in ("Invalid", "Duplicate", "NotSupported", "TooMany"):
            parts.append(json.dumps(self.value))
        if self.detail:
            parts.append(self.detail)
        return ": ".join(parts)

    def __str__(self) -> str:
        return f"{self.field}: {self.body()}"


def required(field: str, detail: str = "") -> FieldError:
    return FieldError(field, "Required", None, detail)


def invalid(field: str, value: Any, detail: str) -> FieldError:
    return FieldError(field, "Invalid", value, detail)


def duplicate(field: str, value: Any) -> FieldError:
    return FieldError(field, "Duplicate", value)


def not_supported(field: str, value: Any, supported: tuple[str, ...] | list[str]) -> FieldError:
    return FieldError(field, "NotSupported", value, "supported values: " + ", ".join(f'"{s}"' for s in supported))


def too_many(field: str, actual: int, limit: int) -> FieldError:
    return FieldError(field, "TooMany", actual, f"must have at most {limit} items")


def forbidden(field: str, detail: str) -> FieldError:
    return FieldError(field, "Forbidden", None, detail)


class ApiError(Exception):
    """A request failure that maps one-to-one onto an HTTP status and a `Status` object."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        *,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details

    def status(self) -> dict[str, Any]:
        """The `Status` object the server sends for this error."""
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details:
            body["details"] = self.details
        return body


def _details(resource: str, name: str, group: str = "") -> dict[str, Any]:
    details: dict[str, Any] = {"name": name, "kind": resource}
    if group:
        details["group"] = group
    return details


def qualified(resource: str, group: str) -> str:
    """`services` or `endpointslices.discovery.k8s.io`, as the real messages spell it."""
    return f"{resource}.{group}" if group else resource


def not_found(resource: str, name: str, group: str = "") -> ApiError:
    return ApiError(404, "NotFound", f'{qualified(resource, group)} "{name}" not found', details=_details(resource, name, group))


def already_exists(resource: str, name: str, group: str = "") -> ApiError:
    return ApiError(
        409, "AlreadyExists", f'{qualified(resource, group)} "{name}" already exists', details=_details(resource, name, group)
    )


def conflict(resource: str, name: str, why: str, group: str = "") -> ApiError:
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {qualified(resource, group)} "{name}": {why}',
        details=_details(resource, name, group),
    )


def invalid_object(kind: str, name: str, errors: list[FieldError], group: str = "") -> ApiError:
    """422 Invalid listing every field error, formatted like `errors.NewInvalid`."""
    if len(errors) == 1:
        summary = str(errors[0])
    else:
        summary = "[" + ", ".join(str(e) for e in errors) + "]"
    details = {
        "name": name,
        "kind": kind,
        "causes": [{"reason": e.reason, "message": e.body(), "field": e.field} for e in errors],
    }
    if group:
        details["group"] = group
    return ApiError(422, "Invalid", f'{kind}{"." + group if group else ""} "{name}" is invalid: {summary}', details=details)


def gone(message: str) -> ApiError:
    return ApiError(410, "Expired", message)


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def forbidden_request(message: str, resource: str = "", name: str = "") -> ApiError:
    return ApiError(403, "Forbidden", message, details=_details(resource, name) if resource else None)


def method_not_allowed(message: str) -> ApiError:
    return ApiError(405, "MethodNotAllowed", message)


def not_acceptable(message: str) -> ApiError:
    return ApiError(406, "NotAcceptable", message)


def unsupported_media_type(message: str) -> ApiError:
    return ApiError(415, "UnsupportedMediaType", message)


def timeout(message: str) -> ApiError:
    return ApiError(504, "Timeout", message)


class InvalidFields(Exception):
    """Field errors found by a kind's validation; the store wraps them into a 422 for the object."""

    def __init__(self, errors: list[FieldError]) -> None:
        super().__init__("; ".join(str(e) for e in errors))
        self.errors = errors
