"""The runner's pieces that need no lab: mode checks, step counting, parameters, the display."""

import io
import json

from rich.console import Console

from ebpf_proxy.bench import ports
from ebpf_proxy.bench.display import Display
from ebpf_proxy.bench.report import render_markdown
from ebpf_proxy.agent.config import _map_sizes, load_config
from ebpf_proxy.bench.runner import BenchConfig, agent_args, client_threads, mode_unavailable_reason, total_steps
from tests.unit.test_bench_results import synthetic_doc


def test_direct_always_runs_and_unknown_modes_say_why():
    assert mode_unavailable_reason("direct") is None
    reason = mode_unavailable_reason("ebpf")
    try:
        from ebpf_proxy.datapath.ebpf import EbpfDatapath  # noqa: F401
        assert reason is None
    except ImportError:
        assert reason and "EbpfDatapath" in reason


def test_steps_and_parameters(tmp_path):
    cfg = BenchConfig(modes=["direct", "iptables"], services=[1, 1000], out_dir=tmp_path)
    assert total_steps(cfg, cfg.modes) == 2 * (1 + 2 + 9 + 1)  # + the one netfilter xdp_pps variant
    no_xdp = BenchConfig(modes=["direct", "ebpf"], services=[1], out_dir=tmp_path, xdp_seconds=0)
    assert total_steps(no_xdp, no_xdp.modes) == 1 + 2 + 10
    params = cfg.parameters()
    json.dumps(params)  # it goes into results.json as is
    assert params["duration_s"] == 5.0 and params["measured_services"] == len(ports.MEASURED_SERVICES)
    assert params["topology"].endswith("topology.yaml")


def test_agent_map_sizes_hold_the_largest_size_and_are_valid_flags(tmp_path):
    def args(services, endpoints):
        return agent_args(BenchConfig(modes=["ebpf"], services=services, out_dir=tmp_path,
                                      endpoints_per_service=endpoints))
    assert args([1, 1000], 2) == []  # the defaults hold it: the default build of the programs
    flag, value = args([1, 1000, 100000], 10)
    assert flag == "--bpf-map-sizes"
    sizes = dict(_map_sizes(value, flag))  # what the agent's own parser accepts
    assert sizes["epx_backend"] >= 1.25 * 100_000 * 10 and sizes["epx_slot"] >= 1.25 * 100_000 * 10
    assert sizes["epx_svc"] >= 100_000 and all(n % 65536 == 0 for n in sizes.values())


def test_bench_passes_the_host_routing_switch_to_the_ebpf_agents(tmp_path):
    def args(routing):
        return agent_args(BenchConfig(modes=["ebpf"], services=[1], out_dir=tmp_path, bpf_host_routing=routing))
    assert args(None) == []  # the agent's default (auto)
    assert args("off") == ["--bpf-host-routing", "off"]
    assert load_config({"bpf_host_routing": args("off")[1]}, None).bpf_host_routing == "off"  # the agent takes it


def test_client_threads_are_one_per_cpu_but_never_more_than_in_flight(tmp_path):
    assert client_threads(BenchConfig(modes=["direct"], services=[1], out_dir=tmp_path, client_threads=3)) == 3
    assert client_threads(BenchConfig(modes=["direct"], services=[1], out_dir=tmp_path, client_threads=8,
                                      concurrency=2)) == 2
    assert client_threads(BenchConfig(modes=["direct"], services=[1], out_dir=tmp_path)) >= 1


def test_failures_are_reported_not_hidden():
    doc = synthetic_doc(("direct", "iptables"), (1,))
    doc["failures"] = [{"mode": "iptables", "metric": "update_latency", "services": 1000, "path": None,
                        "error": "change 3 (bench-f00002 -> 100.96.0.9:7000) on worker1: not reached within 120s"}]
    text = render_markdown(doc, [])
    assert "## Failed" in text and "update_latency  iptables at 1,000 services: change 3" in text


def test_display_prints_plain_lines_off_a_terminal():
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    doc = synthetic_doc(("direct",), (1,))
    with Display(total=3, console=console) as ui:
        ui.step("1 services, direct: conn_rate direct")
        ui.row(doc["summary"][0])
        ui.advance()
        ui.note("mode ebpf skipped: not built")
    text = out.getvalue()
    assert "[bench] 1 services, direct: conn_rate direct" in text
    assert "metric=conn_rate" in text and "mode=direct" in text
    assert "note: mode ebpf skipped" in text
