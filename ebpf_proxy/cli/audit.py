"""`ebpf-proxy audit`: has anything changed the kernel's rules or maps behind the agent's back?

The audit itself runs inside the agent (only it knows what its last sync wrote, and it must not
race a sync): this asks the agent's metrics server for one (`GET /audit`, or `/audit/repair`)
and prints the answer. The agent also runs one every --audit-period on its own.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request

import click

EPILOG = """\b
Examples:
  ebpf-proxy audit                                   # the agent on this node (127.0.0.1:10249)
  ebpf-proxy audit --repair                          # ... and write back what drifted
  ebpf-proxy audit --metrics-address 10.0.0.5:10249 --json
  ebpf-proxy lab audit                               # every node of a lab

\b
Exit status: 0 no drift; 1 drift found (repaired with --repair); 2 the agent could not be asked
(not running, no sync yet, another --metrics-bind-address).
"""

EXIT_CLEAN, EXIT_DRIFT, EXIT_UNAVAILABLE = 0, 1, 2


def ask_agent(address: str, repair: bool, timeout: float = 120.0) -> tuple[int, dict]:
    """(exit status, the agent's JSON answer or {"error": ...})."""
    url = f"http://{address}/audit" + ("/repair" if repair else "")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (an http URL we build)
            doc = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            doc = json.loads(exc.read())
        except ValueError:
            doc = {}
        return EXIT_UNAVAILABLE, {"error": f"{url}: HTTP {exc.code}: {doc.get('error', exc.reason)}"}
    except (OSError, ValueError) as exc:
        return EXIT_UNAVAILABLE, {"error": f"{url}: cannot ask the agent: {getattr(exc, 'reason', exc)}"}
    return (EXIT_CLEAN if doc.get("clean") else EXIT_DRIFT), doc


@click.command(epilog=EPILOG)
@click.option("--metrics-address", default="127.0.0.1:10249", show_default=True, metavar="IP:PORT",
              help="The agent's --metrics-bind-address.")
@click.option("--repair", is_flag=True, help="Write back what drifted (whatever the agent's --audit-repair says).")
@click.option("--json", "as_json", is_flag=True, help="Print the agent's report as one JSON object.")
def audit(metrics_address: str, repair: bool, as_json: bool) -> None:
    """Compare this node's iptables rules or eBPF maps and devices with the agent's last sync."""
    from ebpf_proxy.explain.audit import AuditReport

    status, doc = ask_agent(metrics_address, repair)
    if as_json:
        click.echo(json.dumps(doc))
    elif "error" in doc:
        click.echo(f"error: {doc['error']}", err=True)
    else:
        for line in AuditReport.from_json(doc).lines():
            click.echo(line)
    sys.exit(status)


COMMANDS = [audit]
