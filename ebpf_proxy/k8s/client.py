"""The connection to the API server, and the three collections the agent watches.

Credentials come from where kube-proxy gets them: `--kubeconfig` (optionally with `--master`
overriding its server), `--master` alone (an insecure local URL), or the in-cluster service
account. Lists and watches are requested with `_preload_content=False` and parsed as plain JSON,
so that a malformed object reaches convert.py (which skips it) instead of failing inside the
client's generated models (with orjson where it reads the text as json would: k8s/jsontext.py).

The agent only reads services, endpointslices and nodes (see resources.AGENT_API_CALLS), by path
(CollectionGet): the official client loads the kubeconfig (in a child, k8s/kubeconfig.py) or the
service account, and its REST layer carries the requests (auth, TLS, timeouts, urllib3), but its
generated ApiClient, API classes and models are never imported. CoreV1Api alone brings ~250
model modules, ~21 MiB of the agent's ~86 MiB with one Service (issue 12);
tests/unit/test_k8s_path_calls.py keeps them out of the agent's process.
"""

from __future__ import annotations

import logging
import random
from typing import Any, Callable, Generator, Iterator
from urllib.parse import quote

# Submodules by name: `kubernetes.client` is a lazy package whose attributes import the generated
# API classes and models on first use, and `kubernetes.config`'s __init__ imports the kubeconfig
# loader, which the agent runs in a child (k8s/kubeconfig.py).
from kubernetes.client import __version__ as CLIENT_VERSION
from kubernetes.client.configuration import Configuration
from kubernetes.client.exceptions import ApiException
from kubernetes.client.rest import RESTClientObject
from kubernetes.config.config_exception import ConfigException
from kubernetes.watch.watch import iter_resp_lines
from urllib3.exceptions import MaxRetryError, ReadTimeoutError
from urllib3.util.retry import Retry

from ebpf_proxy.k8s import kubeconfig
from ebpf_proxy.k8s.jsontext import loads

log = logging.getLogger(__name__)

# kube-proxy ignores services (and their slices) claimed by another proxy, and headless ones.
PROXY_LABEL_SELECTOR = "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless"
PAGE_SIZE = 500
LIST_TIMEOUT_SECONDS = 60
# Watches are renewed every 5-10 minutes (client-go's spread of timeoutSeconds): the server ends
# each one, and the Reflector starts the next from the last resourceVersion.
WATCH_TIMEOUT_RANGE = (300, 600)
CONNECT_TIMEOUT_SECONDS = 10
# A watch that delivers no byte (no event, no BOOKMARK) for this long is taken as hung: a frozen,
# overloaded or partitioned API server can keep the TCP connection open and say nothing, and
# timeoutSeconds alone would leave the agent blind for up to 10 minutes. kube-apiserver's watch
# cache sends every bookmark-allowing watch a BOOKMARK about once a minute (the cacher's
# bookmark frequency), so 90 s of silence is more than a quiet cluster. client-go gets the same
# protection over HTTP/2 from its connection health check (a PING after 30 s without a frame,
# dropped after 15 s more without an answer); over HTTP/1.1 a read timeout is the only signal.
WATCH_IDLE_TIMEOUT_SECONDS = 90.0


class ClientConfigError(Exception):
    """No usable way to reach the API server (names the flag or file at fault)."""


def _configuration() -> Configuration:
    """A client configuration whose requests are not re-sent after a read timeout.

    urllib3 retries an idempotent request 3 times by default, read timeouts included, so a watch
    waiting for the headers of a frozen API server would take 4 idle timeouts to fail. The
    Reflector already retries with backoff; one layer of retries is enough."""
    configuration = Configuration()
    configuration.retries = Retry(total=3, read=0)
    return configuration


class KubeApi:
    """The official client's REST layer (its urllib3 pool: TLS, retries, timeouts) and its
    Configuration (host, credentials): what the generated ApiClient sends requests through,
    without the ApiClient itself, whose module imports pydantic and the response models' machinery
    (~4 MiB of the agent's RSS, issue 12). CollectionGet builds the request the ApiClient would;
    tests/unit/test_k8s_path_calls.py holds the two byte for byte equal."""

    # the generated ApiClient's default User-Agent (api_client.py), for this client version
    USER_AGENT = f"OpenAPI-Generator/{CLIENT_VERSION}/python"

    def __init__(self, configuration: Configuration) -> None:
        self.configuration = configuration
        self.rest_client = RESTClientObject(configuration)


def make_api_client(kubeconfig_path: str = "", master: str = "") -> KubeApi:
    """The client for --kubeconfig/--master, or the in-cluster service account."""
    configuration = _configuration()
    if kubeconfig_path:
        try:
            kubeconfig.load(kubeconfig_path, configuration)
        except Exception as exc:
            raise ClientConfigError(f"--kubeconfig {kubeconfig_path}: {exc}") from exc
        if master:
            configuration.host = master
        return KubeApi(configuration)
    if master:
        configuration.host = master
        return KubeApi(configuration)
    # the submodule, not `kubernetes.config`: the agent leaves that package's __init__ (which
    # imports the kubeconfig loader) unrun, see bareimport.py
    from kubernetes.config.incluster_config import load_incluster_config
    try:
        load_incluster_config(client_configuration=configuration)
    except ConfigException as exc:
        raise ClientConfigError(
            f"neither --kubeconfig nor --master was given and the in-cluster config is unusable: {exc}"
        ) from exc
    return KubeApi(configuration)


# The keywords of the generated list methods (list_node, list_service_for_all_namespaces, ...)
# KubeListWatch uses, and their query parameters, in the generated code's order.
_QUERY_PARAMETERS = (
    ("allow_watch_bookmarks", "allowWatchBookmarks"),
    ("_continue", "continue"),
    ("field_selector", "fieldSelector"),
    ("label_selector", "labelSelector"),
    ("limit", "limit"),
    ("resource_version", "resourceVersion"),
    ("timeout_seconds", "timeoutSeconds"),
    ("watch", "watch"),
)
_KEYWORDS = frozenset(keyword for keyword, _ in _QUERY_PARAMETERS)


def _query_value(value: Any) -> str:
    """A query parameter's value as the generated ApiClient writes it (parameters_to_url_query):
    booleans in lower case, numbers as text, then percent-encoded."""
    if isinstance(value, bool):
        value = str(value).lower()
    return quote(str(value))


class CollectionGet:
    """A LIST or WATCH of one collection, by its path, through the client's REST layer: the request
    the generated list method (e.g. CoreV1Api.list_node for /api/v1/nodes) sends, with its keywords
    (label_selector=, _continue=, watch=, _request_timeout=, ...), without importing the generated
    API classes and their models (issue 12). As that method with `_preload_content=False`: the
    urllib3 response, unread, for a 2xx status; an ApiException (status, reason, body) otherwise.
    Authentication is the client's (BearerToken: a kubeconfig's or the service account's token,
    refreshed by the client), and TLS, retries and timeouts are its urllib3 pool's."""

    def __init__(self, api: KubeApi, path: str) -> None:
        self.api = api
        self.path = path

    def __repr__(self) -> str:
        return f"CollectionGet({self.path!r})"

    def __call__(self, *, _preload_content: bool = False, _request_timeout: Any = None, **params: Any) -> Any:
        if _preload_content:
            raise ValueError(f"GET {self.path}: _preload_content=True would decode into the client's "
                             "generated models, which the agent does not load")
        unknown = sorted(set(params) - _KEYWORDS)
        if unknown:
            raise TypeError(f"GET {self.path}: unknown parameter(s) {', '.join(unknown)}")
        configuration = self.api.configuration
        url = configuration.host + self.path
        query = [(name, _query_value(params[keyword])) for keyword, name in _QUERY_PARAMETERS
                 if params.get(keyword) is not None]
        if query:
            url += "?" + "&".join(f"{name}={value}" for name, value in query)
        headers = {"Accept": "application/json", "User-Agent": KubeApi.USER_AGENT}
        token = configuration.auth_settings().get("BearerToken")  # refreshed by the client's hook, if any
        if token:
            headers[token["key"]] = token["value"]
        response = self.api.rest_client.request("GET", url, headers=headers, body=None, post_params=[],
                                                _request_timeout=_request_timeout)
        if not 200 <= response.status <= 299:
            response.read()
            raise ApiException.from_response(http_resp=response, body=None, data=None)
        return response.response


class ListError(Exception):
    """A LIST answered with something that is not a list object."""


class WatchIdleTimeout(Exception):
    """A watch said nothing (no event, no BOOKMARK, not even its headers) for the idle timeout:
    the connection is presumed hung and is dropped, and the Reflector reconnects with backoff."""


def _is_read_timeout(exc: BaseException) -> bool:
    return isinstance(exc, ReadTimeoutError) or (
        isinstance(exc, MaxRetryError) and isinstance(exc.reason, ReadTimeoutError))


def _idle(kind: str, idle_timeout: float, what: str) -> WatchIdleTimeout:
    return WatchIdleTimeout(f"{kind} watch: {what} within {idle_timeout:g}s: the connection is hung")


class WatchStream:
    """Watch events of one HTTP response, parsed line by line into dicts."""

    def __init__(self, kind: str, response: Any, idle_timeout: float = WATCH_IDLE_TIMEOUT_SECONDS) -> None:
        self.kind = kind
        self.idle_timeout = idle_timeout
        self._response = response
        self._lines = iter_resp_lines(response)

    def __iter__(self) -> "WatchStream":
        return self

    def __next__(self) -> Any:
        while True:
            try:
                line = next(self._lines)
            except Exception as exc:
                if _is_read_timeout(exc):
                    raise _idle(self.kind, self.idle_timeout, "no event or bookmark") from None
                raise
            if not line.strip():
                continue
            try:
                return loads(line)
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
    iterated: what a relist is held as until it has all arrived (watch.Reflector: a failed LIST
    never changes what the handlers saw). The text of 10,000 Services is a quarter of their
    decoded dicts, and the Reflector turns each object into the model and drops it, so the
    agent's peak memory no longer holds a whole decoded LIST. Every page was decoded and checked
    once when it arrived, so iterating cannot fail."""

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
            yield from loads(data).get("items") or ()

    def drain(self) -> Iterator[Any]:
        """The items once more, each page's text released as soon as it is decoded: the
        Reflector's last walk, so the text (~200 MB at 100,000 Services and slices) shrinks while
        the model it becomes grows, instead of both peaking together. Iterating afterwards
        yields nothing."""
        pages, self._pages, self._count = self._pages, [], 0
        pages.reverse()
        yield from _walk_pages(_decode_popping(pages))


def _decode_popping(pages: list[bytes]) -> Iterator[tuple[Any, dict]]:
    """Each page of `pages` from its end, as (its items, no metadata): the text is out of the list
    and released as soon as it is decoded."""
    while pages:
        yield loads(pages.pop()).get("items") or (), {}


class ListStream:
    """The items of a paged LIST as its pages arrive, each page decoded once and dropped as soon
    as its items are walked: what the Reflector delivers a first LIST from (nothing to delete, so
    nothing to hold: at 100,000 Services and slices that is one decode of ~200 MB of text less,
    and the text itself is never held whole). Iterating raises as `KubeListWatch.list` does
    (HTTP errors, a page that is not a list) at the page where it happens, after the items of
    the pages before it; `resource_version` is the list's once every page has been walked."""

    def __init__(self, pages: Iterator[tuple[list, dict]]) -> None:
        self._pages = pages
        self.resource_version: str | None = None  # None until the last page was walked

    def __iter__(self) -> Iterator[Any]:
        meta = yield from _walk_pages(self._pages)
        self.resource_version = _list_rv(meta)


def _walk_pages(pages: Iterator[tuple[Any, dict]]) -> Generator[Any, None, dict]:
    """The items of (items, metadata) pages in turn, each page's items dropped once walked so that
    they are not held while the next page is fetched or decoded: the one walk of a streamed first
    list (ListStream) and of a held relist's last pass (ListPages.drain). Returns the metadata of
    the last page ({} without pages); an error getting a page propagates after the items before it."""
    meta: dict = {}
    for items, meta in pages:
        yield from items
        del items
    return meta


def _list_rv(meta: dict) -> str:
    rv = meta.get("resourceVersion")
    return rv if isinstance(rv, str) else ""


class KubeListWatch:
    """`watch.ListWatch` over one list call of the kubernetes client (e.g. list_node)."""

    def __init__(self, kind: str, call: Callable[..., Any], *, label_selector: str | None = None,
                 field_selector: str | None = None, page_size: int = PAGE_SIZE,
                 idle_timeout: float = WATCH_IDLE_TIMEOUT_SECONDS) -> None:
        self.kind = kind
        self.idle_timeout = idle_timeout
        self._call = call
        self._selectors: dict[str, str] = {}
        if label_selector:
            self._selectors["label_selector"] = label_selector
        if field_selector:
            self._selectors["field_selector"] = field_selector
        self._page_size = page_size

    def list(self) -> tuple[ListPages, str]:
        """Every page, each checked, held as its text (ListPages) until the last one is in."""
        items = ListPages()
        meta: dict = {}
        for page, meta in self._pages(keep=items.add):
            del page
        return items, _list_rv(meta)

    def stream(self) -> ListStream:
        """The LIST's items as its pages arrive (watch.Reflector's first list)."""
        return ListStream(self._pages())

    def _pages(self, keep: Callable[[bytes, int], None] | None = None) -> Iterator[tuple[list, dict]]:
        """Each page of the LIST as it arrives: (its items, its metadata), decoded and checked once;
        the next page is requested when this one has been walked. `keep` is given each page's
        text and item count first (ListPages.add: a held relist)."""
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = dict(self._selectors, limit=self._page_size, _preload_content=False,
                                          _request_timeout=(CONNECT_TIMEOUT_SECONDS, LIST_TIMEOUT_SECONDS))
            if token:
                kwargs["_continue"] = token
            response = self._call(**kwargs)
            try:
                body = loads(response.data)
            except ValueError as exc:
                raise ListError(f"{self.kind} list: response is not JSON: {exc}") from None
            finally:
                response.release_conn()
            if not isinstance(body, dict):
                raise ListError(f"{self.kind} list: response is not a list object")
            page, meta = body.get("items"), body.get("metadata")
            if not isinstance(page, (list, type(None))) or not isinstance(meta, (dict, type(None))):
                raise ListError(f"{self.kind} list: response has no items list")
            del body
            meta = meta or {}
            token = meta.get("continue")
            if keep is not None:
                keep(response.data, len(page or ()))
            del response
            yield page or [], meta
            del page
            if not token:
                return

    def watch(self, resource_version: str) -> WatchStream:
        """The server ends the watch after timeoutSeconds (5-10 min); the read timeout, applied to
        every read of the stream (the headers included), ends it sooner when it goes silent."""
        timeout = random.randint(*WATCH_TIMEOUT_RANGE)
        try:
            response = self._call(
                **self._selectors, watch=True, resource_version=resource_version or None, allow_watch_bookmarks=True,
                timeout_seconds=timeout, _preload_content=False,
                _request_timeout=(CONNECT_TIMEOUT_SECONDS, self.idle_timeout),
            )
        except Exception as exc:
            if _is_read_timeout(exc):
                raise _idle(self.kind, self.idle_timeout, "no answer") from None
            raise
        return WatchStream(self.kind, response, self.idle_timeout)


def agent_collections(api: KubeApi, node_name: str,
                      idle_timeout: float = WATCH_IDLE_TIMEOUT_SECONDS) -> dict[str, KubeListWatch]:
    """Services, EndpointSlices and this node's Node: everything the agent watches."""
    return {
        "Service": KubeListWatch("Service", CollectionGet(api, "/api/v1/services"),
                                 label_selector=PROXY_LABEL_SELECTOR, idle_timeout=idle_timeout),
        "EndpointSlice": KubeListWatch("EndpointSlice", CollectionGet(api, "/apis/discovery.k8s.io/v1/endpointslices"),
                                       label_selector=PROXY_LABEL_SELECTOR, idle_timeout=idle_timeout),
        "Node": KubeListWatch("Node", CollectionGet(api, "/api/v1/nodes"), field_selector=f"metadata.name={node_name}",
                              idle_timeout=idle_timeout),
    }
