"""The one command line: `ebpf-proxy`. Each sub-module owns one command group; this one wires them.

Nothing below `ebpf_proxy.cli` parses flags: the commands turn options into plain arguments and call
into the agent, the lab or the bench.
"""

import click

from ebpf_proxy import __version__

EPILOG = """\b
Examples:
  ebpf-proxy lab up                      # the default three-worker lab
  ebpf-proxy lab probe --from outside --to 172.20.20.17:30080 --count 20
  ebpf-proxy run --mode iptables --hostname-override worker1 --kubeconfig kubeconfig
  ebpf-proxy cleanup                     # remove everything any mode installed
"""


@click.group(epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ebpf-proxy")
def main() -> None:
    """A Kubernetes service proxy that replaces kube-proxy (eBPF datapath, iptables fallback)."""


def _register() -> None:
    # Imported here so that each group module can be developed (and fail to import) on its own.
    import importlib
    import pkgutil

    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for command in getattr(module, "COMMANDS", ()):
            main.add_command(command)


_register()
