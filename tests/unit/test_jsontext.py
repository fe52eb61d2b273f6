"""k8s/jsontext.loads reads every text exactly as json.loads does (value and type, or the error),
using orjson only where the two agree (issue 12: LIST pages decoded faster)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ebpf_proxy.k8s import jsontext


def same(a, b) -> bool:
    """Equal, and of the same types all the way down (1 == 1.0 == True in Python: not here)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    return a == b


def outcome(text):
    try:
        return "value", jsontext.loads(text)
    except Exception as exc:  # the exception's type is part of the contract
        return "error", type(exc)


def reference(text):
    try:
        return "value", json.loads(text)
    except Exception as exc:
        return "error", type(exc)


def check(text) -> None:
    got, want = outcome(text), reference(text)
    assert got[0] == want[0] and (same(got[1], want[1]) if got[0] == "value" else got[1] is want[1]), (text, got, want)


SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(1 << 70), max_value=1 << 70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                      max_leaves=20)


@settings(max_examples=400, deadline=None)
@given(value=VALUES, as_bytes=st.booleans(), spaced=st.booleans())
def test_any_value_json_writes_reads_back_as_json_reads_it(value, as_bytes, spaced):
    text = json.dumps(value, separators=(", ", ": ") if spaced else (",", ":"))
    check(text.encode() if as_bytes else text)


@pytest.mark.parametrize("text", [
    b'{"port": 18446744073709551616}',  # beyond 64 bits: orjson would give a float
    b'{"port": -9223372036854775809}', b'{"port": 9223372036854775808}', b'[1234567890123456789012345]',
    b'{"a": 1, "a": 2}', b'1e400', b'-1e400', b'NaN', b'[Infinity, -Infinity]', b'"\\ud800"',
    b'\xef\xbb\xbf{"a": 1}', '{"a": 1}'.encode("utf-16"), b'{"a": "\xed\xa0\x80"}', b'{"a": "\xff"}',
    b'[1, 2', b'', b'   ', b'{"a": "x\x01y"}', b'[' * 2000 + b']' * 2000, b'-0', b'-0.0', b'1E2', b'0.1e-400',
    '{"é": "\u00e9"}', '"\ud83d\ude00"', b'{"items": [], "metadata": {"continue": "12"}}',
])
def test_texts_where_orjson_and_json_differ_read_as_json_reads_them(text):
    check(text)


def test_a_list_page_is_read_through_orjson():
    assert jsontext.orjson is not None, "orjson is a declared dependency (pyproject.toml)"
    page = json.dumps({"items": [{"metadata": {"name": f"s{i}", "resourceVersion": str(i)}} for i in range(3)]}).encode()
    assert not jsontext._has_long_number(page)
    assert jsontext.loads(page) == json.loads(page)
