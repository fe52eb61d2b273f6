"""The lab's API server process: Store + EndpointSlice controller + HTTP listeners.

Run as `python -m ebpf_proxy.lab.apiserver_main`. It runs as its own process (not inside the
lab driver) so that node agents, kubectl and the test process all talk to it over HTTP,
exactly as they would to a real control plane, and so it can be killed and restarted.

Listeners inside a network namespace are bound by switching this thread into the namespace
(`setns(2)` on /run/netns/NAME), creating the socket, and switching back: a socket stays in
the namespace it was created in, so one process serves the root namespace and every node
namespace. Python 3.11 has no `os.setns`, hence ctypes.

The ready file is written atomically once every listener is bound, so the lab can wait for
it and learn which ephemeral ports were chosen.

With `--state-file` the objects survive a restart (apiserver/persist.py): the lab's
`lab apiserver stop|start|restart` uses it to take the control plane away and bring it back
as a real cluster's would come back, with its objects and newer resourceVersions.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading

import click

from ebpf_proxy.lab._setns import in_netns
from ebpf_proxy.apiserver import ApiServer, bind_socket, parse_host_port
from ebpf_proxy.apiserver.persist import StateFileError, StateSaver, open_store, write_atomically
from ebpf_proxy.lab.slicecontroller import EndpointSliceController

log = logging.getLogger("ebpf_proxy.lab.apiserver_main")

def bind_in_netns(netns: str, host: str, port: int) -> socket.socket:
    with in_netns(netns):
        return bind_socket(host, port)


def write_ready_file(path: str, listeners: list[tuple[str, int]]) -> None:
    """{"ports": {ARG: PORT}, "listeners": [{"listen": ARG, "port": PORT}, ...], "pid": PID}.

    "listeners" keeps the order and any repeats ("--listen 127.0.0.1:0" twice) that the
    "ports" map, keyed by argument, cannot.
    """
    doc = {
        "ports": {arg: port for arg, port in listeners},
        "listeners": [{"listen": arg, "port": port} for arg, port in listeners],
        "pid": os.getpid(),
    }
    write_atomically(path, json.dumps(doc))


def _parse_netns_listen(value: str) -> tuple[str, str, int]:
    netns, sep, address = value.partition("=")
    if not sep or not netns:
        raise click.BadParameter(f"{value!r} is not NETNS=HOST:PORT", param_hint="--listen-netns")
    try:
        host, port = parse_host_port(address)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--listen-netns") from None
    return netns, host, port


@click.command(
    epilog="\b\nExamples:\n"
    "  python -m ebpf_proxy.lab.apiserver_main --listen 127.0.0.1:0 --ready-file /tmp/apiserver.json\n"
    "  python -m ebpf_proxy.lab.apiserver_main --listen 127.0.0.1:6443 --listen-netns node1=10.0.0.1:6443\n"
    "\b\nThe ready file holds {\"ports\": {LISTEN-ARGUMENT: BOUND-PORT, ...}, \"listeners\": [{\"listen\":\n"
    "LISTEN-ARGUMENT, \"port\": BOUND-PORT}, ...], \"pid\": PID}, keyed by each --listen / --listen-netns\n"
    "value exactly as given (root-namespace listeners first, then the netns ones)."
)
@click.option("--listen", "listen", multiple=True, metavar="HOST:PORT",
              help="Listen in this (the root) network namespace; port 0 picks a free one. Repeatable.")
@click.option("--listen-netns", "listen_netns", multiple=True, metavar="NETNS=HOST:PORT",
              help="Listen inside network namespace /run/netns/NETNS. Repeatable.")
@click.option("--service-cidr", default="10.96.0.0/12", show_default=True, help="Range for Service cluster IPs.")
@click.option("--service-node-port-range", default="30000-32767", show_default=True, metavar="FIRST-LAST",
              help="Range for node ports and health-check node ports.")
@click.option("--bookmark-interval", default=1.0, show_default=True, type=float,
              help="Seconds between watch BOOKMARK events.")
@click.option("--state-file", type=click.Path(dir_okay=False),
              help="Keep the objects here across restarts: read at start if it exists, written after changes.")
@click.option("--ready-file", type=click.Path(dir_okay=False), help="Write the bound ports here once listening.")
@click.option("--log-file", type=click.Path(dir_okay=False), help="Log here instead of stderr.")
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
def main(listen: tuple[str, ...], listen_netns: tuple[str, ...], service_cidr: str, service_node_port_range: str,
         bookmark_interval: float, state_file: str | None, ready_file: str | None, log_file: str | None, log_level: str) -> None:
    """Run the lab's Kubernetes API server with its EndpointSlice controller until SIGTERM."""
    logging.basicConfig(filename=log_file, level=getattr(logging, log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not listen and not listen_netns:
        raise click.UsageError("give at least one --listen or --listen-netns")
    try:
        first, last = (int(x) for x in service_node_port_range.split("-"))
    except ValueError:
        raise click.BadParameter(f"{service_node_port_range!r} is not FIRST-LAST",
                                 param_hint="--service-node-port-range") from None
    netns_listeners = [_parse_netns_listen(v) for v in listen_netns]
    try:
        store = open_store(state_file, service_cidr=service_cidr, node_port_range=(first, last),
                           bookmark_interval=bookmark_interval)
    except StateFileError as exc:
        raise click.BadParameter(str(exc), param_hint="--state-file") from None
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--service-cidr") from None

    keys: list[str] = []
    sockets: list[socket.socket] = []
    try:
        for value in listen:
            try:
                host, port = parse_host_port(value)
            except ValueError as exc:
                raise click.BadParameter(str(exc), param_hint="--listen") from None
            sockets.append(bind_socket(host, port))
            keys.append(value)
        for value, (netns, host, port) in zip(listen_netns, netns_listeners):
            sockets.append(bind_in_netns(netns, host, port))
            keys.append(value)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise click.ClickException(f"cannot listen on {(listen + listen_netns)[len(sockets)]}: {exc}") from None

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    saver = StateSaver(store, state_file).start() if state_file else None
    controller = EndpointSliceController(store).start()
    server = ApiServer(store, sockets).start()
    listeners = [(key, addr[1]) for key, addr in zip(keys, server.addresses)]
    if ready_file:
        write_ready_file(ready_file, listeners)
    log.info("lab API server ready: %s", ", ".join(f"{k} -> {p}" for k, p in listeners))
    try:
        while not stop.wait(1.0):
            pass
    finally:
        log.info("lab API server stopping")
        server.stop()
        controller.stop()
        if saver is not None:
            saver.stop()
        store.close()
        if ready_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(ready_file)
    sys.exit(0)


if __name__ == "__main__":
    main()
