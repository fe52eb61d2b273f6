"""The connection to the API server, and the three collections the agent watches.

Credentials come from where kube-proxy gets them: `--kubeconfig` (optionally with `--master`
overriding its server), `--master` alone (an insecure local URL), or the in-cluster service
account. Lists and watches are requested with `_preload_content=False` and parsed as plain JSON,
so that a malformed object reaches convert.py (which skips it) instead of failing inside the
client's generated models.

The agent only reads services, endpointslices and nodes (see resources.AGENT_API_CALLS).
"""

from __future__ import annotations

import json
import logging
import random
from typing import Any, Callable, Iterator

from kubernetes import client as kclient
from kubernetes import config as kconfig
from kubernetes.watch.watch import iter_resp_lines

log = logging.getLogger(__name__)

# kube-proxy ignores services (and their slices) claimed by another proxy, and headless ones.
PROXY_LABEL_SELECTOR = "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless"
PAGE_SIZE = 500
LIST_TIMEOUT_SECONDS = 60
# Watches are renewed every 5-10 minutes (client-go's spread) so that a silently dead connection
# cannot hide changes for long; reads time out a bit after the server should have ended the watch.
WATCH_TIMEOUT_RANGE = (300, 600)
CONNECT_TIMEOUT_SECONDS = 10


class ClientConfigError(Exception):
    """No usable way to reach the API server (names the flag or file at fault)."""


def make_api_client(kubeconfig: str = "", master: str = "") -> kclient.ApiClient:
    """An ApiClient for --kubeconfig/--master, or the in-cluster service account."""
    if kubeconfig:
        try:
            api = kconfig.new_client_from_config(config_file=kubeconfig, persist_config=False)
        except Exception as exc:
            raise ClientConfigError(f"--kubeconfig {kubeconfig}: {exc}") from exc
        if master:
            api.configuration.host = master
        return api
    configuration = kclient.Configuration()
    if master:
        configuration.host = master
        return kclient.ApiClient(configuration)
    try:
        kconfig.load_incluster_config(client_configuration=configuration)
    except kconfig.ConfigException as exc:
        raise ClientConfigError(
            f"neither --kubeconfig nor --master was given and the in-cluster config is unusable: {exc}"
        ) from exc
    return kclient.ApiClient(configuration)


class ListError(Exception):
    """A LIST answered with something that is not a list object."""


class WatchStream:
    """Watch events of one HTTP response, parsed line by line into dicts."""

    def __init__(self, kind: str, response: Any) -> None:
        self.kind = kind
        self._response = response
        self._lines = iter_resp_lines(response)

    def __iter__(self) -> "WatchStream":
        return self

    def __next__(self) -> Any:
        while True:
            line = next(self._lines)
            if not line.strip():
                continue
            try:
                return json.loads(line)
            except ValueError:
                raise ListError(f"{self.kind} watch: unparsable event line {line[:80]!r}") from None

    def interrupt(self) -> None:
        """Unblock a read in progress from another thread (urllib3's shutdown)."""
        shutdown = getattr(self._response, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def close(self) -> None:
        self._response.close()
        self._response.release_conn()


class ListPages:
    """The items of a paged LIST as the pages' JSON text, decoded one page at a time whenever it is
    iterated. The text of 10,000 Services is a quarter of their decoded dicts, and the Reflector
    turns each object into the model and drops it, so the agent's peak memory no longer holds a
    whole decoded LIST. Every page was decoded and checked once when it arrived, so iterating
    cannot fail."""

    def __init__(self) -> None:
        self._pages: list[bytes] = []
        self._count = 0

    def add(self, data: bytes, count: int) -> None:
        if count:
            self._pages.append(data)
            self._count += count

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[Any]:
        for data in self._pages:
            yield from json.loads(data).get("items") or ()


class KubeListWatch:
    """`watch.ListWatch` over one list call of the kubernetes client (e.g. list_node)."""

    def __init__(self, kind: str, call: Callable[..., Any], *, label_selector: str | None = None,
                 field_selector: str | None = None, page_size: int = PAGE_SIZE) -> None:
        self.kind = kind
        self._call = call
        self._selectors: dict[str, str] = {}
        if label_selector:
            self._selectors["label_selector"] = label_selector
        if field_selector:
            self._selectors["field_selector"] = field_selector
        self._page_size = page_size

    def list(self) -> tuple[ListPages, str]:
        items = ListPages()
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = dict(self._selectors, limit=self._page_size, _preload_content=False,
                                          _request_timeout=(CONNECT_TIMEOUT_SECONDS, LIST_TIMEOUT_SECONDS))
            if token:
                kwargs["_continue"] = token
            response = self._call(**kwargs)
            try:
                body = json.loads(response.data)
            except ValueError as exc:
                raise ListError(f"{self.kind} list: response is not JSON: {exc}") from None
            finally:
                response.release_conn()
            if not isinstance(body, dict):
                raise ListError(f"{self.kind} list: response is not a list object")
            page, meta = body.get("items"), body.get("metadata")
            if not isinstance(page, (list, type(None))) or not isinstance(meta, (dict, type(None))):
                raise ListError(f"{self.kind} list: response has no items list")
            items.add(response.data, len(page or ()))
            del body, page
            meta = meta or {}
            token = meta.get("continue")
            if not token:
                rv = meta.get("resourceVersion")
                return items, rv if isinstance(rv, str) else ""

    def watch(self, resource_version: str) -> WatchStream:
        timeout = random.randint(*WATCH_TIMEOUT_RANGE)
        response = self._call(
            **self._selectors, watch=True, resource_version=resource_version or None, allow_watch_bookmarks=True,
            timeout_seconds=timeout, _preload_content=False,
            _request_timeout=(CONNECT_TIMEOUT_SECONDS, timeout + 30),
        )
        return WatchStream(self.kind, response)


def agent_collections(api: kclient.ApiClient, node_name: str) -> dict[str, KubeListWatch]:
    """Services, EndpointSlices and this node's Node: everything the agent watches."""
    core = kclient.CoreV1Api(api)
    discovery = kclient.DiscoveryV1Api(api)
    return {
        "Service": KubeListWatch("Service", core.list_service_for_all_namespaces,
                                 label_selector=PROXY_LABEL_SELECTOR),
        "EndpointSlice": KubeListWatch("EndpointSlice", discovery.list_endpoint_slice_for_all_namespaces,
                                       label_selector=PROXY_LABEL_SELECTOR),
        "Node": KubeListWatch("Node", core.list_node, field_selector=f"metadata.name={node_name}"),
    }
