"""The unchecked reading of a plain IPv4 endpoint (convert._plain_ipv4_endpoint, issue 12) gives
exactly what the checked path gives, for any endpoint: the same values, or the checked path's
report where it declines."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ebpf_proxy.k8s import convert
from ebpf_proxy.model.endpoints import PortlessEndpoints

ANY = st.none() | st.booleans() | st.integers(-2, 2) | st.text(max_size=3) | st.just({}) | st.just([])
ADDRESS = st.sampled_from(["10.0.0.1", "10.0.00.1", "10.1", "::ffff:10.0.0.1", "fd00::1", "1.2.3.4\x00", " 1.2.3.4",
                           "255.255.255.255", "256.0.0.1", ""]) | ANY
CONDITION = st.none() | st.booleans() | ANY
CONDITIONS = st.dictionaries(st.sampled_from(["ready", "serving", "terminating", "other"]), CONDITION, max_size=4)
ENDPOINT = st.fixed_dictionaries({}, optional={
    "addresses": st.lists(ADDRESS, max_size=2) | ANY,
    "conditions": CONDITIONS | ANY,
    "nodeName": st.sampled_from(["n1", "n2", ""]) | ANY,
}) | ANY


def checked(ep, family):
    try:
        fast = convert._plain_ipv4_endpoint
        convert._plain_ipv4_endpoint = lambda *_: None
        return "value", convert._slice_endpoint(ep, "endpoints[0]", "n1", family)
    except convert._Reject as err:
        return "reject", (err.field, err.reason, err.detail)
    finally:
        convert._plain_ipv4_endpoint = fast


def either(ep, family):
    try:
        return "value", convert._slice_endpoint(ep, "endpoints[0]", "n1", family)
    except convert._Reject as err:
        return "reject", (err.field, err.reason, err.detail)


@settings(max_examples=1500, deadline=None)
@given(ep=ENDPOINT, family=st.sampled_from([4, 6]))
def test_the_fast_reading_of_an_endpoint_is_the_checked_one(ep, family):
    assert either(ep, family) == checked(ep, family)


def test_a_plain_endpoint_takes_the_fast_reading():
    ep = {"addresses": ["10.0.0.1"], "nodeName": "n1", "conditions": {"ready": True, "serving": True, "terminating": False}}
    assert convert._plain_ipv4_endpoint(ep, "n1") == ("10.0.0.1", "n1", True, True, False, True)
    assert convert._plain_ipv4_endpoint({"addresses": ["10.0.0.1"], "conditions": {"ready": False}}, "n1") == \
        ("10.0.0.1", None, False, False, False, False)


def per_endpoint(eps, node):
    """What _plain_ipv4_rows must give: the rows _plain_ipv4_endpoint reads, packed; None where
    one of them declines or has hints."""
    rows = []
    for ep in eps:
        row = convert._plain_ipv4_endpoint(ep, node)
        if row is None or ep.get("hints") is not None:
            return None
        rows.append(row + ((), ()))
    return PortlessEndpoints(rows)


PLAINISH = st.fixed_dictionaries({"addresses": st.sampled_from([["10.0.0.1"], ["10.0.0.2", "x"], ["10.0.0.10"]])},
                                 optional={"conditions": CONDITIONS, "nodeName": st.sampled_from(["n1", "n2", "", None]),
                                           "hints": st.sampled_from([None, {}])})


@settings(max_examples=1500, deadline=None)
@given(eps=st.lists(PLAINISH | ENDPOINT, max_size=4), node=st.sampled_from(["n1", "n2"]))
def test_a_slice_s_endpoints_packed_at_once_are_the_rows_read_one_by_one(eps, node):
    got, want = convert._plain_ipv4_rows(eps, node), per_endpoint(eps, node)
    assert (got is None) == (want is None)
    if got is not None:
        for port in (1, 80, 65535):
            packed, expected = got.with_port(port), want.with_port(port)
            assert packed == expected and type(packed) is type(expected)
            assert list(packed) == list(expected)
        assert got._row_tuples() == want._row_tuples()


def test_a_condition_equal_to_a_boolean_but_not_one_is_not_plain():
    """1 == True (and hashes alike): the fields looked up by value must not take 1 for true."""
    plain = {"addresses": ["10.0.0.1"], "conditions": {"ready": True}, "nodeName": "n1"}
    assert convert._plain_ipv4_rows([plain], "n1") is not None  # (n1, True, ...) now known
    for odd in ({"ready": 1}, {"serving": 0}, {"terminating": 1.0}):
        assert convert._plain_ipv4_rows([plain, {**plain, "conditions": odd}], "n1") is None
    assert convert._plain_ipv4_rows([{**plain, "nodeName": ["n1"]}], "n1") is None  # unhashable: declined
