"""The trace answer's JSON is a stable interface: exactly the keys the issue fixes, in both datapaths."""

import json

import pytest

from ebpf_proxy.explain.packet import FlowError, FlowSpec, parse_endpoint
from ebpf_proxy.explain.result import Step, Trace
from ebpf_proxy.model import Protocol


def test_json_shape_is_exact_and_backends_sorted_by_address():
    t = Trace("ebpf", "dnat", "new connection", "default/web:http", ("10.244.5.4:80", "10.244.10.3:80", "10.244.4.3:80"),
              masquerade=True, source_after="172.20.20.16",
              steps=(Step("tc-ingress", "tc_ingress", "DNAT"), Step("PREROUTING", "KUBE-SERVICES", "jump", kind="chain")))
    data = json.loads(t.dumps())
    assert list(data) == ["datapath", "verdict", "reason", "service", "backends", "masquerade", "sourceAfter", "steps"]
    assert data["backends"] == ["10.244.4.3:80", "10.244.5.4:80", "10.244.10.3:80"]
    assert data["steps"] == [{"hook": "tc-ingress", "program": "tc_ingress", "action": "DNAT"},
                             {"hook": "PREROUTING", "chain": "KUBE-SERVICES", "action": "jump"}]
    assert "dnat default/web:http" in t.sentence() and "masqueraded" in t.sentence()


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="verdict"):
        Trace("ebpf", "maybe", "")
    with pytest.raises(ValueError, match="datapath"):
        Trace("ipvs", "drop", "")


def test_flow_spec_and_endpoint_parsing_name_the_option():
    assert parse_endpoint("10.96.0.10:53/udp", "--to") == ("10.96.0.10", 53, Protocol.UDP)
    assert parse_endpoint("10.0.0.1", "--from", 40000) == ("10.0.0.1", 40000, Protocol.TCP)
    with pytest.raises(FlowError, match="--to: protocol 'icmp'"):
        parse_endpoint("10.96.0.10:53/icmp", "--to")
    with pytest.raises(FlowError, match="--from: '10.0.0.300'"):
        FlowSpec("10.0.0.300", "10.96.0.10", 80)
    with pytest.raises(FlowError, match="origin"):
        FlowSpec("10.0.0.3", "10.96.0.10", 80, origin="mars")
