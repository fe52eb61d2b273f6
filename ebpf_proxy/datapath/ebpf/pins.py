"""The datapath's objects under bpffs: where they live, how a later process finds them, how they go.

Layout, under <bpffs>/ebpf-proxy/ (the pin directory):

    epx_*             the maps (created or re-opened by loader.py): services, backends and the
                      connection table outlive the agent, so traffic and established connections
                      keep flowing while it restarts
    progs/<build>/*   the loaded programs of the current build (loader.py): a restarted agent of
                      the same build re-opens them instead of compiling
    links/<program>   the socket-LB programs' cgroup attachments, as pinned BPF links: they stay
                      attached with no process holding them, a restarted agent swaps the program
                      behind them atomically (bpf_link_update), and cleanup finds them without
                      being told which cgroup they are on

Finding the pin directory without being told (a fresh `ebpf-proxy cleanup` that got no --bpffs):
every datapath writes the cookie of the network namespace it serves into epx_config
(host_netns_cookie, which the socket LB needs anyway). Cleanup reads its own namespace's cookie
and looks, in every bpf mount, for the epx_config holding it. Netns cookies are never reused
while the machine is up, so this never picks another node's (or another lab's) directory.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import shutil
import socket
from pathlib import Path

from ebpf_proxy.datapath.ebpf import libbpf, loader
from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import Maps

log = logging.getLogger(__name__)

PIN_SUBDIR = "ebpf-proxy"
LINKS_SUBDIR = "links"
SO_NETNS_COOKIE = 71  # Linux 5.14+; not exported by Python's socket module

# socket-LB program -> the cgroup hook it goes on (IPv4 and IPv6 sockets): one table with the loader's
CGROUP_PROGRAMS: dict[str, int] = loader.CGROUP_ATTACH


class AttachError(RuntimeError):
    """A program could not be attached or detached; the message names the program and the target."""


def pin_dir(bpffs: str | Path) -> Path:
    return Path(bpffs) / PIN_SUBDIR


def prepare(bpffs: str | Path) -> Path:
    """Mount bpffs at `bpffs` unless it already is one (creating the directory), and create the
    pin directory in it. Returns the pin directory."""
    root = Path(bpffs)
    if not loader.on_bpffs(root):
        loader.mount_bpffs(root)
    pins = pin_dir(root)
    (pins / LINKS_SUBDIR).mkdir(parents=True, exist_ok=True)
    return pins


def netns_cookie() -> int:
    """The calling thread's network namespace cookie; 0 when the kernel cannot tell (pre-5.14)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            return int.from_bytes(sock.getsockopt(socket.SOL_SOCKET, SO_NETNS_COOKIE, 8), "little")
    except OSError:
        return 0


def bpf_mounts() -> list[Path]:
    """Every bpf filesystem mount point of this mount namespace."""
    with open("/proc/self/mounts") as mounts:
        fields = [line.split() for line in mounts]
    return [Path(f[1].replace("\\040", " ")) for f in fields if len(f) > 2 and f[2] == "bpf"]


def pinned_netns_cookie(pins: Path) -> int | None:
    """host_netns_cookie of the epx_config pinned in `pins`, or None (no config, or not ours)."""
    path = pins / "epx_config"
    try:
        fd = libbpf.obj_get(str(path))
    except OSError:
        return None
    try:
        info = libbpf.map_info(fd)
        if info.value_size != ctypes.sizeof(s.LB4Config):
            return None
        value = s.LB4Config()
        if not libbpf.map_lookup(fd, s.u32(0), value):
            return None
        return value.host_netns_cookie
    except OSError:
        return None
    finally:
        os.close(fd)


def find_pin_dirs(cookie: int) -> list[Path]:
    """Pin directories, in any bpf mount, of a datapath serving the netns with `cookie`."""
    if not cookie:
        return []
    try:
        libbpf.lib()
    except libbpf.LibbpfMissing:  # then nothing of ours can have been pinned from this install
        return []
    return [pin_dir(m) for m in bpf_mounts() if pinned_netns_cookie(pin_dir(m)) == cookie]


def open_maps(bpffs: str | Path) -> Maps:
    """The pinned maps of the datapath under `bpffs`, without compiling anything (stats, tests)."""
    return Maps.open_pinned(pin_dir(bpffs))


# ---- cgroup attachments, as pinned links ----


def _cgroup_id(cgroup: Path) -> int:
    return os.stat(cgroup).st_ino  # a cgroup v2 directory's inode number is its cgroup id


def attach_cgroup(pins: Path, prog_fds: dict[str, int], cgroup: Path | None) -> int:
    """Make the socket-LB programs attached to `cgroup` (None: to no cgroup) through the links
    pinned in `pins`: an existing link on that cgroup gets the new program swapped in, a link on
    another cgroup is detached first. Returns how many links were created or updated."""
    links = pins / LINKS_SUBDIR
    links.mkdir(parents=True, exist_ok=True)
    wanted = _cgroup_id(cgroup) if cgroup is not None else None
    done = 0
    for name, attach_type in CGROUP_PROGRAMS.items():
        pin = links / name
        if pin.exists():
            fd = libbpf.obj_get(str(pin))
            try:
                if wanted is not None and libbpf.link_info(fd).cgroup_id == wanted:
                    libbpf.link_update(fd, prog_fds[name])
                    done += 1
                    continue
                with contextlib.suppress(OSError):  # its cgroup may be gone already
                    libbpf.link_detach(fd)
            except OSError as exc:
                raise AttachError(f"cgroup link {pin}: updating it to program {name} failed: {exc}") from exc
            finally:
                os.close(fd)
            pin.unlink()
        if cgroup is None:
            continue
        try:
            target = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise AttachError(f"cgroup {cgroup}: cannot open it for {name}: {exc}") from exc
        try:
            fd = libbpf.link_create(prog_fds[name], target, attach_type)
            try:
                libbpf.obj_pin(fd, str(pin))
            finally:
                os.close(fd)
        except OSError as exc:
            raise AttachError(f"cgroup {cgroup}: attaching {name} failed: {exc}") from exc
        finally:
            os.close(target)
        done += 1
    return done


def detach_cgroup(pins: Path) -> int:
    """Detach and unpin every cgroup link pinned in `pins`. Returns how many. Idempotent."""
    links = pins / LINKS_SUBDIR
    if not links.is_dir():
        return 0
    count = 0
    for pin in sorted(links.iterdir()):
        try:
            fd = libbpf.obj_get(str(pin))
        except OSError:
            fd = -1  # not a link (or not ours): just unpin it
        if fd >= 0:
            try:
                libbpf.link_detach(fd)
                count += 1
            except OSError as exc:
                if exc.errno not in (errno.ENOLINK, errno.EINVAL, errno.ENOENT):
                    raise AttachError(f"cgroup link {pin}: detaching failed: {exc}") from exc
            finally:
                os.close(fd)
        pin.unlink()
    return count


def detach_cgroup_programs(cgroup: Path) -> int:
    """Detach socket-LB programs attached to `cgroup` without a link (BPF_PROG_ATTACH, as older
    builds and the attach tests do), recognised by their program names. Returns how many."""
    try:
        target = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return 0
    count = 0
    try:
        for name, attach_type in CGROUP_PROGRAMS.items():
            try:
                ids = libbpf.prog_query(target, attach_type)
            except OSError as exc:
                raise AttachError(f"cgroup {cgroup}: listing its {name} programs failed: {exc}") from exc
            for prog_id in ids:
                try:
                    fd = libbpf.prog_fd_by_id(prog_id)
                except OSError:
                    continue  # gone meanwhile
                try:
                    if libbpf.prog_info(fd)[0].name.decode() != name:
                        continue
                    libbpf.prog_detach(fd, target, attach_type)
                    count += 1
                except OSError as exc:
                    if exc.errno != errno.ENOENT:  # attached through a link: detach_cgroup's job
                        log.debug("cgroup %s: program %d (%s) not detached: %s", cgroup, prog_id, name, exc)
                finally:
                    os.close(fd)
    finally:
        os.close(target)
    return count


def remove(pins: Path) -> bool:
    """Detach the cgroup links and unpin everything in `pins`, then remove it. Returns whether it
    existed. The maps go once no program uses them any more (detach the devices first)."""
    if not pins.is_dir():
        return False
    detach_cgroup(pins)
    shutil.rmtree(pins)
    return True
