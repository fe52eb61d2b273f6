"""JSON text from the API server → Python values, fast, and exactly as `json.loads` gives them.

At 100,000 Services and slices the agent decodes ~170 MB of LIST pages (k8s/client.py: once
each for a first list, ListStream; a relist's, ListPages, up to three times: checked when a page
arrives, walked for the names, decoded again when delivered): with `json` that was a fifth of a
full sync (bench/cpscale.py). orjson (a declared dependency) decodes the same text
several times faster. It does not read everything `json` reads, and one thing it reads
differently, so `loads` uses it only where both agree and `json` everywhere else, and the agent
sees the same values, or the same error, as before:

- an integer beyond 64 bits becomes a float in orjson and stays an exact int in `json` (a port of
  18446744073709551616 must be reported as out of range, not as a float): text with a run of 19
  or more digits goes to `json` (no field of a real API object has one: Go's integers are at
  most 64 bits, and uids and resourceVersions are shorter);
- NaN and Infinity, a UTF-8 byte-order mark, lone surrogates (`"\\ud800"`), 1e400 and nesting
  deeper than 1024: orjson refuses them, `json` reads them (or raises its own error): on any
  orjson error the text goes to `json`, whose value or exception is the answer.

Without orjson installed, `loads` is `json.loads`.
"""

from __future__ import annotations

import json
from typing import Any

try:
    import orjson
except ImportError:  # pragma: no cover - a declared dependency; json alone still gives the same values
    orjson = None  # type: ignore[assignment]

_LONG_NUMBER = 19  # digits: the shortest integer orjson may not hold exactly has 19 (-2**63 - 1)
_DIGITS = bytes.maketrans(b"0123456789", b"9999999999")  # every digit the same, the rest kept
_RUN = b"9" * _LONG_NUMBER


def _has_long_number(data: bytes | str) -> bool:
    """Whether `data` holds a run of _LONG_NUMBER digits (C speed: a translation and a find)."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    return _RUN in data.translate(_DIGITS)


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    """`json.loads(data)`: the same value (ints, floats and strings alike) or the same exception."""
    if orjson is not None and not _has_long_number(bytes(data) if isinstance(data, (bytearray, memoryview)) else data):
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass  # json decides: a value orjson does not read, or json's own error
    return json.loads(data)
