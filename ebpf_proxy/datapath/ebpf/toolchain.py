"""What the eBPF datapath needs from this machine, and the one preparation bcc needs: kernel headers.

`probe()` answers "can this node run the eBPF datapath, and if not, what exactly is missing" in
well under a second without compiling anything: it loads two-instruction programs of each type
we use, attaches them in a throw-away network namespace, and runs one with BPF_PROG_TEST_RUN.
`ensure_kernel_headers()` is what the loader calls before compiling: bcc insists on a kernel build
tree, which nodes running a distribution kernel without its headers package lack (see
PLATFORM.md); the Debian headers of another version compile our programs (UAPI and helpers only)
once merged into the single directory bcc reads.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ebpf_proxy.datapath.ebpf import libbpf, testrun

CACHE_DIR = Path("/var/cache/ebpf-proxy")
MODULES_DIR = Path("/lib/modules")
SRC_DIR = Path("/usr/src")
_COMPLETE_MARK = ".ebpf-proxy-complete"
# Debian's names for the kernel architecture suffix of linux-headers-<ver>-<arch>.
_DEBIAN_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "armmp", "ppc64le": "powerpc64le", "s390x": "s390x"}
_CLONE_NEWNET = 0x40000000


class KernelHeadersMissing(RuntimeError):
    """No headers bcc can compile against; the message names the package to install."""


@dataclass(frozen=True)
class KernelHeaders:
    """Where bcc should read kernel headers (BCC_KERNEL_SOURCE), and how that tree came to be."""

    path: Path
    origin: str  # "running kernel" or "fallback <version>"
    sources: tuple[Path, ...] = ()  # for a fallback: the Debian -common and -<arch> trees merged

    @property
    def ready(self) -> bool:
        if not self.sources:
            return (self.path / "include").is_dir()
        return (self.path / _COMPLETE_MARK).exists()


def _debian_arch() -> str:
    return _DEBIAN_ARCH.get(platform.machine(), platform.machine())


def _version_key(name: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", name))


def find_kernel_headers(
    release: str | None = None,
    modules_dir: Path = MODULES_DIR,
    src_dir: Path = SRC_DIR,
    cache_dir: Path = CACHE_DIR,
) -> KernelHeaders:
    """The running kernel's build tree when it exists; else the newest Debian headers pair, merged.

    Raises KernelHeadersMissing naming the package when neither is installed.
    """
    release = release or os.uname().release
    build = modules_dir / release / "build"
    if (build / "include").is_dir():
        return KernelHeaders(path=build.resolve(), origin="running kernel")
    arch = _debian_arch()
    pairs = []
    # The image keeps its own Debian headers apart (EBPF_PROXY_FALLBACK_SRC_DIR), because the
    # DaemonSet mounts the host's /usr/src over the image's.
    fallback = os.environ.get("EBPF_PROXY_FALLBACK_SRC_DIR")
    for root in (src_dir, *([Path(fallback)] if fallback else [])):
        for common in root.glob("linux-headers-*-common"):
            version = common.name.removeprefix("linux-headers-").removesuffix("-common")
            arch_tree = root / f"linux-headers-{version}-{arch}"
            if arch_tree.is_dir():
                pairs.append((version, common, arch_tree))
    if not pairs:
        raise KernelHeadersMissing(
            f"no kernel headers: {build} is absent and {src_dir} has no linux-headers-<version>-common"
            f" with a matching -{arch} tree; install the Debian package linux-headers-{arch}"
            f" (or linux-headers-{release})"
        )
    version, common, arch_tree = max(pairs, key=lambda p: _version_key(p[0]))
    return KernelHeaders(
        path=cache_dir / f"kernel-headers-{version}-{arch}",
        origin=f"fallback {version}-{arch} (running {release})",
        sources=(common, arch_tree),
    )


def _build_merged_tree(headers: KernelHeaders) -> None:
    """Symlink-copy -common, then -<arch> over it, into a temp dir renamed into place (atomic)."""
    headers.path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{headers.path.name}-", dir=headers.path.parent))
    try:
        tree = tmp / "tree"
        common, arch_tree = headers.sources
        subprocess.run(["cp", "-rs", str(common), str(tree)], check=True, capture_output=True)
        subprocess.run(["cp", "-rsf", f"{arch_tree}/.", f"{tree}/"], check=True, capture_output=True)
        (tree / _COMPLETE_MARK).touch()
        try:
            tree.rename(headers.path)
        except OSError:
            if not headers.ready:  # not another process winning the race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_kernel_headers(**kwargs) -> Path:
    """Make sure bcc can compile: build the fallback tree if needed and export BCC_KERNEL_SOURCE."""
    headers = find_kernel_headers(**kwargs)
    if not headers.ready:
        if headers.path.exists():  # a half-built tree from an interrupted run
            shutil.rmtree(headers.path)
        _build_merged_tree(headers)
    os.environ["BCC_KERNEL_SOURCE"] = str(headers.path)
    return headers.path


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def missing(self) -> list[str]:
        return [c.name for c in self.checks if not c.ok]

    def lines(self) -> list[str]:
        head = "ebpf: ready" if self.ok else f"ebpf: NOT ready (missing: {', '.join(self.missing)})"
        return [head] + [f"  {'ok' if c.ok else 'MISSING':8} {c.name:18} {c.detail}" for c in self.checks]


_BCC_CHECK = (
    "import json, pathlib, sys\n"
    "try:\n"
    "    import bcc\n"
    "except Exception as exc:\n"
    "    print(json.dumps({'error': f'{type(exc).__name__}: {exc}'})); sys.exit(0)\n"
    "print(json.dumps({'version': getattr(bcc, '__version__', '?'), 'path': str(pathlib.Path(bcc.__file__).parent)}))\n"
)


def _check_bcc() -> Check:
    """Whether bcc imports, asked of a child interpreter: importing bcc maps libbcc and LLVM, ~60 MiB
    of RSS a long-running agent would never get back (the compile runs in a child too, loader.py)."""
    try:
        done = subprocess.run([sys.executable, "-c", _BCC_CHECK], capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL)
        found = json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as exc:
        return Check("bcc", False, f"could not ask {sys.executable} whether bcc imports: {exc}")
    if "error" in found:
        return Check("bcc", False, f"python bcc not importable ({found['error']}): install the Debian package "
                                   "python3-bpfcc")
    return Check("bcc", True, f"bcc {found['version']} at {found['path']}")


def _check_headers(prepare: bool) -> Check:
    try:
        headers = find_kernel_headers()
        if prepare:
            ensure_kernel_headers()
    except (KernelHeadersMissing, OSError, subprocess.CalledProcessError) as exc:
        return Check("kernel-headers", False, str(exc))
    if headers.ready:
        return Check("kernel-headers", True, f"{headers.path} ({headers.origin})")
    return Check(
        "kernel-headers",
        True,
        f"{headers.origin}: tree {headers.path} is built on first load (or now by `ebpf-proxy doctor --prepare`)",
    )


def _load(prog_type: int, ret: int, attach: int = 0) -> int:
    return libbpf.prog_load(prog_type, libbpf.return_constant_program(ret), attach)


def _attach_in_throwaway_netns(tc_fd: int, xdp_fd: int) -> dict[str, str]:
    """Attach a clsact/cls_bpf filter and generic XDP to `lo` of a fresh netns, in a child process.

    The namespace dies with the child, so nothing on the node changes. Returns {check: error or ""}.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: touch nothing but its own new namespace, always _exit
        result = {"tc-clsact": "not run", "xdp": "not run"}
        try:
            os.close(read_end)
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.unshare(_CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET)")
            from pyroute2.iproute import IPRoute  # noqa: PLC0415 (only the child needs netlink)

            with IPRoute() as ipr:
                try:
                    ipr.tc("add", "clsact", index=1)
                    ipr.tc("add-filter", "bpf", index=1, handle=":1", fd=tc_fd, name="epx_probe",
                           parent="ffff:fff2", classid=1, direct_action=True)
                    result["tc-clsact"] = ""
                except Exception as exc:  # noqa: BLE001 (reported, not raised)
                    result["tc-clsact"] = f"clsact/cls_bpf attach failed: {exc}"
                try:
                    ipr.link("set", index=1, xdp={"attrs": [("IFLA_XDP_FD", xdp_fd), ("IFLA_XDP_FLAGS", 2)]})
                    result["xdp"] = ""
                except Exception as exc:  # noqa: BLE001
                    result["xdp"] = f"generic XDP attach failed: {exc}"
        except Exception as exc:  # noqa: BLE001
            result = {k: v if v != "not run" else str(exc) for k, v in result.items()}
        finally:
            os.write(write_end, json.dumps(result).encode())
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    try:
        return json.loads(data)
    except ValueError:
        return {"tc-clsact": "probe process died", "xdp": "probe process died"}


def _cgroup2_mount() -> str | None:
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) > 2 and fields[2] == "cgroup2":
                return fields[1]
    return None


def _kernel_checks() -> list[Check]:
    """Load one trivial program per type we use; attach and test-run what can be tried safely."""
    try:
        libbpf.lib()
    except libbpf.LibbpfMissing as exc:
        return [Check("libbpf", False, str(exc))]
    fds: list[int] = []
    checks = []

    def attempt(name: str, detail: str, fn: Callable[[], str | None]) -> bool:
        try:
            extra = fn()
        except OSError as exc:
            checks.append(Check(name, False, f"{detail}: {exc.strerror or exc}"))
            return False
        checks.append(Check(name, True, extra or detail))
        return True

    try:
        if not attempt("bpf-syscall", "bpf(BPF_PROG_LOAD)", lambda: fds.append(_load(libbpf.PROG_TYPE_SOCKET_FILTER, 0))):
            checks[-1] = Check("bpf-syscall", False, checks[-1].detail + " (needs root or CAP_BPF+CAP_NET_ADMIN, CONFIG_BPF_SYSCALL)")
            return checks
        tc_fd = _load(libbpf.PROG_TYPE_SCHED_CLS, 0)
        fds.append(tc_fd)
        xdp_fd = _load(libbpf.PROG_TYPE_XDP, 2)
        fds.append(xdp_fd)
        attached = _attach_in_throwaway_netns(tc_fd, xdp_fd)
        checks.append(Check("tc-clsact", not attached.get("tc-clsact"), attached.get("tc-clsact") or "SCHED_CLS on clsact (direct-action)"))
        checks.append(Check("xdp", not attached.get("xdp"), attached.get("xdp") or "XDP program load + generic attach"))

        def test_run() -> str:
            result = testrun.run(tc_fd, bytes(64))
            return f"BPF_PROG_TEST_RUN on SCHED_CLS (retval {result.retval})"

        attempt("prog-test-run", "BPF_PROG_TEST_RUN", test_run)
        mount = _cgroup2_mount()
        if mount is None:
            checks.append(Check("cgroup-sock-addr", False, "no cgroup2 mount (node-originated traffic needs cgroup v2)"))
        else:
            attempt(
                "cgroup-sock-addr",
                f"CGROUP_SOCK_ADDR connect4 (cgroup2 at {mount})",
                lambda: fds.append(_load(libbpf.PROG_TYPE_CGROUP_SOCK_ADDR, 1, libbpf.ATTACH_CGROUP_INET4_CONNECT)),
            )
    except OSError as exc:
        checks.append(Check("bpf-prog-types", False, f"loading SCHED_CLS/XDP failed: {exc.strerror or exc}"))
    except Exception as exc:  # noqa: BLE001 (a report, never a traceback, on a machine lacking BPF)
        checks.append(Check("bpf-probe", False, f"probe failed: {exc!r}"))
    finally:
        for fd in fds:
            os.close(fd)
    return checks


def _check_bpffs() -> Check:
    with open("/proc/filesystems") as fs:
        supported = any(line.split()[-1] == "bpf" for line in fs if line.strip())
    if not supported:
        return Check("bpffs", False, "kernel has no bpf filesystem (CONFIG_BPF_SYSCALL): maps cannot be pinned")
    return Check("bpffs", True, "bpf filesystem available (maps pinned across agent restarts)")


def probe(prepare: bool = False) -> Report:
    """Everything the eBPF datapath needs, one Check each. With `prepare`, build the header tree.

    Never raises for a missing feature: a machine without BPF gets a report, not a traceback.
    """
    report = Report([_check_bcc(), _check_headers(prepare), _check_bpffs()])
    if os.geteuid() != 0:
        report.checks.append(Check("root", False, "kernel checks need root (CAP_BPF, CAP_NET_ADMIN, CAP_SYS_ADMIN)"))
        return report
    report.checks.extend(_kernel_checks())
    return report
