"""The datapath registry: a mode name → its implementation, imported only when asked for.

Lazy imports keep `ebpf-proxy run --mode iptables` working on a machine without bcc, and keep the
control plane importable while an implementation is being written. The agent and the cleanup
command only know mode names; this module is the one place that maps them to classes.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from typing import Any

from ebpf_proxy.datapath.base import Datapath, SyncResult
from ebpf_proxy.model import NodeConfig

log = logging.getLogger(__name__)

# mode → (module, class)
MODES: dict[str, tuple[str, str]] = {
    "iptables": ("ebpf_proxy.datapath.iptables", "IptablesDatapath"),
    "ebpf": ("ebpf_proxy.datapath.ebpf", "EbpfDatapath"),
    "fake": ("ebpf_proxy.datapath.fake", "FakeDatapath"),
}
# Modes that leave state in the kernel, in the order `ebpf-proxy cleanup` removes it.
KERNEL_MODES = ("ebpf", "iptables")

__all__ = ["KERNEL_MODES", "MODES", "Datapath", "DatapathUnavailable", "SyncResult", "create_datapath",
           "datapath_class", "resolve_auto_mode"]


class DatapathUnavailable(RuntimeError):
    """The mode's implementation cannot be imported on this machine (or does not exist yet)."""


def datapath_class(mode: str) -> type[Datapath]:
    if mode not in MODES:
        raise ValueError(f"mode: {mode!r} is not one of {', '.join(MODES)}")
    module_name, class_name = MODES[mode]
    try:
        module = importlib.import_module(module_name)
        return getattr(module, class_name)
    except (ImportError, AttributeError) as exc:
        raise DatapathUnavailable(f"mode {mode}: {module_name}.{class_name} is not available: {exc}") from exc


def create_datapath(mode: str, node: NodeConfig, **opts: Any) -> Datapath:
    """An instance of `mode`'s datapath for `node`.

    `opts` (e.g. cgroup_path, bpffs for ebpf) are passed when the implementation's constructor
    accepts them and are not None; the others are dropped with a debug log, so the agent can pass
    every option it has without knowing which mode wants which."""
    cls = datapath_class(mode)
    params = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {}
    for key, value in opts.items():
        if value is None:
            continue
        if takes_any or key in params:
            kwargs[key] = value
        else:
            log.debug("mode %s does not take option %s; ignored", mode, key, extra={"mode": mode, "option": key})
    return cls(node, **kwargs)


def resolve_auto_mode() -> str:
    """`--mode auto`: ebpf when this machine can run it, else iptables, with one log line saying why."""
    reason = _ebpf_unusable_reason()
    if reason is None:
        log.info("mode auto: using ebpf (toolchain probe passed)", extra={"mode": "ebpf"})
        return "ebpf"
    log.warning("mode auto: using iptables because %s", reason, extra={"mode": "iptables", "reason": reason})
    return "iptables"


def _ebpf_unusable_reason() -> str | None:
    try:
        from ebpf_proxy.datapath.ebpf import toolchain
    except ImportError as exc:
        return f"the eBPF toolchain probe is not available ({exc})"
    try:
        report = toolchain.probe()
    except Exception as exc:  # the probe promises not to raise; a bug in it must not stop the agent
        return f"the eBPF toolchain probe failed: {exc}"
    if not getattr(report, "ok", False):
        missing = getattr(report, "missing", None) or ["unknown"]
        return f"the eBPF toolchain probe found missing: {', '.join(missing)}"
    try:
        datapath_class("ebpf")
    except DatapathUnavailable as exc:
        return str(exc)
    return None
