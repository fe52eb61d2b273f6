"""An embedded Kubernetes API server for the lab and for tests.

It serves the real REST protocol (JSON, watches with bookmarks and 410s, discovery, Tables)
for the kinds a service proxy needs, so the agent, the official Python client and kubectl
all work against it unchanged. `Store` is the in-process API (the lab and its controllers
use it directly); `ApiServer` puts it on one or more listening sockets.
"""

from ebpf_proxy.apiserver.errors import ApiError
from ebpf_proxy.apiserver.server import ApiServer, bind_socket, parse_host_port
from ebpf_proxy.apiserver.store import ListPage, Store
from ebpf_proxy.apiserver.watch import Watcher, WatchEvent

__all__ = ["ApiError", "ApiServer", "ListPage", "Store", "Watcher", "WatchEvent", "bind_socket", "parse_host_port"]
