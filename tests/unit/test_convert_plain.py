"""The unchecked readings of the usual Service and EndpointSlice (convert._plain_service_ports,
convert._plain_ipv4_slice, issue 12) give exactly what the checked paths give, for any object: the
same values (of the same types), and, where they decline, the checked path's reports. And a slice's
rows already in merged order are packed as the MergedEndpoints the tracker's merge would make."""

from __future__ import annotations

import copy
import socket

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ebpf_proxy.bench.cpscale import service_object, slice_object
from ebpf_proxy.k8s import convert
from ebpf_proxy.model.endpoints import EndpointList, MergedEndpoints, PortlessEndpoints, extra_index, merge
from tests.unit.kobjects import endpoint, endpoint_slice, port, service
from tests.unit.test_convert_fastpath import ENDPOINT

ABSENT = object()  # the field is left out
JUNK = st.sampled_from([None, True, 1, "x", "", [], {}, [1], ["x"]])


def rarely(common, odd, one_in: int = 5):
    """`odd` about once in `one_in` draws, else `common`: most objects stay plain, so that both
    readings are compared where the plain one applies, as well as where it declines."""
    return st.integers(0, one_in - 1).flatmap(lambda i: odd if i == 0 else common)


def field(plain, *others):
    """A field's value: mostly one of `plain` (ABSENT: left out), else one of `others` or junk."""
    return rarely(st.sampled_from(plain), st.sampled_from(others) | JUNK if others else JUNK, one_in=12)


PORT = rarely(st.fixed_dictionaries({
    "port": field([80, 8080, 1, 65535], 0, 65536, -1, "80", 1.5)}, optional={
    "name": field(["", "http", "dns", None], "Bad_Name", "a" * 64),
    "protocol": field(["TCP", "UDP", "SCTP", None], "tcp"),
    "nodePort": field([0, 30080, 65535, None], 65536, -1),
}), JUNK, one_in=10)
PORTS = rarely(st.lists(PORT, min_size=1, max_size=3), JUNK | st.just(ABSENT) | st.just([]), one_in=10)

SERVICE_FIELDS = {
    "type": field([ABSENT, "ClusterIP", "", None], "NodePort", "LoadBalancer", "ExternalName", "Bogus"),
    "clusterIPs": field([["10.96.0.10"], ["10.96.0.11"]], ABSENT, ["10.96.00.10"], ["fd00::10"], ["10.96.0.10", "fd00::10"],
                        ["fd00::10", "10.96.0.10"], ["None"], ["::ffff:10.96.0.10"], ["10.96.0.10\x00"],
                        [" 10.96.0.10"], []),
    "clusterIP": field([ABSENT, "10.96.0.10"], "None", "fd00::10"),
    "externalIPs": field([ABSENT, None, []], ["1.2.3.4"], ["1.2.3.4", "bad"]),
    "loadBalancerSourceRanges": field([ABSENT, None, []], ["10.0.0.0/8"], ["bad"]),
    "externalTrafficPolicy": field([ABSENT, "Cluster", "Local", "", None], "Bogus"),
    "internalTrafficPolicy": field([ABSENT, "Cluster", "Local", "", None], "Bogus"),
    "sessionAffinity": field([ABSENT, "None", "", None], "ClientIP", "Bogus"),
    "sessionAffinityConfig": field([ABSENT, {"clientIP": {"timeoutSeconds": 60}}]),
    "healthCheckNodePort": field([ABSENT, 30000]),
    "ports": PORTS,
}
STATUS = field([ABSENT, None, {}, {"loadBalancer": None}, {"loadBalancer": {}}, {"loadBalancer": {"ingress": []}},
                {"loadBalancer": {"ingress": None}}],
               {"loadBalancer": {"ingress": [{"ip": "5.6.7.8"}]}}, {"loadBalancer": {"ingress": [{"hostname": "lb"}]}},
               {"loadBalancer": []})
FAMILIES = st.sampled_from([(4,), (6,), (4, 6), (6, 4)])

PLAIN_ENDPOINT = st.builds(
    lambda ip, node, ready, serving, terminating: endpoint(ip, node, ready, serving, terminating),
    st.sampled_from(["10.0.0.1", "10.0.0.2", "10.0.0.10", "10.0.0.9", "192.168.1.1"]),
    st.sampled_from([None, "n1", "n2"]), st.sampled_from([None, True, False]),
    st.sampled_from([None, True, False]), st.sampled_from([None, True, False]))
SLICE_ENDPOINT = rarely(PLAIN_ENDPOINT, one_in=12, odd=ENDPOINT | st.builds(
    lambda ip, hints: endpoint(ip, "n1", hints=hints), st.sampled_from(["10.0.0.3", "10.0.00.3", "fd00::1"]),
    st.sampled_from([None, {}, {"forZones": [{"name": "z1"}]}, {"forNodes": []}, {"forZones": "x"}])))
LABELS = field([{"kubernetes.io/service-name": "web"}, {"kubernetes.io/service-name": "api", "other": "x"}],
               ABSENT, {"kubernetes.io/service-name": "Web"}, {"kubernetes.io/service-name": ""},
               {"kubernetes.io/service-name": 1}, {"other": "x"})
ANNOTATIONS = field([ABSENT, {}, {"endpoints.kubernetes.io/last-change-trigger-time": "2024-05-01T10:00:00Z"}],
                    {"endpoints.kubernetes.io/last-change-trigger-time": "junk"},
                    {"endpoints.kubernetes.io/last-change-trigger-time": 5})


def with_fields(obj: dict, where: dict, values: dict) -> dict:
    for key, value in values.items():
        if value is ABSENT:
            where.pop(key, None)
        else:
            where[key] = copy.deepcopy(value)
    return obj


@st.composite
def services(draw):
    obj = service("web", ports=[port("http", 80, "TCP")])
    obj = with_fields(obj, obj["spec"], {k: draw(v, label=k) for k, v in SERVICE_FIELDS.items()})
    status = draw(STATUS, label="status")
    return with_fields(obj, obj, {"status": status})


@st.composite
def slices(draw):
    obj = endpoint_slice("web-a")
    meta = obj["metadata"]
    with_fields(obj, meta, {"labels": draw(LABELS, label="labels"), "annotations": draw(ANNOTATIONS, label="annotations")})
    changes = {"addressType": draw(field(["IPv4"], "IPv6", "FQDN", ABSENT), label="addressType"),
               "ports": draw(PORTS, label="ports"),
               "endpoints": draw(rarely(st.lists(SLICE_ENDPOINT, min_size=1, max_size=5),
                                        JUNK | st.just(ABSENT) | st.just([]), one_in=10),
                                 label="endpoints")}
    return with_fields(obj, obj, changes)


def convert_both(fn, obj, *args):
    """(value, reports) of `fn` with the plain readings, then with the checked paths only."""
    got = []
    for plain in (True, False):
        reports: list = []
        saved = convert._plain_service_ports, convert._plain_ipv4_slice
        if not plain:
            convert._plain_service_ports = convert._plain_ipv4_slice = lambda *_: None
        try:
            value = fn(copy.deepcopy(obj), *args[:-1], reports.append, args[-1])
        finally:
            convert._plain_service_ports, convert._plain_ipv4_slice = saved
        got.append((value, reports))
    return got


def types_of(sl):
    return None if sl is None else {spn: type(eps) for spn, eps in sl.endpoints.items()}


@settings(max_examples=1500, deadline=None)
@given(obj=services(), families=FAMILIES)
def test_the_plain_reading_of_a_service_is_the_checked_one(obj, families):
    (plain, plain_reports), (checked, checked_reports) = convert_both(convert.service_ports_by_family, obj, families)
    assert plain == checked and plain_reports == checked_reports


@settings(max_examples=1500, deadline=None)
@given(obj=slices(), families=FAMILIES, node=st.sampled_from(["n1", "n3"]))
def test_the_plain_reading_of_a_slice_is_the_checked_one(obj, families, node):
    (plain, plain_reports), (checked, checked_reports) = convert_both(convert.endpoint_slice, obj, node, families)
    assert plain == checked and plain_reports == checked_reports
    assert types_of(plain) == types_of(checked), "packed alike (EndpointList, MergedEndpoints or tuple)"


@pytest.mark.parametrize("obj", [
    service_object(7, 9),
    service("web", ports=[port("http", 80, "TCP"), port("dns", 53, "UDP")]),
    service("web", ports=[port("", 80, None)], internalTrafficPolicy="Local", externalTrafficPolicy="Local",
            sessionAffinity="None", status={"loadBalancer": {}}),
])
def test_the_usual_services_take_the_plain_reading(obj):
    ref = convert.object_ref(obj)
    plain = convert._plain_service_ports(obj, ref, (4, 6))
    assert plain is not None and plain[4] and plain[6] == []
    assert plain == convert._service_ports(obj, ref, None, (4, 6))


@pytest.mark.parametrize("obj", [
    slice_object(7, 10, 9),
    endpoint_slice("web-a", endpoints=[endpoint("10.0.0.2", "n1", ready=True), endpoint("10.0.0.1", None, ready=False)],
                   trigger="2024-05-01T10:00:00Z"),
    endpoint_slice("web-a", endpoints=[]),
])
def test_the_usual_slices_take_the_plain_reading(obj):
    ref = convert.object_ref(obj)
    plain = convert._plain_ipv4_slice(obj, ref, "n1")
    assert plain is not None and plain == convert._endpoint_slice(obj, ref, "n1", None, (4,))


def test_a_slice_listed_in_address_order_is_packed_as_its_merge():
    sl = convert.endpoint_slice(slice_object(7, 10, 9), "worker1")
    (eps,) = sl.endpoints.values()
    assert type(eps) is MergedEndpoints and merge([eps]) is eps
    unordered = convert.endpoint_slice(endpoint_slice(endpoints=[endpoint("10.0.0.2"), endpoint("10.0.0.10")]), "n1")
    (eps,) = unordered.endpoints.values()
    assert type(eps) is EndpointList, '"10.0.0.10" sorts before "10.0.0.2": not in merged order'
    assert type(merge([eps])) is MergedEndpoints and [e.ip for e in merge([eps])] == ["10.0.0.10", "10.0.0.2"]


ROW_IPS = st.sampled_from(["10.0.0.1", "10.0.0.2", "10.0.0.10", "10.0.0.9", "192.168.1.1", "fd00::1", "10.1"])
ROWS = st.lists(st.tuples(ROW_IPS, st.sampled_from([None, "a", "b"]), st.booleans(), st.booleans(), st.booleans(),
                          st.booleans(), st.sampled_from([(), ("z",)]), st.sampled_from([(), ("n",)])), max_size=6)


@settings(max_examples=500, deadline=None)
@given(rows=ROWS, port_number=st.sampled_from([0, 80, 65535, 65536]))
def test_rows_packed_as_merged_are_what_merge_makes_of_them(rows, port_number):
    packed = PortlessEndpoints(rows).with_port(port_number)
    if isinstance(packed, EndpointList):
        again = merge([EndpointList(packed._packed)])  # the same rows, not known to be in order
        if type(packed) is MergedEndpoints:
            assert type(again) is MergedEndpoints and again._packed == packed._packed
        else:  # out of order or an address twice: merging reorders or drops rows
            assert type(again) is MergedEndpoints and again._packed != packed._packed
    plain = [r for r in rows if "." in r[0] and r[0] != "10.1"]  # canonical dotted quads
    trusted = PortlessEndpoints.packed_ipv4([r[0] for r in plain], b"".join(socket.inet_aton(r[0]) for r in plain),
                                            [extra_index(r[1:]) for r in plain]).with_port(port_number)
    assert trusted == PortlessEndpoints(plain).with_port(port_number) and \
        type(trusted) is type(PortlessEndpoints(plain).with_port(port_number))
