"""bench/rest.py against a real (in-process) lab API server: paged counts as an agent lists."""

import pytest

from ebpf_proxy.apiserver import Store
from ebpf_proxy.apiserver.server import ApiServer
from ebpf_proxy.bench.rest import Rest
import os

from ebpf_proxy.bench.runner import api_list_cost
from ebpf_proxy.k8s.client import PROXY_LABEL_SELECTOR


@pytest.fixture
def rest():
    store = Store()
    server = ApiServer(store, ["127.0.0.1:0"]).start()
    client = Rest(server.url)
    yield client
    client.close()
    server.stop()
    store.close()


def test_count_all_follows_continue_across_namespaces_with_the_agents_selector(rest):
    rest.create({"kind": "Namespace", "apiVersion": "v1", "metadata": {"name": "other"}})
    for i in range(7):
        rest.create({"kind": "Service", "apiVersion": "v1",
                     "metadata": {"name": f"s{i}", "namespace": "default" if i % 2 else "other"},
                     "spec": {"ports": [{"port": 80}]}})
    rest.create({"kind": "Service", "apiVersion": "v1",
                 "metadata": {"name": "theirs", "namespace": "default",
                              "labels": {"service.kubernetes.io/service-proxy-name": "another-proxy"}},
                 "spec": {"ports": [{"port": 80}]}})
    assert rest.count_all("Service", page=3) == 8  # three pages, both namespaces
    assert rest.count_all("Service", PROXY_LABEL_SELECTOR, page=3) == 7  # another proxy's is not listed
    assert rest.count_all("EndpointSlice") == 0
    cost = api_list_cost(rest, os.getpid())  # the server runs in this process here
    assert cost["list_first_s"] > 0 and cost["list_later_s"] > 0 and cost["list_seconds"] == cost["list_first_s"]
    assert cost["api_cpu_first_s"] >= 0 and cost["api_cpu_later_s"] >= 0
    assert "api_cpu_first_s" not in api_list_cost(rest), "no pid: no CPU figure, not a zero"
    gone = api_list_cost(rest, 2**22 + 12345)  # above pid_max: no such process
    assert "api_cpu_first_s" not in gone and gone["list_later_s"] > 0, "a pid that is not there: no CPU figure"
