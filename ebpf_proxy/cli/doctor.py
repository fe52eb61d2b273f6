"""`ebpf-proxy doctor`: what this machine has for each datapath, and one-time preparation."""

import click


@click.command(epilog="\b\nExamples:\n  ebpf-proxy doctor\n  ebpf-proxy doctor --prepare")
@click.option("--prepare", is_flag=True, help="Also prepare what can be prepared (the kernel-header tree bcc needs).")
def doctor(prepare: bool) -> None:
    """Report what the eBPF and iptables datapaths need and whether this machine has it."""
    try:
        from ebpf_proxy.datapath.ebpf import toolchain
    except ImportError:
        click.echo("ebpf: toolchain probe not available yet")
        return
    report = toolchain.probe(prepare=prepare)
    for line in report.lines():
        click.echo(line)


COMMANDS = [doctor]
