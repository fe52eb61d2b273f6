"""The agent lists and watches by path (k8s/client.py CollectionGet), not through the kubernetes
client's generated API classes: CoreV1Api alone imports ~250 model modules, ~21 MiB of a 1-Service
agent's RSS (issue 12). The requests must stay exactly those of the generated methods, and nothing
on the agent's run path may import the generated classes back."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from kubernetes import client as kclient
from kubernetes.client.exceptions import ApiException
from kubernetes.client.rest import RESTResponse

from ebpf_proxy.k8s.client import PROXY_LABEL_SELECTOR, CollectionGet, KubeApi, agent_collections, make_api_client

# each collection of the agent, and the generated method that lists it
GENERATED = {
    "/api/v1/services": lambda api: kclient.CoreV1Api(api).list_service_for_all_namespaces,
    "/apis/discovery.k8s.io/v1/endpointslices": lambda api: kclient.DiscoveryV1Api(api).list_endpoint_slice_for_all_namespaces,
    "/api/v1/nodes": lambda api: kclient.CoreV1Api(api).list_node,
}

# what KubeListWatch passes: a first page, a next page, a watch
CALLS = [
    dict(label_selector=PROXY_LABEL_SELECTOR, limit=500, _preload_content=False, _request_timeout=(10, 60)),
    dict(label_selector=PROXY_LABEL_SELECTOR, limit=500, _continue="eyJ2IjoibWV0YS5rOHMuaW8vdjEi+/=",
         _preload_content=False, _request_timeout=(10, 60)),
    dict(field_selector="metadata.name=worker1", watch=True, resource_version="12345", allow_watch_bookmarks=True,
         timeout_seconds=417, _preload_content=False, _request_timeout=(10, 90.0)),
    dict(field_selector="metadata.name=worker1", watch=True, resource_version=None, allow_watch_bookmarks=True,
         timeout_seconds=300, _preload_content=False, _request_timeout=(10, 90.0)),
]


class FakeHTTPResponse:
    def __init__(self, status: int, data: bytes = b"{}") -> None:
        self.status, self.reason, self.data = status, "Gone" if status == 410 else "OK", data
        self.headers = {"content-type": "application/json"}


class Recorder:
    """The ApiClient's REST layer, recording each request and answering `status`."""

    def __init__(self, status: int = 200, data: bytes = b"{}") -> None:
        self.status, self.data = status, data
        self.requests: list[tuple] = []

    def request(self, method, url, headers=None, body=None, post_params=None, _request_timeout=None):
        self.requests.append((method, url, dict(headers or {}), body, post_params, _request_timeout))
        return RESTResponse(FakeHTTPResponse(self.status, self.data))


def _api(recorder: Recorder, **configuration) -> KubeApi:
    """The agent's client (KubeApi), answering through `recorder`."""
    api = make_api_client(master="https://192.0.2.1:6443")
    for key, value in configuration.items():
        setattr(api.configuration, key, value)
    api.rest_client = recorder
    return api


def _generated_api(recorder: Recorder, **configuration) -> kclient.ApiClient:
    """The generated methods' ApiClient, on the same configuration, answering through `recorder`."""
    api = kclient.ApiClient(_api(Recorder(), **configuration).configuration)
    api.rest_client = recorder
    return api


@pytest.mark.parametrize("path", sorted(GENERATED))
def test_a_path_call_sends_what_the_generated_method_sends(path):
    """Method, URL (query parameters and their order), headers (Accept, User-Agent, the bearer
    token), body and timeouts: byte for byte the generated method's request, and the same raw
    response back."""
    by_path, generated = Recorder(), Recorder()
    token = {"api_key": {"BearerToken": "Bearer s3cr3t"}}
    path_call, method = CollectionGet(_api(by_path, **token), path), GENERATED[path](_generated_api(generated, **token))
    for kwargs in CALLS:
        ours, theirs = path_call(**kwargs), method(**kwargs)
        assert ours is not None and type(ours) is type(theirs)
    assert by_path.requests == generated.requests
    assert len(by_path.requests) == len(CALLS)
    assert all(r[2]["authorization"] == "Bearer s3cr3t" for r in by_path.requests)
    assert by_path.requests[2][1].startswith(f"https://192.0.2.1:6443{path}?allowWatchBookmarks=true&")


def test_an_error_status_raises_the_generated_methods_exception():
    """A 410 Gone (compacted history) or any non-2xx status: the ApiException the generated method
    raises with _preload_content=False (the Reflector reads .status to relist)."""
    body = b'{"kind":"Status","code":410,"reason":"Expired"}'
    with pytest.raises(ApiException) as ours:
        CollectionGet(_api(Recorder(410, body)), "/api/v1/services")(watch=True, resource_version="1")
    with pytest.raises(ApiException) as theirs:
        GENERATED["/api/v1/services"](_generated_api(Recorder(410, body)))(watch=True, resource_version="1",
                                                                  _preload_content=False)
    assert type(ours.value) is type(theirs.value)
    assert (ours.value.status, ours.value.reason, ours.value.body) == (theirs.value.status, theirs.value.reason,
                                                                        theirs.value.body) == (410, "Gone", body.decode())


def test_a_path_call_refuses_what_it_cannot_do():
    call = CollectionGet(_api(Recorder()), "/api/v1/nodes")
    with pytest.raises(ValueError, match="/api/v1/nodes: _preload_content=True"):
        call(_preload_content=True)
    with pytest.raises(TypeError, match="/api/v1/nodes: unknown parameter.*pretty"):
        call(pretty="true")


def test_the_agents_collections_are_path_calls():
    collections = agent_collections(make_api_client(master="http://192.0.2.1:8080"), "n1")
    assert {kind: lw._call.path for kind, lw in collections.items()} == {
        "Service": "/api/v1/services", "EndpointSlice": "/apis/discovery.k8s.io/v1/endpointslices",
        "Node": "/api/v1/nodes"}


# The agent as `ebpf-proxy run` starts it (the CLI's run command, its slim_imports, both
# datapaths' modules), against the embedded API server with a fake datapath, until its first sync
# and a watched change: then no generated API class or model module may have been imported.
AGENT_RUN = textwrap.dedent("""
    import sys, threading, time
    from ebpf_proxy.cli import main
    main.get_command(None, "run")
    from ebpf_proxy.bareimport import slim_imports
    slim_imports()
    import ebpf_proxy.datapath.ebpf.datapath, ebpf_proxy.datapath.iptables.datapath
    from ebpf_proxy.agent.agent import Agent
    from ebpf_proxy.agent.config import load_config
    from ebpf_proxy.apiserver import ApiServer, Store
    from ebpf_proxy.datapath.fake import FakeDatapath

    def svc(name):
        return {"metadata": {"name": name, "namespace": "default"},
                "spec": {"ports": [{"name": "http", "port": 80}], "selector": {"app": name}}}

    store = Store()
    server = ApiServer(store).start()
    store.create("Node", {"metadata": {"name": "n1"},
                          "status": {"addresses": [{"type": "InternalIP", "address": "192.168.1.10"}]}})
    store.create("Service", svc("web"))
    created = []
    connect = {"master": server.url}
    if USE_KUBECONFIG:  # the server named in a kubeconfig file, with a token, as a DaemonSet's
        import json, tempfile
        path = tempfile.mktemp(suffix=".kubeconfig")
        with open(path, "w") as f:
            json.dump({"apiVersion": "v1", "kind": "Config", "current-context": "c",
                       "clusters": [{"name": "k", "cluster": {"server": server.url}}],
                       "users": [{"name": "u", "user": {"token": "s3cr3t"}}],
                       "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}, f)
        connect = {"kubeconfig": path}
    config = load_config({"hostname_override": "n1", "mode": "iptables", "min_sync_period": "0s",
                          "metrics_bind_address": "", "healthz_bind_address": "", **connect})
    agent = Agent(config, datapath_factory=lambda mode, node, **opts: created.append(FakeDatapath(node)) or created[-1],
                  local_addresses=lambda: ["192.168.1.10"])
    threading.Thread(target=agent.run, daemon=True).start()

    def services():
        return {n.name for n in created[0].last_state.services} if created and created[0].last_state else set()

    deadline = time.monotonic() + 30
    while services() != {"web"}:
        assert time.monotonic() < deadline, "no first sync"
        time.sleep(0.02)
    store.create("Service", svc("api"))
    while services() != {"web", "api"}:
        assert time.monotonic() < deadline, "no watched change"
        time.sleep(0.02)
    agent.stop()
    server.stop()
    print(sorted(m for m in sys.modules if m.startswith(("kubernetes.client.api.", "kubernetes.client.models."))))
    print(sorted(m for m in LEFT_OUT if m in sys.modules))
    print("kubernetes.client.rest" in sys.modules)
""")

# What the agent's process must not load either (k8s/kubeconfig.py, KubeApi): the kubeconfig loader
# and what it imports (requests-oauthlib, requests), the generated ApiClient and pydantic, ~10 MiB
LEFT_OUT = ("kubernetes.config.kube_config", "requests_oauthlib", "requests", "kubernetes.client.api_client",
            "pydantic")


@pytest.mark.parametrize("use_kubeconfig", [False, True], ids=["master", "kubeconfig"])
def test_the_agent_never_imports_the_generated_api_classes_or_models(use_kubeconfig):
    code = AGENT_RUN.replace("USE_KUBECONFIG", str(use_kubeconfig)).replace("LEFT_OUT", repr(LEFT_OUT))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    generated, left_out, client_loaded = out.stdout.splitlines()[-3:]
    assert client_loaded == "True", "the agent did not use the official client at all"
    assert generated == "[]", f"the agent imported generated client modules: {generated[:500]}"
    assert left_out == "[]", f"the agent imported what it leaves to the kubeconfig child: {left_out}"
