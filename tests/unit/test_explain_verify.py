"""verify's flow enumeration and comparison, with stand-in tracers (the real ones run in tests/e2e)."""

from __future__ import annotations

from dataclasses import replace

from ebpf_proxy.explain.expect import expected
from ebpf_proxy.explain.result import Trace
from ebpf_proxy.explain.state import desired_state
from ebpf_proxy.explain.verify import Origin, flows_for, verify
from ebpf_proxy.model import NodeConfig
from tests.unit.kobjects import endpoint, endpoint_slice, node, port, service

NODE = NodeConfig("n1", node_ips=("192.168.1.10",), cluster_cidrs=("10.244.0.0/16",))
SENDERS = [Origin("pod (this node)", "10.244.1.9", "pod", "lxc1"), Origin("the node", "192.168.1.10", "host"),
           Origin("outside", "203.0.113.5", "external", "eth0"), Origin("backend pod", "10.244.1.5", "pod", "lxc2")]


def world():
    objs = dict(
        services=[service(svc_type="NodePort", ports=[port(node_port=30080)], externalTrafficPolicy="Local",
                          externalIPs=["198.51.100.7"])],
        slices=[endpoint_slice(endpoints=[endpoint("10.244.1.5", "n1"), endpoint("10.244.2.6", "n2")])],
        nodes=[node("n1"), node("n2", internal="192.168.1.11")],
    )
    return desired_state(node_name="n1", **objs)


def test_desired_state_is_the_agents_view_of_the_objects():
    state, node_state = world()
    ((name, svc),) = state.services.items()
    assert (str(name), svc.node_port, svc.external_policy_local) == ("default/web:http", 30080, True)
    assert [(ep.ip, ep.is_local) for ep in state.endpoints_of(name)] == [("10.244.1.5", True), ("10.244.2.6", False)]
    assert node_state.name == "n1" and state.topology.node_name == "n1"


def test_flows_cover_every_frontend_and_sender_but_hairpins():
    state, _ = world()
    flows = flows_for(state, NODE, SENDERS)
    kinds = {(f.frontend, f.sender.label) for f in flows}
    assert ("localhost nodePort", "the node") in kinds and ("localhost nodePort", "outside") not in kinds
    assert {f.frontend for f in flows} == {"clusterIP", "nodePort", "localhost nodePort", "externalIP"}
    assert not any(f.sender.label == "backend pod" for f in flows)
    assert len(flows) == 3 * 3 + 1


def model_tracer(state, node, datapath="ebpf", **changes):
    def trace(spec):
        exp = expected(spec, state, node)
        t = Trace(datapath, exp.verdict, exp.reason, exp.service, tuple(exp.backends), exp.masquerade)
        return replace(t, **changes) if exp.verdict == "dnat" else t
    return trace


def test_agreeing_tracers_pass_and_a_wrong_one_is_named_with_its_flow():
    state, _ = world()
    flows = flows_for(state, NODE, SENDERS)
    assert verify(flows, state, NODE, {"ebpf": model_tracer(state, NODE)}).ok
    report = verify(flows, state, NODE, {"ebpf": model_tracer(state, NODE),
                                         "iptables": model_tracer(state, NODE, "iptables", masquerade=True)})
    assert not report.ok and report.flows == len(flows)
    wrong = {(m.flow.frontend, m.flow.sender.label) for m in report.mismatches}
    assert ("clusterIP", "pod (this node)") in wrong and ("nodePort", "outside") in wrong
    text = report.mismatches[0].render()
    assert "iptables: masquerade True, the model says False" in text and "default/web:http" in text


def test_a_tracer_that_fails_is_reported_not_raised():
    state, _ = world()

    def broken(spec):
        raise OSError("no pinned programs")
    report = verify(flows_for(state, NODE, SENDERS[:1]), state, NODE, {"ebpf": broken})
    assert not report.ok and "no pinned programs" in report.errors[0]
