"""Probe target parsing, the report's stable JSON shape, and the echo wire format (no root)."""

import json
import socket

import pytest

from ebpf_proxy.lab.echo import ECHO_CAP, EchoServer, Listen, parse_listen, parse_reply, reply_line
from ebpf_proxy.lab.probe import (Outcome, ProbeError, ProbeReport, ProbeResult, Target, TargetError, parse_target,
                                  probe)
from ebpf_proxy.lab.sctp import sctp_available


@pytest.mark.parametrize(
    "text, expected",
    [
        ("10.96.0.10:80", Target("10.96.0.10", 80, "tcp")),
        ("10.96.0.10:53/udp", Target("10.96.0.10", 53, "udp")),
        (" 10.96.0.10:443/TCP ", Target("10.96.0.10", 443, "tcp")),
        ("[fd00::1]:8080/udp", Target("fd00::1", 8080, "udp")),
        ("127.0.0.1:65535", Target("127.0.0.1", 65535, "tcp")),
        ("10.96.0.10:3868/sctp", Target("10.96.0.10", 3868, "sctp")),
        ("10.96.0.10:3868/SCTP", Target("10.96.0.10", 3868, "sctp")),
        ("[fd00::1]:3868/sctp", Target("fd00::1", 3868, "sctp")),
    ],
)
def test_parse_target_accepts(text, expected):
    assert parse_target(text) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty target"),
        ("10.96.0.10", "missing ':PORT'"),
        ("10.96.0.10:", "port must be a number"),
        ("10.96.0.10:0", "port must be a number"),
        ("10.96.0.10:65536", "port must be a number"),
        ("10.96.0.10:http", "port must be a number"),
        ("10.96.0.10:-1", "port must be a number"),
        (":80", "missing IP"),
        ("web.default:80", "not an IP address"),
        ("10.96.0.300:80", "not an IP address"),
        ("10.96.0.10:80/quic", "must be tcp, udp or sctp"),
        ("10.96.0.10:80/", "must be tcp, udp or sctp"),
        ("10.96.0.10:80/tcp/x", "must be tcp, udp or sctp"),
        ("[fd00::1]3868/sctp", "[IPv6]:PORT"),
        ("fd00::1:3868/sctp", "[IPv6]:PORT"),
        ("fd00::1:80", "[IPv6]:PORT"),
        ("[fd00::1]80", "[IPv6]:PORT"),
        ("[fd00::1:80", "[IPv6]:PORT"),
    ],
)
def test_parse_target_rejects_with_a_clear_message(text, message):
    with pytest.raises(TargetError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_target(text)


def test_parse_target_rejects_non_strings():
    with pytest.raises(TargetError, match="must be a string"):
        parse_target(("10.0.0.1", 80))


def test_proto_argument_fills_in_and_must_agree():
    assert parse_target("10.0.0.1:53", proto="udp").proto == "udp"
    assert parse_target("10.0.0.1:53/udp", proto="UDP").proto == "udp"
    with pytest.raises(TargetError, match="says /tcp"):
        parse_target("10.0.0.1:53/tcp", proto="udp")
    assert parse_target("[fd00::1]:3868", proto="SCTP") == Target("fd00::1", 3868, "sctp")
    with pytest.raises(TargetError, match="says /sctp"):
        parse_target("10.0.0.1:3868/sctp", proto="tcp")
    with pytest.raises(TargetError, match="tcp, udp or sctp"):
        parse_target("10.0.0.1:53", proto="icmp")


def test_target_string_form_round_trips():
    for text in ("10.0.0.1:80/tcp", "10.0.0.1:53/udp", "[fd00::1]:80/tcp", "10.0.0.1:3868/sctp",
                 "[fd00::1]:3868/sctp"):
        assert str(parse_target(text)) == text


def test_probe_validates_arguments_before_touching_the_network():
    with pytest.raises(ValueError, match="count"):
        probe(None, "127.0.0.1:9", count=0)
    with pytest.raises(ValueError, match="timeout"):
        probe(None, "127.0.0.1:9", timeout=0)
    with pytest.raises(TargetError, match="proto="):
        probe(None, Target("127.0.0.1", 9, "tcp"), proto="udp")
    with pytest.raises(Exception, match="same IP version"):
        probe(None, "127.0.0.1:9", source_ip="::1")
    with pytest.raises(Exception, match="not an IP address"):
        probe(None, "127.0.0.1:9", source_ip="localhost")


def _sample_report() -> ProbeReport:
    return ProbeReport(
        "node-1",
        parse_target("10.96.0.10:80"),
        [
            ProbeResult(Outcome.OK, "web-b", "10.244.1.3:8080", "10.0.0.11:40000"),
            ProbeResult(Outcome.OK, "web-a", "10.244.1.2:8080", "10.0.0.11:40002"),
            ProbeResult(Outcome.OK, "web-b", "10.244.1.3:8080", "10.0.0.11:40004"),
            ProbeResult(Outcome.REFUSED),
            ProbeResult(Outcome.TIMEOUT),
            ProbeResult(Outcome.OK),  # answered, but not by an echo server
        ],
    )


def test_report_json_has_exactly_the_stable_shape():
    doc = _sample_report().to_json()
    assert json.loads(json.dumps(doc)) == doc == json.loads(_sample_report().dumps())
    assert list(doc) == ["from", "to", "results", "summary"]
    assert doc["from"] == "node-1"
    assert doc["to"] == "10.96.0.10:80/tcp"
    assert doc["results"][0] == {
        "outcome": "ok",
        "pod": "web-b",
        "backend": "10.244.1.3:8080",
        "source": "10.0.0.11:40000",
    }
    assert doc["results"][3] == {"outcome": "refused", "pod": None, "backend": None, "source": None}
    assert all(list(r) == ["outcome", "pod", "backend", "source"] for r in doc["results"])
    assert doc["summary"] == {"ok": 4, "refused": 1, "timeout": 1, "by_pod": {"web-a": 1, "web-b": 2}}


def test_report_accessors_and_round_trip():
    report = _sample_report()
    assert report.pods == {"web-a", "web-b"}
    assert report.backends == {"10.244.1.2:8080", "10.244.1.3:8080"}
    assert report.sources == {"10.0.0.11:40000", "10.0.0.11:40002", "10.0.0.11:40004"}
    assert report.source_ips == {"10.0.0.11"}
    assert report.by_pod == {"web-a": 1, "web-b": 2}
    assert not report.all_ok
    assert ProbeReport.from_json(report.to_json()) == report
    assert ProbeReport.from_json(report.dumps()) == report
    assert ProbeReport("x", parse_target("1.2.3.4:5"), [ProbeResult(Outcome.OK, "p")]).all_ok
    assert not ProbeReport("x", parse_target("1.2.3.4:5"), []).all_ok


def test_echo_reply_is_what_the_probe_parses():
    line = reply_line("web-a", "10.244.1.2:80", "10.0.0.1:5555", "udp", b"hello")
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert parse_reply(line) == {
        "pod": "web-a",
        "local": "10.244.1.2:80",
        "peer": "10.0.0.1:5555",
        "proto": "udp",
        "echo": "hello",
    }
    assert len(parse_reply(reply_line("p", "a", "b", "udp", b"x" * 5000))["echo"]) == ECHO_CAP
    assert "echo" not in parse_reply(reply_line("p", "a", "b", "tcp"))


@pytest.mark.parametrize("garbage", [b"", b"HTTP/1.1 200 OK\r\n", b"\xff\xfe\n", b"[1,2]\n", b'{"pod": 1}\n'])
def test_parse_reply_rejects_what_is_not_ours(garbage):
    assert parse_reply(garbage) is None


def test_parse_listen():
    assert parse_listen("80/tcp") == Listen(80, "tcp")
    assert parse_listen("53/UDP") == Listen(53, "udp")
    assert parse_listen("8080") == Listen(8080, "tcp")
    assert parse_listen("3868/SCTP") == Listen(3868, "sctp")
    for bad in ("", "0/tcp", "70000", "80/quic", "x/tcp"):
        with pytest.raises(ValueError):
            parse_listen(bad)


# --- SCTP: what this kernel really does, whichever way it answers --------------------------------


def test_sctp_available_agrees_with_the_kernel():
    """None exactly when a one-to-one SCTP socket opens; otherwise a reason naming the cause and the fix."""
    why = sctp_available()
    try:
        socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_SCTP).close()
    except OSError as exc:
        assert why is not None and "no SCTP sockets" in why and exc.strerror in why and "modprobe sctp" in why
    else:
        assert why is None


@pytest.mark.parametrize("target", ["127.0.0.1:9/sctp", "[::1]:9/sctp"])
def test_sctp_probe_of_a_closed_port_is_refused_or_says_the_kernel_has_no_sctp(target):
    """With kernel SCTP, an INIT to a port nobody listens on gets an ABORT: refused, like a TCP RST.
    Without it (this machine), the probe cannot be made: a ProbeError naming the cause, no traceback
    of a bare OSError, and no outcome pretending the network answered."""
    why = sctp_available()
    if why is None:
        report = probe(None, target, timeout=2.0)
        assert [r.outcome for r in report.results] == [Outcome.REFUSED] and str(report.target) == target
        return
    with pytest.raises(ProbeError) as err:
        probe(None, target, timeout=2.0, source_ip="::1" if "[" in target else "127.0.0.1")
    assert str(err.value) == f"cannot probe {target}: {why}"
    assert "no SCTP sockets" in str(err.value) and "modprobe sctp" in str(err.value)


def test_echo_server_without_kernel_sctp_says_so_once_and_serves_the_rest():
    """An sctp listen the kernel cannot serve is logged (one line, with the reason) and left out;
    the TCP and UDP listens of the same pod are served. With kernel SCTP, all three are served."""
    lines: list[str] = []
    server = EchoServer("web-a", [Listen(0, "tcp"), Listen(0, "sctp"), Listen(0, "udp")], host="127.0.0.1",
                        log=lines.append)
    try:
        server.bind()
        protos = [proto for _host, _port, proto in server.addresses]
        why = sctp_available()
        if why is None:
            assert protos == ["tcp", "sctp", "udp"] and lines == [] and server.unserved == []
        else:
            assert protos == ["tcp", "udp"] and server.unserved == [Listen(0, "sctp")]
            assert lines == [f"echo[web-a]: not serving 0/sctp: {why}"]
    finally:
        server.close()
