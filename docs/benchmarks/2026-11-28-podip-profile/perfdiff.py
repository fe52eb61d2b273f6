"""Per-connection kernel CPU by symbol, between two `perf script -F ip,sym` dumps (A and B).

Usage: python3 perfdiff.py A.txt A_CONNECTIONS B.txt B_CONNECTIONS [self|incl] [ROWS]

Each sample of `perf record -a -g -F 2000` is 0.5 ms of one CPU; divided by the connections the
load generator completed while perf ran, a symbol's samples become µs of CPU per connection.
`self` counts a sample for its leaf symbol only, `incl` for every symbol on its stack (once).
Rows are sorted by B - A, largest first.
"""
import collections
import sys

SAMPLE_US = 500.0  # 1 / 2000 Hz


def samples(path):
    out, cur = [], []
    for line in open(path):
        s = line.strip()
        if not s:
            if cur:
                out.append(cur)
                cur = []
            continue
        cur.append(s.split()[-1].split("+")[0])
    if cur:
        out.append(cur)
    return out


def per_conn(stacks, conns, mode):
    count = collections.Counter()
    for stack in stacks:
        count.update([stack[0]] if mode == "self" else set(stack))
    return {sym: n * SAMPLE_US / conns for sym, n in count.items()}


def main(argv):
    a, na, b, nb = samples(argv[1]), int(argv[2]), samples(argv[3]), int(argv[4])
    mode = argv[5] if len(argv) > 5 else "self"
    rows = int(argv[6]) if len(argv) > 6 else 30
    fa, fb = per_conn(a, na, mode), per_conn(b, nb, mode)
    print(f"total µs/conn: A {len(a) * SAMPLE_US / na:.1f}  B {len(b) * SAMPLE_US / nb:.1f}")
    for sym in sorted(set(fa) | set(fb), key=lambda k: fa.get(k, 0) - fb.get(k, 0))[:rows]:
        print(f"{fb.get(sym, 0) - fa.get(sym, 0):+7.2f}  A {fa.get(sym, 0):6.2f}  B {fb.get(sym, 0):6.2f}  {sym}")


if __name__ == "__main__":
    main(sys.argv)
