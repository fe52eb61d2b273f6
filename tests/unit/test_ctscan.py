"""The conntrack GC's raw reading (datapath/ebpf/ctscan.py) judges every half as the decoded one
did (maps._owner_tuple + maps._half_is_live), for both tables, on connections and halves drawn
from small value ranges so that near misses (one field off) are common. No root: plain bytes."""

from __future__ import annotations

import ctypes
import random

import pytest

from ebpf_proxy.datapath.ebpf import ctscan
from ebpf_proxy.datapath.ebpf import maps as mp
from ebpf_proxy.datapath.ebpf import structs as s

NOW = 10**12
HALF_KINDS = (s.CT4_REV_DNAT, s.CT4_SNAT, s.CT4_REV_SNAT, 7)  # 7: a kind no connection owns


def _addr(rng: random.Random, table) -> object:
    if table is mp._CT4:
        return rng.choice((0x0a000001, 0x0a000002, 0x0a0000ff))
    return s.In6.from_buffer_copy(bytes(15) + bytes((rng.choice((1, 2, 255)),)))


def _key(rng, table, kind):
    return table.key(saddr=_addr(rng, table), daddr=_addr(rng, table), sport=rng.choice((80, 81)),
                     dport=rng.choice((80, 81)), proto=rng.choice((6, 17)), kind=kind)


def _entry(rng, table):
    return table.entry(expires=rng.choice((NOW - 1, NOW, NOW + 1)), nat_addr=_addr(rng, table),
                       svc_addr=_addr(rng, table), nat_port=rng.choice((80, 81)), svc_port=rng.choice((80, 81)),
                       backend_id=rng.randrange(3), snat_addr=_addr(rng, table), snat_port=rng.choice((80, 81)),
                       flags=rng.choice((0, s.CT4_F_MASQ, s.CT4_F_CLOSING, s.CT4_F_MASQ | s.CT4_F_CLOSING)),
                       state=rng.choice((0, s.CT4_S_ASSURED, s.CT4_S_REMAP, s.CT4_S_REMAP | s.CT4_S_ASSURED)))


def _half_of(rng, table, k, v):
    """A half of connection (k, v) as the datapath writes it (ct4_create), or one field off."""
    kind = rng.choice(HALF_KINDS[:3])
    if kind == s.CT4_REV_DNAT and v.state & s.CT4_S_REMAP:  # backend -> client, keyed by the remapped port
        hk = table.key(saddr=v.nat_addr, daddr=k.saddr, sport=v.nat_port, dport=v.snat_port, proto=k.proto, kind=kind)
        hv = table.entry(svc_addr=k.daddr, svc_port=k.dport, snat_port=k.sport, state=s.CT4_S_REMAP)
    elif kind == s.CT4_REV_DNAT:  # backend -> client
        hk = table.key(saddr=v.nat_addr, daddr=k.saddr, sport=v.nat_port, dport=k.sport, proto=k.proto, kind=kind)
        hv = table.entry(svc_addr=k.daddr, svc_port=k.dport)
    elif kind == s.CT4_SNAT and v.state & s.CT4_S_REMAP:  # keyed by the masquerade port it leaves with
        hk = table.key(saddr=k.saddr, daddr=v.nat_addr, sport=v.snat_port, dport=v.nat_port, proto=k.proto, kind=kind)
        hv = table.entry(svc_addr=k.daddr, svc_port=k.dport, nat_port=v.snat_port, snat_port=k.sport,
                         state=s.CT4_S_REMAP)
    elif kind == s.CT4_SNAT:  # client -> backend, from the masquerade address:port
        hk = table.key(saddr=k.saddr, daddr=v.nat_addr, sport=k.sport, dport=v.nat_port, proto=k.proto, kind=kind)
        hv = table.entry(svc_addr=k.daddr, svc_port=k.dport, nat_port=v.snat_port)
    else:  # backend -> masquerade address:port
        hk = table.key(saddr=v.nat_addr, daddr=_addr(rng, table), sport=v.nat_port, dport=v.snat_port,
                       proto=k.proto, kind=kind)
        hv = table.entry(nat_addr=k.saddr, svc_addr=k.daddr, nat_port=k.sport, svc_port=k.dport)
    if rng.random() < 0.5:  # one field off
        other_k, other_v = _key(rng, table, kind), _entry(rng, table)
        name = rng.choice([n for n, _ in table.key._fields_ if n not in ("kind", "pad")] +
                          ["nat_addr", "svc_addr", "nat_port", "svc_port", "snat_port", "state"])
        if hasattr(other_k, name) and name in ("saddr", "daddr", "sport", "dport", "proto"):
            setattr(hk, name, getattr(other_k, name))
        else:
            setattr(hv, name, getattr(other_v, name))
    return hk, hv


@pytest.mark.parametrize("table", [mp._CT4, mp._CT6], ids=["epx_ct4", "epx_ct6"])
def test_a_half_is_live_for_ctscan_exactly_when_it_is_for_the_decoded_check(table):
    rng = random.Random(12)
    layout = ctscan.Layout(table.key, table.entry)
    flat = table.flat
    agree = {True: 0, False: 0}
    remapped = {True: 0, False: 0}  # the same for reply and SNAT halves of remapped connections (CT4_S_REMAP)
    for _ in range(300):
        owners = {}
        for _ in range(rng.randrange(1, 40)):
            k = _key(rng, table, s.CT4_SVC)
            fk = flat(k)
            owners[(fk.saddr, fk.daddr, fk.sport, fk.dport, fk.proto)] = (k, _entry(rng, table))
        live = ctscan.Hashes()
        for k, v in owners.values():
            if v.expires > NOW:  # an expired connection is gone: its halves are not live
                for identity in layout.owner_identities(bytes(k), bytes(v)):
                    live.add(identity)
        live.seal()
        for _ in range(40):
            if rng.random() < 0.5:
                k, v = _half_of(rng, table, *rng.choice(list(owners.values())))
            else:
                k, v = _key(rng, table, rng.choice(HALF_KINDS)), _entry(rng, table)
            fk, fv = flat(k), flat(v)
            owner_key = mp._owner_tuple(fk, fv)
            owner = owners.get(owner_key) if owner_key else None
            expected = mp._half_is_live(fk, fv, flat(owner[1]) if owner is not None else None, NOW)
            identity = layout.half_identity(bytes(k), bytes(v))
            assert (identity is not None and identity in live) == expected, (k, v, owner)
            agree[expected] += 1
            if k.kind in (s.CT4_REV_DNAT, s.CT4_SNAT) and v.state & s.CT4_S_REMAP:
                remapped[expected] += 1
    assert agree[True] > 1000 and agree[False] > 1000, f"too few cases of one outcome: {agree}"
    assert remapped[True] > 100 and remapped[False] > 100, f"too few remapped halves of one outcome: {remapped}"


def test_raw_reads_batches_and_key_walks_alike():
    keys = (s.CT4Key * 4)(*(s.CT4Key(saddr=i, sport=i, kind=i % 2) for i in range(4)))
    packed = b"".join(bytes(keys[i]) for i in range(3))
    assert ctscan.raw(keys, 3, ctypes.sizeof(s.CT4Key)) == packed
    assert ctscan.raw((keys[0], keys[1], keys[2]), 3, ctypes.sizeof(s.CT4Key)) == packed


def test_live_halves_answers_for_what_was_added_only():
    live = ctscan.Hashes()
    added = [bytes((i % 256, i // 256)) * 5 for i in range(5000)]
    for identity in added:
        live.add(identity)
    live.seal()
    assert all(identity in live for identity in added)
    assert not any(bytes((i % 256, i // 256, 1)) * 5 in live for i in range(5000))
