"""Plain HTTP GETs from inside a lab namespace (agent /healthz, health-check NodePorts)."""

from __future__ import annotations

import http.client
from urllib.parse import urlsplit

from ebpf_proxy.lab._setns import run_in_netns


def _get(url: str, timeout: float) -> tuple[int, str]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    try:
        conn.request("GET", parts.path or "/")
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


def http_get(netns: str | None, url: str, timeout: float = 2.0) -> tuple[int, str]:
    """(status, body); status 0 with the error text when nothing answered."""
    try:
        return run_in_netns(netns, _get, url, timeout)
    except OSError as exc:
        return 0, str(exc)
