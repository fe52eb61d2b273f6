"""`ebpf-proxy run` imports only the module of the command it runs (issue 12: the lab, the bench
and pyroute2 were ~17 MiB of the agent's RSS); the table that makes this possible must name
every command each cli module defines, and --help must still list them all."""

import importlib
import pkgutil
import subprocess
import sys

import click
from click.testing import CliRunner

import ebpf_proxy.cli as cli


def test_the_table_names_every_command_of_every_cli_module():
    defined = {}
    for info in pkgutil.iter_modules(cli.__path__):
        module = importlib.import_module(f"ebpf_proxy.cli.{info.name}")
        for command in getattr(module, "COMMANDS", ()):
            defined[command.name] = info.name
    assert defined == cli.COMMAND_MODULES
    for name in defined:
        assert name in cli.main.list_commands(None) and cli.main.get_command(None, name).name == name


def test_help_lists_every_command_with_its_short_help_as_an_eagerly_built_group_does():
    eager = click.Group(name=cli.main.name, callback=cli.main.callback, params=cli.main.params,
                        help=cli.main.help, epilog=cli.main.epilog, context_settings=cli.main.context_settings,
                        commands=[cli.main.get_command(None, name) for name in cli.COMMAND_MODULES])
    lazy = CliRunner().invoke(cli.main, ["--help"], terminal_width=100)
    assert lazy.exit_code == 0, lazy.output
    assert lazy.output == CliRunner().invoke(eager, ["--help"], terminal_width=100).output
    for name in cli.COMMAND_MODULES:
        assert f"  {name} " in lazy.output, f"{name} missing from `ebpf-proxy --help`"


def test_an_unknown_command_is_still_refused():
    result = CliRunner().invoke(cli.main, ["no-such-command"])
    assert result.exit_code == 2 and "No such command" in result.output


def test_running_a_command_imports_no_other_command_module():
    code = ("import sys; from ebpf_proxy.cli import main; main.get_command(None, 'run'); "
            "print(sorted(m for m in sys.modules if m.startswith(('ebpf_proxy.cli.', 'ebpf_proxy.lab', 'ebpf_proxy.bench', 'pyroute2')))); "
            "main.get_command(None, 'doctor'); print(sorted(m for m in sys.modules if m.startswith('ebpf_proxy.cli.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "['ebpf_proxy.cli.run']", out[0]
    assert out[1] == "['ebpf_proxy.cli.doctor', 'ebpf_proxy.cli.run']", out[1]
