"""The load generator: its output parsing, its command line, and the C program itself on loopback.

The last test compiles loadgen.c with the system cc and runs it for a fraction of a second
against the lab's real echo server on 127.0.0.1 (no root, no netns): it checks the program and
the parser agree on the format, and that what answered was our echo server. No timing is
asserted; only that something completed without errors.
"""

import json
import shutil
import threading

import pytest

from ebpf_proxy.bench import loadgen
from ebpf_proxy.bench.loadgen import LoadgenError, LoadSpec, parse_output
from ebpf_proxy.lab.echo import EchoServer, Listen

SAMPLE = {
    "proto": "tcp", "duration_s": 1.0, "warmup_s": 0.5, "concurrency": 16, "targets": ["10.96.0.10:80"],
    "started": 1010, "completed": 1000, "rate": 1000.0,
    "latency_us": {"samples": 1000, "min": 100, "mean": 300.5, "p50": 250, "p90": 500, "p99": 900,
                   "p999": 1500, "max": 2000},
    "errors": {"connect": 0, "refused": 0, "reset": 0, "timeout": 0, "eof": 0, "bad_reply": 0, "other": 0},
    "backends": {"backend-1": 510, "backend-2": 490},
}


def test_parse_output():
    res = parse_output("warming up\n" + json.dumps(SAMPLE) + "\n")
    assert res.rate == 1000.0 and res.completed == 1000
    assert res.latency_ms("p99") == pytest.approx(0.9)
    assert res.backends == {"backend-1": 510, "backend-2": 490}
    assert res.problems() == []
    assert res.raw == SAMPLE
    assert res.cpu_s is None and res.kernel_us_per_op is None  # an older loadgen, or no /proc/stat


def test_kernel_cpu_per_operation():
    res = parse_output(json.dumps({**SAMPLE, "cpu_s": {"user": 0.5, "kernel": 0.25, "idle": 1.25, "cpus": 2,
                                                         "loadgen": 0.4}}))
    assert res.cpu_s == {"user": 0.5, "kernel": 0.25, "idle": 1.25, "cpus": 2.0, "loadgen": 0.4}
    assert res.kernel_us_per_op == pytest.approx(250.0)  # 0.25 s over 1,000 operations


@pytest.mark.parametrize("text", ["", "not json", "[1, 2]", json.dumps({"proto": "tcp"}),
                                  json.dumps({**SAMPLE, "latency_us": {"p50": 1}})])
def test_parse_output_rejects_garbage(text):
    with pytest.raises(LoadgenError):
        parse_output(text)


def test_problems_flag_errors_and_empty_runs():
    errors = dict(SAMPLE["errors"], timeout=50)
    assert parse_output(json.dumps({**SAMPLE, "errors": errors})).problems()
    assert parse_output(json.dumps({**SAMPLE, "completed": 0})).problems()
    few = dict(SAMPLE["errors"], reset=1)  # 1 error in 1001: within the 1% a point may lose
    assert parse_output(json.dumps({**SAMPLE, "errors": few})).problems() == []


def test_argv():
    spec = LoadSpec("udp", ("10.0.0.1:53", "10.0.0.2:53"), duration=2, warmup=0.5, concurrency=8, timeout_ms=200)
    argv = spec.argv("/bin/loadgen")
    assert argv[:3] == ["/bin/loadgen", "--proto", "udp"]
    assert argv.count("--target") == 2 and "10.0.0.2:53" in argv
    assert argv[argv.index("--duration") + 1] == "2"
    assert spec.deadline > 2.5
    with pytest.raises(ValueError):
        LoadSpec("sctp", ("1.2.3.4:1",), 1).argv("x")
    with pytest.raises(ValueError):
        LoadSpec("tcp", (), 1).argv("x")


@pytest.fixture
def second_echo():
    """Another pod's server, for a load spread over two targets."""
    server = EchoServer("lg-other", [Listen(0, "tcp")], host="127.0.0.1")
    server.bind()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.addresses[0][1]
    server.stop()
    thread.join(5)
    server.close()


@pytest.fixture
def echo():
    server = EchoServer("lg-test", [Listen(0, "tcp"), Listen(0, "udp")], host="127.0.0.1")
    server.bind()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield {proto: port for _host, port, proto in server.addresses}
    server.stop()
    thread.join(5)
    server.close()


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
@pytest.mark.parametrize("proto", ["tcp", "udp"])
def test_compiled_loadgen_against_the_echo_server(tmp_path, echo, proto):
    binary = loadgen.build(directory=tmp_path)
    assert loadgen.build(directory=tmp_path) == binary  # cached by the source's hash
    spec = LoadSpec(proto, (f"127.0.0.1:{echo[proto]}",), duration=0.3, warmup=0.1, concurrency=4)
    res = loadgen.run(None, spec, binary)
    assert res.proto == proto
    assert res.completed > 0 and res.rate > 0
    assert res.error_count == 0
    assert set(res.backends) == {"lg-test"}
    assert sum(res.backends.values()) == res.completed
    assert 0 < res.latency_us["p50"] <= res.latency_us["p99"] <= res.latency_us["max"]
    # the window's CPU, every CPU of the machine: at most 0.3 s of each (steal time is not counted)
    machine = res.cpu_s["user"] + res.cpu_s["kernel"] + res.cpu_s["idle"]
    assert 0 < machine < 0.3 * res.cpu_s["cpus"] * 1.3 + 0.1, res.cpu_s
    assert 0 <= res.cpu_s["loadgen"] <= 0.3 * 1.3 + 0.05, res.cpu_s  # one thread: at most the window
    assert res.kernel_us_per_op is not None and res.kernel_us_per_op >= 0


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_threads_share_the_load_and_their_figures_are_merged(tmp_path, echo, second_echo):
    binary = loadgen.build(directory=tmp_path)
    targets = (f"127.0.0.1:{echo['tcp']}", f"127.0.0.1:{second_echo}")
    spec = LoadSpec("tcp", targets, duration=0.3, warmup=0.1, concurrency=5, threads=3)
    assert spec.argv(binary)[spec.argv(binary).index("--threads") + 1] == "3"
    res = loadgen.run(None, spec, binary)
    assert res.threads == 3 and res.raw["concurrency"] == 5
    assert res.error_count == 0 and res.completed > 0
    assert set(res.backends) == {"lg-test", "lg-other"}  # every thread's answers, per pod, added up
    assert sum(res.backends.values()) == res.completed
    assert res.latency_us["samples"] == res.completed  # every thread's samples, merged
    assert 0 <= res.cpu_s["loadgen"] <= 3 * 0.3 * 1.3 + 0.05, res.cpu_s  # every thread's CPU time


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_more_threads_than_operations_in_flight_is_refused(tmp_path, echo):
    binary = loadgen.build(directory=tmp_path)
    with pytest.raises(LoadgenError, match="--threads: 1 to 64, at most --concurrency"):
        loadgen.run(None, LoadSpec("tcp", (f"127.0.0.1:{echo['tcp']}",), duration=0.1, concurrency=2, threads=3), binary)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
@pytest.mark.parametrize("proto", ["tcp", "udp"])
def test_ipv6_targets_in_brackets(tmp_path, proto):
    """The bench's IPv6 ClusterIP row: `[IPV6]:PORT` targets, reported back in the same form."""
    server = EchoServer("lg-v6", [Listen(0, proto)], host="127.0.0.1", ipv6=True)
    server.bind()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = next(p for host, p, _proto in server.addresses if ":" in host)
        binary = loadgen.build(directory=tmp_path)
        res = loadgen.run(None, LoadSpec(proto, (f"[::1]:{port}",), duration=0.2, warmup=0.05, concurrency=2), binary)
        assert res.completed > 0 and res.error_count == 0 and set(res.backends) == {"lg-v6"}
        assert res.raw["targets"] == [f"[::1]:{port}"]
        mixed = LoadSpec(proto, (f"[::1]:{port}", "127.0.0.1:1"), duration=0.1)
        with pytest.raises(LoadgenError, match="every target must be of one IP family"):
            loadgen.run(None, mixed, binary)
    finally:
        server.stop()
        thread.join(5)
        server.close()
