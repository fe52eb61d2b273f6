"""structs.py against the C: layouts against bcc's reflection, constants against common.h."""

from __future__ import annotations

import ctypes
import re

import pytest

from ebpf_proxy.datapath.ebpf import loader, structs
from tests.bpf.conftest import SMALL_MAPS

COMMON_H = loader.BPF_SRC_DIR / "lib" / "common.h"


def _layout(ctype: type) -> list[tuple[str, int, int]] | int:
    """(field, offset, size) of a struct, or the size of a scalar."""
    if not issubclass(ctype, ctypes.Structure):
        return ctypes.sizeof(ctype)
    return [(name, getattr(ctype, name).offset, getattr(ctype, name).size) for name, *_ in ctype._fields_]


@pytest.fixture(scope="module")
def bcc_tables(tmp_bpffs_factory):
    """bcc's reflection of maps.c: compiled in this process (the agent's loader compiles in a child
    and keeps no tables), into a bpffs of its own, maps only."""
    loaded = loader.load(tmp_bpffs_factory("structs"), programs=(), max_entries=SMALL_MAPS, in_process=True)
    yield loaded.tables
    loaded.close()


@pytest.mark.bpf
@pytest.mark.root
@pytest.mark.parametrize("name", sorted(structs.MAPS))
def test_map_layout_matches_bcc(bcc_tables, name):
    spec = structs.MAPS[name]
    table = bcc_tables[name]
    leaf = getattr(table, "sLeaf", table.Leaf)  # per-CPU tables: Leaf is the per-CPU array
    assert ctypes.sizeof(spec.key) == ctypes.sizeof(table.Key)
    assert ctypes.sizeof(spec.leaf) == ctypes.sizeof(leaf)
    assert _layout(spec.key) == _layout(table.Key)
    assert _layout(spec.leaf) == _layout(leaf)


def test_mirror_covers_every_map_of_maps_c():
    declared = dict((name, kind) for kind, name in re.findall(
        r"BPF_TABLE_PINNED\(\"(\w+)\",[^,]+,[^,]+,\s*(\w+),", (loader.BPF_SRC_DIR / "maps.c").read_text()))
    assert sorted(declared) == sorted(structs.MAPS)
    assert {name: spec.kind for name, spec in structs.MAPS.items()} == declared, "map types (loader.py recreates a pin of another)"


def test_reasons_match_the_c_enum():
    text = COMMON_H.read_text()
    body = text[text.index("enum epx_reason {") : text.index("};", text.index("enum epx_reason {"))]
    c_reasons = {name: int(value) for name, value in re.findall(r"EPX_(\w+) = (\d+),", body)}
    assert c_reasons.pop("REASON_MAX") == structs.REASON_MAX == len(structs.Reason)
    assert c_reasons == {r.name: r.value for r in structs.Reason}
    # epx_is_drop (stats.h): the range EPX_DROP_FIRST..EPX_DROP_LAST, plus the drops appended later
    appended = (structs.Reason.DROP_CT_FULL, structs.Reason.DROP_HANDOVER_HELD, structs.Reason.DROP_MALFORMED_IPV6,
                structs.Reason.DROP_IPV6_EXTHDRS, structs.Reason.DROP_SCTP_FRAG,
                structs.Reason.DROP_LOCALHOST6_NO_LOCAL)
    drops = [r for r in structs.Reason if r.is_drop and r not in appended]
    assert (min(drops), max(drops)) == (structs.Reason.DROP_MALFORMED_IP, structs.Reason.DROP_REJECT_FAILED)
    assert all(r.is_drop for r in structs.Reason if min(drops) <= r <= max(drops))
    for reason in appended:
        assert reason.is_drop and f"EPX_{reason.name}" in (loader.BPF_SRC_DIR / "lib" / "stats.h").read_text()


def test_flag_constants_match_common_h():
    defines = dict(
        re.findall(r"#define ((?:LB4_F|LB4_SCOPE|LB4_BE|CT4|CFG_F|EPX_ORIGIN|EPX_TRACE|EPX_HOOK)_?\w*)\s+(0x[0-9a-fA-F]+|\d+)\b", COMMON_H.read_text())
    )
    assert len(defines) >= 20
    for name, value in defines.items():
        assert getattr(structs, name.removeprefix("EPX_")) == int(value, 0), name
