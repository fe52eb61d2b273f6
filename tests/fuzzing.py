"""Hypothesis settings shared by the fuzz tests (tests/unit/test_fuzz_k8s.py, tests/bpf/test_fuzz_packets.py).

Derandomized by default, so CI runs the same examples every time and a failure reproduces by
re-running; no example database is written. `EPX_FUZZ_EXAMPLES=N` raises (or lowers) how many
examples each property tries, and `EPX_FUZZ_SEED=S` turns on random generation from seed S, for
a longer hunt on a workstation:

    EPX_FUZZ_EXAMPLES=20000 EPX_FUZZ_SEED=$RANDOM pytest tests/unit/test_fuzz_k8s.py
"""

from __future__ import annotations

import os

from typing import Callable

from hypothesis import HealthCheck, seed, settings


def fuzz_examples(examples: int) -> int:
    """`examples` (the CI budget) unless EPX_FUZZ_EXAMPLES overrides it."""
    return int(os.environ.get("EPX_FUZZ_EXAMPLES", examples))


def fuzz_settings(examples: int) -> settings:
    """fuzz_examples(examples) examples, no deadline (a BPF run or a first render can take a
    while on a shared 2-core machine, which is not a bug)."""
    n = fuzz_examples(examples)
    seed = os.environ.get("EPX_FUZZ_SEED")
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=seed is None,
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                               HealthCheck.function_scoped_fixture],
    )


def fuzz(examples: int) -> Callable:
    """Decorator for a @given test: fuzz_settings(examples), and EPX_FUZZ_SEED's seed when set."""
    def wrap(fn: Callable) -> Callable:
        fn = fuzz_settings(examples)(fn)
        chosen = os.environ.get("EPX_FUZZ_SEED")
        return seed(int(chosen))(fn) if chosen is not None else fn
    return wrap
