"""The one command line: `ebpf-proxy`. Each sub-module owns one command group; this one wires them.

Nothing below `ebpf_proxy.cli` parses flags: the commands turn options into plain arguments and call
into the agent, the lab or the bench.
"""

import importlib
from collections.abc import Mapping

import click

from ebpf_proxy import __version__

EPILOG = """\b
Examples:
  ebpf-proxy lab up                      # the default three-worker lab
  ebpf-proxy lab probe --from outside --to 172.20.20.17:30080 --count 20
  ebpf-proxy run --mode iptables --hostname-override worker1 --kubeconfig kubeconfig
  ebpf-proxy cleanup                     # remove everything any mode installed
"""


# Each command and the sub-module that defines it (in its COMMANDS). `ebpf-proxy run` is the
# agent, a long-lived process on every node: importing every module to register its commands
# put the lab, the bench and pyroute2 (~17 MiB, issue 12) in its RSS for nothing. A module is
# imported only when one of its commands is looked up (run, or --help lists them all);
# tests/unit/test_cli_lazy.py checks this table against the modules' COMMANDS.
COMMAND_MODULES = {
    "audit": "audit",
    "bench": "bench",
    "cleanup": "cleanup",
    "doctor": "doctor",
    "lab": "lab",
    "run": "run",
    "soak": "bench",
    "stats": "stats",
    "trace": "trace",
    "verify": "verify",
}


class _LazyGroup(click.Group):
    """A click.Group that imports a command's module (COMMAND_MODULES) on its first lookup:
    listing the names imports nothing; --help, which shows each command's short help, imports all.
    Commands looked up (or added with add_command) are kept in `commands` as click keeps them."""

    def __init__(self, *args, command_modules: Mapping[str, str], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.command_modules = dict(command_modules)

    def list_commands(self, ctx: click.Context | None) -> list[str]:
        return sorted({*self.command_modules, *self.commands})

    def get_command(self, ctx: click.Context | None, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in self.command_modules:
            module_name = f"{__name__}.{self.command_modules[cmd_name]}"
            for command in getattr(importlib.import_module(module_name), "COMMANDS", ()):
                self.commands.setdefault(command.name, command)
            if cmd_name not in self.commands:
                raise LookupError(f"COMMAND_MODULES names {module_name} for command {cmd_name!r}, "
                                  "whose COMMANDS has no such command")
        return self.commands.get(cmd_name)


@click.group(cls=_LazyGroup, command_modules=COMMAND_MODULES, epilog=EPILOG,
             context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ebpf-proxy")
def main() -> None:
    """A Kubernetes service proxy that replaces kube-proxy (eBPF datapath, iptables fallback)."""

