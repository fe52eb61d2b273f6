"""categorize(): the endpoint sets both datapaths pick from (kube-proxy's CategorizeEndpoints)."""

from ebpf_proxy.model import Endpoint, Protocol, ServicePort, ServicePortName, categorize

NAME = ServicePortName("default", "web", "http", Protocol.TCP)


def svc(**kw) -> ServicePort:
    return ServicePort(name=NAME, cluster_ip="10.96.0.10", port=80, protocol=Protocol.TCP, **kw)


def ep(ip, local=False, ready=True, serving=None, terminating=False) -> Endpoint:
    return Endpoint(ip=ip, port=8080, node_name="n1" if local else "n2", ready=ready,
                    serving=ready if serving is None else serving, terminating=terminating, is_local=local)


def test_cluster_policy_uses_ready_endpoints_only():
    sets = categorize(svc(), (ep("10.0.0.1"), ep("10.0.0.2", ready=False)))
    assert [e.ip for e in sets.cluster] == ["10.0.0.1"]
    assert sets.local == ()
    assert sets.has_any


def test_terminating_fallback_when_nothing_is_ready():
    sets = categorize(svc(), (ep("10.0.0.1", ready=False, serving=True, terminating=True),
                              ep("10.0.0.2", ready=False, serving=False, terminating=True)))
    assert [e.ip for e in sets.cluster] == ["10.0.0.1"]
    assert sets.has_any


def test_no_usable_endpoint_means_has_any_false():
    sets = categorize(svc(), (ep("10.0.0.1", ready=False),))
    assert sets.cluster == () and not sets.has_any


def test_external_local_keeps_cluster_set_for_short_circuit_and_adds_local():
    s = svc(node_port=30080, external_policy_local=True)
    sets = categorize(s, (ep("10.0.0.1", local=True), ep("10.0.0.2")))
    assert [e.ip for e in sets.cluster] == ["10.0.0.1", "10.0.0.2"]
    assert [e.ip for e in sets.local] == ["10.0.0.1"]


def test_external_local_without_local_endpoints_still_has_any():
    sets = categorize(svc(node_port=30080, external_policy_local=True), (ep("10.0.0.2"),))
    assert sets.local == () and sets.has_any and len(sets.cluster) == 1


def test_internal_local_only_uses_local_endpoints():
    sets = categorize(svc(internal_policy_local=True), (ep("10.0.0.1", local=True), ep("10.0.0.2")))
    assert sets.cluster == ()
    assert [e.ip for e in sets.all_reachable] == ["10.0.0.1"]


def test_internal_local_with_no_local_endpoint_has_any_from_elsewhere():
    sets = categorize(svc(internal_policy_local=True), (ep("10.0.0.2"),))
    assert sets.local == () and sets.all_reachable == () and sets.has_any


def test_local_terminating_fallback():
    sets = categorize(svc(internal_policy_local=True),
                      (ep("10.0.0.1", local=True, ready=False, serving=True, terminating=True), ep("10.0.0.2")))
    assert [e.ip for e in sets.local] == ["10.0.0.1"]


def test_duplicates_are_merged_and_order_is_stable():
    a, b = ep("10.0.0.2"), ep("10.0.0.1")
    assert categorize(svc(), (a, b, a)).cluster == (b, a)
