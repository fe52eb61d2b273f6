"""ServicePrograms keeps its frontend and backend counts in step with `current` (the agent
reports them after every sync; recounting 100,000 service ports each time cost more than the sync)."""

from __future__ import annotations

from ebpf_proxy.datapath.ebpf.services import ServicePrograms
from ebpf_proxy.model import Endpoint, Protocol, ServicePort, ServicePortName
from tests.unit.test_fuzz_k8s import _NullMaps


def name(i: int) -> ServicePortName:
    return ServicePortName("default", f"s{i}", "", Protocol.TCP)


def svc(i: int, node_port: int = 0) -> ServicePort:
    return ServicePort(name=name(i), cluster_ip=f"10.96.0.{i + 10}", port=80, protocol=Protocol.TCP,
                       node_port=node_port)


def eps(i: int, n: int) -> tuple[Endpoint, ...]:
    return tuple(Endpoint(f"10.244.{i}.{j + 2}", 8080, node_name="n2") for j in range(n))


def recount(programs: ServicePrograms) -> tuple[int, int]:
    current = programs.current.values()
    return sum(len(e.frontends) for e in current), sum(len(e.backends) for e in current)


def test_counts_follow_adds_updates_deletes_and_take_overs():
    programs = ServicePrograms(_NullMaps())
    steps = [(0, svc(0), eps(0, 3)), (1, svc(1, node_port=30001), eps(1, 2)), (0, svc(0, node_port=30000), eps(0, 5)),
             (1, svc(1), eps(1, 0)), (0, None, ()), (2, svc(2), eps(2, 4))]
    for i, port, endpoints in steps:
        programs.apply(name(i), programs.entries(port, endpoints) if port else None)
        assert (programs.frontend_count, programs.backend_count) == recount(programs)
    assert recount(programs) == (2, 4)  # s1 (ClusterIP, no endpoints) and s2 (4 endpoints)
    restarted = ServicePrograms(_NullMaps())
    for n, entries in programs.current.items():
        restarted.take_over(n, entries)
    restarted.take_over(name(2), programs.current[name(2)])  # the same port twice counts once
    assert (restarted.frontend_count, restarted.backend_count) == recount(programs)
