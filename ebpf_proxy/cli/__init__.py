"""The one command line: `ebpf-proxy`. Each sub-module owns one command group; this one wires them.

Nothing below `ebpf_proxy.cli` parses flags: the commands turn options into plain arguments and call
into the agent, the lab or the bench.
"""

import importlib
from collections.abc import Iterator, Mapping, MutableMapping

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


class _LazyCommands(MutableMapping):
    """click.Group.commands that imports a command's module on first lookup: knowing the names
    (listing, `in`) imports nothing. click's Group reads commands only through this mapping
    (get_command, list_commands, add_command), so its behaviour is otherwise unchanged."""

    def __init__(self, package: str, modules: Mapping[str, str]) -> None:
        self._package, self._modules, self._loaded = package, dict(modules), {}

    def __getitem__(self, name: str) -> click.Command:
        if name not in self._loaded:
            if name not in self._modules:
                raise KeyError(name)
            module = importlib.import_module(f"{self._package}.{self._modules[name]}")
            for command in getattr(module, "COMMANDS", ()):
                self._loaded.setdefault(command.name, command)
            if name not in self._loaded:
                raise LookupError(f"COMMAND_MODULES names {self._package}.{self._modules[name]} for command "
                                  f"{name!r}, whose COMMANDS has no such command")
        return self._loaded[name]

    def __setitem__(self, name: str, command: click.Command) -> None:
        self._loaded[name] = command

    def __delitem__(self, name: str) -> None:
        if name not in self:
            raise KeyError(name)
        self._modules.pop(name, None)
        self._loaded.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted({*self._modules, *self._loaded}))

    def __len__(self) -> int:
        return len({*self._modules, *self._loaded})

    def __contains__(self, name: object) -> bool:
        return name in self._modules or name in self._loaded


@click.group(epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ebpf-proxy")
def main() -> None:
    """A Kubernetes service proxy that replaces kube-proxy (eBPF datapath, iptables fallback)."""


main.commands = _LazyCommands(__name__, COMMAND_MODULES)
