"""model/tracker.py: desired state + what changed since the last *successful* sync."""

from __future__ import annotations

import sys

from ebpf_proxy.model import ChangeTracker, Endpoint, NodeState, Protocol, ServicePort, ServicePortName
from ebpf_proxy.model import tracker as tracker_mod

HTTP = ServicePortName("default", "web", "http", Protocol.TCP)
DNS = ServicePortName("default", "web", "dns", Protocol.UDP)
OTHER = ServicePortName("default", "api", "", Protocol.TCP)


def sp(name: ServicePortName, port: int = 80, **kw) -> ServicePort:
    return ServicePort(name=name, cluster_ip="10.96.0.10", port=port, protocol=name.protocol, **kw)


def ep(ip: str, port: int = 8080, local: bool = False, ready: bool = True, serving: bool | None = None) -> Endpoint:
    return Endpoint(ip=ip, port=port, node_name="n1" if local else "n2", ready=ready,
                    serving=ready if serving is None else serving, is_local=local)


def tracker_with_web() -> ChangeTracker:
    t = ChangeTracker()
    t.update_service("default", "web", [sp(HTTP), sp(DNS, 53)])
    t.update_slice("default", "web-a", "web", {HTTP: (ep("10.0.0.1"),), DNS: (ep("10.0.0.1", 53),)})
    return t


def synced(t: ChangeTracker) -> ChangeTracker:
    t.take()
    t.commit()
    return t


def test_first_take_is_full_and_has_the_whole_state():
    t = tracker_with_web()
    state, changes = t.take()
    assert changes.full
    assert changes.services == {HTTP, DNS}
    assert set(state.services) == {HTTP, DNS}
    assert state.endpoints_of(HTTP) == (ep("10.0.0.1"),)
    # UDP port went from nothing to a serving endpoint: old black-holed conntrack entries must go
    assert changes.stale_udp_services == {DNS}


def test_nothing_changed_after_commit():
    t = synced(tracker_with_web())
    assert not t.pending
    state, changes = t.take(full=False)
    assert not changes.full and changes.services == frozenset()
    assert set(state.services) == {HTTP, DNS}  # the full state is always there


def test_full_flag_is_passed_through():
    t = synced(tracker_with_web())
    assert t.take(full=True)[1].full


def test_endpoint_change_lists_only_that_service_port():
    t = synced(tracker_with_web())
    t.update_slice("default", "web-a", "web", {HTTP: (ep("10.0.0.1"), ep("10.0.0.2")), DNS: (ep("10.0.0.1", 53),)})
    state, changes = t.take()
    assert changes.services == {HTTP}
    assert [e.ip for e in state.endpoints_of(HTTP)] == ["10.0.0.1", "10.0.0.2"]
    assert changes.stale_udp_endpoints == frozenset() and changes.stale_udp_services == frozenset()


def test_removed_udp_endpoint_is_stale_tcp_is_not():
    t = tracker_with_web()
    t.update_slice("default", "web-a", "web", {HTTP: (ep("10.0.0.1"), ep("10.0.0.2")),
                                                DNS: (ep("10.0.0.1", 53), ep("10.0.0.2", 53))})
    synced(t)
    t.update_slice("default", "web-a", "web", {HTTP: (ep("10.0.0.1"),), DNS: (ep("10.0.0.1", 53),)})
    _, changes = t.take()
    assert changes.services == {HTTP, DNS}
    assert changes.stale_udp_endpoints == {(DNS, "10.0.0.2")}


def test_udp_endpoint_that_stops_serving_is_stale():
    t = synced(tracker_with_web())
    t.update_slice("default", "web-a", "web", {HTTP: (ep("10.0.0.1"),), DNS: (ep("10.0.0.1", 53, ready=False),)})
    _, changes = t.take()
    assert changes.stale_udp_endpoints == {(DNS, "10.0.0.1")}


def test_udp_service_going_from_no_endpoints_to_some():
    t = ChangeTracker()
    t.update_service("default", "web", [sp(DNS, 53)])
    t.update_slice("default", "web-a", "web", {DNS: (ep("10.0.0.1", 53, ready=False),)})
    synced(t)
    t.update_slice("default", "web-a", "web", {DNS: (ep("10.0.0.1", 53),)})
    _, changes = t.take()
    assert changes.stale_udp_services == {DNS}
    assert changes.stale_udp_endpoints == frozenset()


def test_change_then_revert_before_a_sync_is_no_change():
    t = synced(tracker_with_web())
    t.update_service("default", "web", [sp(HTTP, 81), sp(DNS, 53)])
    t.update_service("default", "web", [sp(HTTP), sp(DNS, 53)])
    assert t.take()[1].services == frozenset()


def test_failed_sync_keeps_the_changes_for_the_next_take():
    t = synced(tracker_with_web())
    t.update_slice("default", "web-a", "web", {HTTP: (ep("10.0.0.1"),)})  # DNS endpoint gone
    _, first = t.take()
    t.abort()
    assert t.pending
    _, second = t.take(full=True)
    assert second.full
    assert second.services == first.services == {DNS}
    assert second.stale_udp_endpoints == first.stale_udp_endpoints == {(DNS, "10.0.0.1")}
    t.commit()
    assert t.take()[1].services == frozenset()


def test_take_without_commit_or_abort_counts_as_failed():
    t = synced(tracker_with_web())
    t.delete_service("default", "web")
    t.take()
    _, again = t.take()
    assert again.services == {HTTP, DNS}


def test_change_during_a_sync_is_reported_by_the_next_take():
    t = synced(tracker_with_web())
    t.update_service("default", "web", [sp(HTTP, 81), sp(DNS, 53)])
    t.take()
    t.update_service("default", "web", [sp(HTTP, 82), sp(DNS, 53)])  # arrives while syncing
    t.commit()
    state, changes = t.take()
    assert changes.services == {HTTP}
    assert state.services[HTTP].port == 82


def test_the_state_being_programmed_never_changes_under_the_datapath():
    """take() hands its dicts out uncopied (copy-on-write): a change while the state is being
    programmed, after its commit, or after an abort must leave that state as it was taken."""
    t = synced(tracker_with_web())
    state, _ = t.take()
    t.update_service("default", "web", [sp(HTTP, 81)])  # during the sync: copies first
    t.update_slice("default", "web-a", "web", {HTTP: (ep("10.0.0.9"),)})
    assert state.services[HTTP].port == 80 and DNS in state.services
    assert state.endpoints_of(HTTP) == (ep("10.0.0.1"),)
    t.commit()
    newer, changes = t.take()
    assert newer.services[HTTP].port == 81 and DNS not in newer.services and newer.endpoints_of(HTTP) == (ep("10.0.0.9"),)
    t.commit()  # copies off the change path; later changes go to the copies
    t.update_service("default", "api", [sp(OTHER)])
    t.update_slice("default", "api-a", "api", {OTHER: (ep("10.0.0.5"),)})
    assert OTHER not in newer.services and OTHER not in newer.endpoints
    t.abort()
    latest, changes = t.take()
    assert changes.services == {OTHER} and latest.endpoints_of(OTHER) == (ep("10.0.0.5"),)
    t.abort()
    t.update_service("default", "api", [])
    assert OTHER in latest.services and OTHER in latest.endpoints  # an aborted take's state too


def test_deleted_service_is_listed_and_absent_from_the_state():
    t = synced(tracker_with_web())
    assert t.delete_service("default", "web")
    state, changes = t.take()
    assert changes.services == {HTTP, DNS}
    assert state.services == {} and state.endpoints == {}
    assert not t.delete_service("default", "web")  # already gone: no change


def test_endpoints_wait_for_their_service():
    t = ChangeTracker()
    t.update_slice("default", "api-a", "api", {OTHER: (ep("10.0.0.9"),)})
    state, changes = t.take()
    assert state.endpoints == {} and changes.services == frozenset()
    t.commit()
    t.update_service("default", "api", [sp(OTHER)])
    state, changes = t.take()
    assert changes.services == {OTHER}
    assert state.endpoints_of(OTHER) == (ep("10.0.0.9"),)


def test_slices_of_one_service_are_merged_and_deduplicated_preferring_local():
    t = ChangeTracker()
    t.update_service("default", "web", [sp(HTTP)])
    t.update_slice("default", "web-a", "web", {HTTP: (ep("10.0.0.1"), ep("10.0.0.2"))})
    t.update_slice("default", "web-b", "web", {HTTP: (ep("10.0.0.2", local=True), ep("10.0.0.3"))})
    state, _ = t.take()
    assert state.endpoints_of(HTTP) == (ep("10.0.0.1"), ep("10.0.0.2", local=True), ep("10.0.0.3"))


def test_deleting_one_slice_keeps_the_others():
    t = ChangeTracker()
    t.update_service("default", "web", [sp(DNS, 53)])
    t.update_slice("default", "web-a", "web", {DNS: (ep("10.0.0.1", 53),)})
    t.update_slice("default", "web-b", "web", {DNS: (ep("10.0.0.2", 53),)})
    synced(t)
    assert t.delete_slice("default", "web-a")
    state, changes = t.take()
    assert [e.ip for e in state.endpoints_of(DNS)] == ["10.0.0.2"]
    assert changes.stale_udp_endpoints == {(DNS, "10.0.0.1")}
    assert not t.delete_slice("default", "unknown")


def test_slice_moving_to_another_service_leaves_the_first():
    t = ChangeTracker()
    t.update_service("default", "web", [sp(HTTP)])
    t.update_service("default", "api", [sp(OTHER)])
    t.update_slice("default", "s", "web", {HTTP: (ep("10.0.0.1"),)})
    synced(t)
    t.update_slice("default", "s", "api", {OTHER: (ep("10.0.0.1"),)})
    state, changes = t.take()
    assert changes.services == {HTTP, OTHER}
    assert state.endpoints_of(HTTP) == () and state.endpoints_of(OTHER) == (ep("10.0.0.1"),)


def test_identical_update_is_not_a_change():
    t = synced(tracker_with_web())
    assert not t.update_service("default", "web", [sp(HTTP), sp(DNS, 53)])
    assert not t.update_slice("default", "web-a", "web", {HTTP: (ep("10.0.0.1"),), DNS: (ep("10.0.0.1", 53),)})
    assert not t.pending


def test_trigger_times_come_back_on_commit_and_survive_a_failed_sync():
    t = ChangeTracker(start_time=1000.0)
    t.update_service("default", "web", [sp(HTTP)])
    t.update_slice("default", "web-a", "web", {HTTP: (ep("10.0.0.1"),)}, trigger_time=999.0)  # before start
    synced(t)
    t.update_slice("default", "web-a", "web", {HTTP: (ep("10.0.0.2"),)}, trigger_time=1010.0)
    t.update_slice("default", "web-a", "web", {HTTP: (ep("10.0.0.3"),)}, trigger_time=1011.0)
    t.update_slice("default", "web-a", "web", {HTTP: (ep("10.0.0.3"),)}, trigger_time=1012.0)  # no change
    t.take()
    t.abort()
    t.take()
    assert t.commit() == [1010.0, 1011.0]
    t.take()
    assert t.commit() == []


def test_first_commit_ignores_trigger_times_from_before_the_tracker():
    t = ChangeTracker(start_time=1000.0)
    t.update_service("default", "web", [sp(HTTP)])
    t.update_slice("default", "web-a", "web", {HTTP: (ep("10.0.0.1"),)}, trigger_time=999.0)
    t.take()
    assert t.commit() == []


def test_node_state_is_tracked_without_dirtying_services():
    t = synced(tracker_with_web())
    node = NodeState(name="n1", addresses=("192.168.1.10",), primary_ip="192.168.1.10")
    assert t.update_node(node)
    assert not t.update_node(node)
    assert t.node == node
    assert not t.pending
    assert t.update_node(None) and t.node is None


def test_state_is_a_snapshot():
    t = synced(tracker_with_web())
    state, _ = t.take()
    t.commit()
    t.delete_service("default", "web")
    assert set(state.services) == {HTTP, DNS}


def test_state_endpoints_are_those_of_existing_service_ports_after_any_sequence():
    """take() hands out endpoints kept in step with every change (not filtered per sync): after
    any mix of service and slice changes, they are exactly the merged endpoints of the service
    ports that exist, as a from-scratch filter computes them."""
    import random

    rng = random.Random(7)
    names = ["a", "b", "c"]
    ports = {n: [ServicePortName("default", n, p, Protocol.TCP) for p in ("http", "admin")] for n in names}
    t = ChangeTracker()
    slices: dict[str, dict] = {}
    services: dict[str, list] = {}
    for step in range(400):
        n = rng.choice(names)
        op = rng.random()
        if op < 0.3:
            chosen = [p for p in ports[n] if rng.random() < 0.7]
            t.update_service("default", n, [sp(p) for p in chosen])
            services[n] = chosen
        elif op < 0.45:
            t.delete_service("default", n)
            services[n] = []
        elif op < 0.85:
            sl_name = f"{n}-{rng.randint(0, 1)}"
            eps = {p: (ep(f"10.0.{step % 250}.{rng.randint(1, 3)}"),) for p in ports[n] if rng.random() < 0.7}
            t.update_slice("default", sl_name, n, eps)
            slices[sl_name] = eps
        else:
            sl_name = f"{n}-{rng.randint(0, 1)}"
            t.delete_slice("default", sl_name)
            slices.pop(sl_name, None)
        state, _ = t.take()
        t.commit()
        expected = {}
        for n2 in names:
            for p in services.get(n2, []):
                merged = sorted({e for s_name in sorted(slices) if s_name.startswith(f"{n2}-")
                                 for e in slices[s_name].get(p, ())})
                if merged:
                    expected[p] = tuple(merged)
        assert state.endpoints == expected, f"step {step}"


def test_zone_change_makes_the_next_take_full_with_the_new_topology():
    """kube-proxy's NodeTopologyConfig: a new zone label forces a full resync (every service's
    hints may now select other endpoints, though no service changed)."""
    t = synced(tracker_with_web())
    assert t.update_node(NodeState(name="n1", zone="zone-a"))
    assert t.pending
    state, changes = t.take()
    assert changes.full and changes.services == frozenset()
    assert state.topology.zone == "zone-a"
    t.commit()
    assert not t.pending
    # another change of the node that keeps the zone: no resync
    assert t.update_node(NodeState(name="n1", zone="zone-a", addresses=("192.168.1.10",)))
    assert not t.pending
    _, changes = t.take()
    assert not changes.full


def test_node_name_reaches_the_state_and_a_lost_zone_resyncs():
    t = ChangeTracker(node_name="n1")
    t.update_node(NodeState(name="n1", zone="zone-a"))
    synced(t)
    assert t.update_node(None)  # Node deleted: its zone is unknown now
    state, changes = t.take()
    assert changes.full and state.topology.node_name == "n1" and state.topology.zone == ""


def test_aborted_zone_resync_is_full_again():
    t = synced(tracker_with_web())
    t.update_node(NodeState(name="n1", zone="zone-b"))
    t.take()
    t.abort()
    assert t.pending
    _, changes = t.take()
    assert changes.full
    t.commit()
    _, changes = t.take()
    assert not changes.full


def _one_port_cases():
    name = ServicePortName("ns", "web", "http", Protocol.TCP)
    twin = ServicePortName("ns", "web", "http", Protocol.TCP)  # equal, another object
    other = ServicePortName("ns", "web", "dns", Protocol.UDP)
    eps = tracker_mod.merge([(Endpoint("10.0.0.1", 80),)])
    for key in (name, twin, other):
        for value in (ServicePort(key, "10.96.0.1", 80, key.protocol), eps):
            yield name, key, value


def test_one_port_renaming_without_dicts_is_the_general_renaming():
    """_named_as's shortcut for a one-port Service and a one-port slice (OneEntry each) gives what
    the general path gives for the same entries in dicts: the same keys (the very objects) and values."""
    from ebpf_proxy.model.compact import OneEntry

    for known, key, value in _one_port_cases():
        fast = tracker_mod._named_as(OneEntry(known, None), OneEntry(key, value))
        general = tracker_mod._named_as({known: None}, {key: value})
        assert type(fast) is OneEntry and fast == general
        ((got_key, got_value),), ((want_key, want_value),) = fast.items(), list(general.items())
        assert got_key is want_key and got_value == want_value
        if hasattr(got_value, "name"):
            assert got_value.name is want_value.name is got_key


def test_a_lone_merged_slice_is_kept_as_the_general_merge_keeps_it():
    from ebpf_proxy.k8s import convert
    from ebpf_proxy.bench.cpscale import slice_object

    for obj in (slice_object(3, 10, 5), slice_object(4, 0, 5), slice_object(5, 1, 5)):
        sl = convert.endpoint_slice(obj, "worker1")
        fast = tracker_mod._merge_endpoints([sl.endpoints])
        general = tracker_mod._merge_endpoints(iter([sl.endpoints]))  # not a list: no shortcut
        assert fast == general and type(fast) is type(general)
        assert [type(v) for v in fast.values()] == [type(v) for v in general.values()]


def test_a_service_key_is_one_string_object_for_the_service_and_its_slices():
    t = ChangeTracker()
    ns, name = "".join(["def", "ault"]), "".join(["w", "eb"])  # not the constants' objects
    t.update_service(ns, name, [sp(HTTP)])
    t.update_slice(ns, "web-a", "".join(["w", "eb"]), {HTTP: (ep("10.0.0.1"),)})
    t.update_slice(ns, "web-b", "".join(["w", "eb"]), {HTTP: (ep("10.0.0.2"),)})
    key = next(iter(t._services))
    assert key == "default/web"
    assert t._slices[("default", "web-a")].service_key is key and t._slices[("default", "web-b")].service_key is key
    assert next(iter(t._endpoints)) is key and next(iter(t._slices_by_service)) is key
    # and the Services watch cache's key (k8s/watch.py, intern_keys=True) is that object too
    assert key is sys.intern(f"{ns}/{name}")
