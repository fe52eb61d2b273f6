"""Where a lab keeps what it knows about itself, so any command from any shell finds it.

One directory per lab under /run (tmpfs: a reboot removes the namespaces and this together):
`state.json` (names, pids, addresses), the kubeconfigs, per-node agent configs and logs.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

STATE_ROOT = Path(os.environ.get("EBPF_PROXY_LAB_ROOT", "/run/ebpf-proxy/labs"))
DEFAULT_LAB = "lab"
# The lab agents' program cache (--bpf-cache-dir): every node of every lab built from the same
# sources and map sizes shares one compile. Removed by `lab down --all`.
BPF_CACHE = STATE_ROOT.parent / "bpf-cache"


class LabNotFound(RuntimeError):
    pass


def lab_dir(name: str) -> Path:
    return STATE_ROOT / name


def state_path(name: str) -> Path:
    return lab_dir(name) / "state.json"


def load(name: str) -> dict[str, Any]:
    path = state_path(name)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise LabNotFound(f"lab {name!r} is not up (no {path}); start it with `ebpf-proxy lab up --name {name}`") from None


def save(name: str, state: dict[str, Any]) -> None:
    """Write atomically: a crash mid-write must not leave a lab nobody can take down."""
    path = state_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True))
    os.replace(tmp, path)


def exists(name: str) -> bool:
    return state_path(name).exists()


def known_labs() -> list[str]:
    if not STATE_ROOT.is_dir():
        return []
    return sorted(p.name for p in STATE_ROOT.iterdir() if p.is_dir())


def remove(name: str) -> None:
    shutil.rmtree(lab_dir(name), ignore_errors=True)
