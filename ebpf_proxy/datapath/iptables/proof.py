"""What the drift audit proved about a table, remembered across agent restarts.

kube-proxy restores every rule at start, and so did this datapath: a restart at 10,000 Services
ran one `iptables-restore` of ~80,000 rules (~1 s, most of it the kernel's copy of the nat table
read and replaced), to write back what the kernel already held. Telling "already held" apart
needs the kernel's spelling of our rules, which is not ours (`-d 10.96.0.10` comes back
`-d 10.96.0.10/32`, options reordered, marks and probabilities respelled: see
explain/audit_iptables.py): comparing the two rule by rule takes longer than the restore.

The drift audit makes that comparison anyway, every --audit-period. When it finds a table clean
it has proved a fact about two texts: the ruleset it held (ours) does what the kernel's save
text of that table does. A fact about texts stays true, so it can be kept in a file as a pair of
digests: `ruleset_digest` of our chains, `kernel_digest` of every KUBE-* line of the save. A
restarted agent's first full sync renders the ruleset and reads the save (it does both anyway);
where both digests equal the proved pair, the kernel holds that ruleset already and the table
is not restored. Anything else (a changed Service, a rule someone edited, a chain added or
gone, no audit yet, no file) differs in one digest, and the table is restored as before. A
stale or foreign file can only fail to match: it never makes a sync skip a table it should write.

The kernel's digest covers every line naming a KUBE-* chain (declarations and rules), so a chain
of ours that someone flushed, extended or left over changes it; the jumps from the built-in
chains are not ours to cover (their chains carry others' rules and counters): the full sync
ensures them one by one as before.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
import tempfile
from collections.abc import Mapping

from ebpf_proxy.datapath.iptables.ruleset import Ruleset

log = logging.getLogger(__name__)

FORMAT = 1  # the file's layout, and the digests' definitions: a file of another one is not read
_KUBE_LINE = re.compile(r"^(?::KUBE-|-A KUBE-)[^\n]*\n?", re.MULTILINE)  # with its newline: lines stay apart


def ruleset_digest(ruleset: Ruleset, table: str) -> str:
    """Our chains of `table`, in name order, each with its rules in order."""
    h = hashlib.blake2b(digest_size=32)
    for chain in sorted(ruleset.chains(table)):
        h.update(f"\0{chain}\n".encode())
        h.update("\n".join(ruleset.chains(table)[chain]).encode())
    return h.hexdigest()


def kernel_digest(table_text: str) -> str:
    """Every line of one table's iptables-save text that declares a KUBE-* chain or adds a rule
    to one, in the save's order (a chain's rules in their order; the kernel's chain order)."""
    h = hashlib.blake2b(digest_size=32)
    for line in _KUBE_LINE.finditer(table_text):  # one line at a time: no list, no copy of ~10 MB at 10,000 Services
        h.update(line.group().encode())
    return h.hexdigest()


class ProofFile:
    """table -> (ruleset_digest, kernel_digest) proved equal, in one JSON file (None: kept nowhere).

    Written whole to a temporary file and renamed over the old one, so a reader sees the old
    proof or the new, never half; read errors and a file of another FORMAT read as no proof. A
    file someone else could have written (not this process's owner's, or writable by group or
    others) is not trusted either: a forged pair could keep a tampered table unrestored until
    the next audit."""

    def __init__(self, path: str | None) -> None:
        self.path = path

    def load(self) -> dict[str, tuple[str, str]]:
        if not self.path:
            return {}
        try:
            with open(self.path, encoding="utf-8") as f:
                info = os.fstat(f.fileno())
                if info.st_uid != os.geteuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                    log.warning("iptables proof %s: owned by uid %d, mode %o: not trusted; every table is "
                                "restored", self.path, info.st_uid, stat.S_IMODE(info.st_mode))
                    return {}
                doc = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("iptables proof %s: unreadable (%s); every table is restored", self.path, exc)
            return {}
        tables = doc.get("tables") if isinstance(doc, dict) and doc.get("format") == FORMAT else None
        if not isinstance(tables, dict):
            return {}
        return {table: (pair[0], pair[1]) for table, pair in tables.items()
                if isinstance(pair, list) and len(pair) == 2 and all(isinstance(d, str) for d in pair)}

    def store(self, proved: Mapping[str, tuple[str, str]]) -> bool:
        """Keep `proved`; False (logged) when the file cannot be written: only a restart's
        restore is then not spared."""
        if not self.path:
            return False
        directory = os.path.dirname(self.path) or "."
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".proof-", dir=directory)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump({"format": FORMAT, "tables": {t: list(p) for t, p in proved.items()}}, f)
                os.replace(tmp, self.path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as exc:
            log.warning("iptables proof %s: cannot write (%s); a restart restores every table", self.path, exc)
            return False
        return True
