#!/usr/bin/env bash
# End-to-end run of ebpf-proxy on a real (kind) Kubernetes cluster with no kube-proxy:
#   1. create a 3-node kind cluster (manifests/kind/cluster.yaml: kubeProxyMode none)
#   2. build the image, `kind load` it, deploy manifests/ (kubectl apply -k), wait for the rollout
#   3. deploy a 2-replica echo server behind NodePort services with externalTrafficPolicy Cluster
#      and Local, a client pod and a hostNetwork client on every node
#   4. probe ClusterIP, service DNS and NodePorts from a pod, from each node's host network and from
#      the kind host (source IP preserved and no local-endpoint drop for eTP Local)
#   5. switch one worker to `--mode iptables` (a second DaemonSet fenced by a node label; its init
#      step runs `ebpf-proxy cleanup`), probe again
#   6. print a report; delete the cluster unless --keep
# Exit status: 0 all probes passed, 1 a probe or a step failed, 2 usage error or missing prerequisite.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PROG=kind-e2e

CLUSTER_NAME=ebpf-proxy-e2e
IMAGE=ebpf-proxy:e2e
MODE=auto
KEEP=0
PRINT_MANIFESTS=0
API_SERVER=""
ECHO_IMAGE=${ECHO_IMAGE:-registry.k8s.io/e2e-test-images/agnhost:2.53}
CLIENT_IMAGE=${CLIENT_IMAGE:-registry.k8s.io/e2e-test-images/busybox:1.36.1-1}
TIMEOUT=${TIMEOUT:-300s}
NS=e2e
MODE_LABEL=ebpf-proxy.io/mode

usage() {
    cat <<EOF
Usage: scripts/kind-e2e.sh [options]

Runs ebpf-proxy on a 3-node kind cluster without kube-proxy, probes services from a pod, from the
nodes' host network and from this machine, switches one worker to iptables mode, probes again and
prints a report. Needs docker (with a running daemon), kind, kubectl, and curl or wget.

Options:
  --cluster-name NAME   kind cluster name (default: $CLUSTER_NAME)
  --image IMAGE         image to build and load (default: $IMAGE)
  --mode MODE           agent mode for the first round: auto, ebpf or iptables (default: $MODE)
  --keep                keep the cluster afterwards (default: delete it)
  --api-server HOST:PORT
                        API server address written into the agent's kubeconfig (default: read
                        from the cluster's 'kubernetes' EndpointSlice)
  --print-manifests     print the manifests that would be applied and exit (needs only kubectl)
  -h, --help            show this help

Environment: ECHO_IMAGE, CLIENT_IMAGE (test workload images), TIMEOUT (rollout waits, default 300s).

Examples:
  scripts/kind-e2e.sh
  scripts/kind-e2e.sh --mode ebpf --keep --cluster-name dev
  scripts/kind-e2e.sh --print-manifests --image registry.example/ebpf-proxy:test
EOF
}

usage_error() {
    echo "$PROG: $1" >&2
    echo "Try 'scripts/kind-e2e.sh --help'." >&2
    exit 2
}

log() { printf '%s %s\n' "[$PROG]" "$*" >&2; }
fail() { echo "$PROG: $*" >&2; exit 1; }

# ---- arguments -----------------------------------------------------------------------------------
while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --keep) KEEP=1; shift ;;
        --print-manifests) PRINT_MANIFESTS=1; shift ;;
        --cluster-name|--image|--mode|--api-server)
            if [ $# -lt 2 ] || [ -z "$2" ]; then usage_error "$1 needs a value"; fi
            val=$2; shift 2 ;;&
        --cluster-name=*|--image=*|--mode=*|--api-server=*)
            val=${1#*=}; shift ;;&
        --cluster-name|--cluster-name=*) CLUSTER_NAME=$val ;;
        --image|--image=*) IMAGE=$val ;;
        --mode|--mode=*) MODE=$val ;;
        --api-server|--api-server=*) API_SERVER=$val ;;
        *) usage_error "unknown argument: $1" ;;
    esac
done
[ -n "$IMAGE" ] || usage_error "--image needs a value"
case "$MODE" in auto|ebpf|iptables) ;; *) usage_error "--mode must be auto, ebpf or iptables (got '$MODE')" ;; esac
[[ "$CLUSTER_NAME" =~ ^[a-z0-9]([-a-z0-9]*[a-z0-9])?$ ]] || usage_error "invalid --cluster-name '$CLUSTER_NAME'"

# IMAGE = [registry/]name[:tag]: split the tag off after the last '/'.
image_name() { local last=${IMAGE##*/}; if [[ "$last" == *:* ]]; then echo "${IMAGE%:*}"; else echo "$IMAGE"; fi; }
image_tag() { local last=${IMAGE##*/}; if [[ "$last" == *:* ]]; then echo "${last##*:}"; else echo latest; fi; }

# ---- prerequisites -------------------------------------------------------------------------------
preflight() {
    local missing=()
    if ! command -v docker >/dev/null 2>&1; then
        missing+=("docker (the docker CLI is not on PATH)")
    elif ! docker info >/dev/null 2>&1; then
        missing+=("a working docker daemon ('docker info' failed: is dockerd running and reachable?)")
    fi
    command -v kind >/dev/null 2>&1 || missing+=("kind (https://kind.sigs.k8s.io/docs/user/quick-start/#installation)")
    command -v kubectl >/dev/null 2>&1 || missing+=("kubectl")
    if ! command -v curl >/dev/null 2>&1 && ! command -v wget >/dev/null 2>&1; then
        missing+=("curl or wget (probes from this machine to the NodePorts)")
    fi
    if [ ${#missing[@]} -gt 0 ]; then
        echo "$PROG: cannot run, missing:" >&2
        printf '  - %s\n' "${missing[@]}" >&2
        exit 2
    fi
}

# ---- manifests -----------------------------------------------------------------------------------
# Overlay over manifests/ (a copy: kustomize refuses absolute resource paths): the test image, the
# agent mode, and the API server address (the agent must reach the API server without a service
# VIP: see manifests/configmap.yaml). With fence=1 the DaemonSet stays off nodes labelled for iptables.
render_overlay() {   # dir api_server fence(0|1)
    local dir=$1 api=$2 fence=$3
    mkdir -p "$dir"
    rm -rf "$dir/manifests"
    cp -R "$ROOT/manifests" "$dir/manifests"
    cat >"$dir/kustomization.yaml" <<EOF
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - manifests
images:
  - name: ebpf-proxy
    newName: $(image_name)
    newTag: "$(image_tag)"
patches:
  - path: kubeconfig.yaml
  - path: mode.yaml
EOF
    cat >"$dir/kubeconfig.yaml" <<EOF
apiVersion: v1
kind: ConfigMap
metadata:
  name: ebpf-proxy
  namespace: kube-system
data:
  kubeconfig.conf: |-
    apiVersion: v1
    kind: Config
    clusters:
      - name: default
        cluster:
          certificate-authority: /var/run/secrets/kubernetes.io/serviceaccount/ca.crt
          server: https://$api
    contexts:
      - name: default
        context:
          cluster: default
          namespace: default
          user: default
    current-context: default
    users:
      - name: default
        user:
          tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token
EOF
    {
        cat <<EOF
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: ebpf-proxy
  namespace: kube-system
spec:
  template:
    spec:
      containers:
        - name: ebpf-proxy
          env:
            - name: EBPF_PROXY_MODE
              value: $MODE
EOF
        if [ "$fence" = 1 ]; then
            cat <<EOF
      affinity:
        nodeAffinity:
          requiredDuringSchedulingIgnoredDuringExecution:
            nodeSelectorTerms:
              - matchExpressions:
                  - key: $MODE_LABEL
                    operator: NotIn
                    values: [iptables]
EOF
        fi
    } >"$dir/mode.yaml"
}

# A second DaemonSet, ebpf-proxy-iptables, on the nodes labelled $MODE_LABEL=iptables only. Before
# the agent starts, `ebpf-proxy cleanup` removes what the eBPF agent left on the node (its programs
# stay attached after its pod is gone: that is what keeps traffic flowing across restarts).
render_iptables_overlay() {   # dir
    local dir=$1
    mkdir -p "$dir"
    cp "$ROOT/manifests/daemonset.yaml" "$dir/daemonset.yaml"
    cat >"$dir/kustomization.yaml" <<EOF
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
namespace: kube-system
nameSuffix: -iptables
resources:
  - daemonset.yaml
images:
  - name: ebpf-proxy
    newName: $(image_name)
    newTag: "$(image_tag)"
patches:
  - target:
      kind: DaemonSet
    patch: |-
      - op: replace
        path: /metadata/labels/k8s-app
        value: ebpf-proxy-iptables
      - op: replace
        path: /spec/selector/matchLabels/k8s-app
        value: ebpf-proxy-iptables
      - op: replace
        path: /spec/template/metadata/labels/k8s-app
        value: ebpf-proxy-iptables
      - op: add
        path: /spec/template/spec/nodeSelector/${MODE_LABEL/\//\~1}
        value: iptables
      # After mount-bpffs (appended), so that bpffs is mounted when it runs.
      - op: add
        path: /spec/template/spec/initContainers/-
        value:
          name: ebpf-proxy-cleanup
          image: ebpf-proxy
          args: ["cleanup", "--bpffs=/sys/fs/bpf", "--cgroup-path=/host/sys/fs/cgroup"]
          securityContext:
            runAsUser: 0
            capabilities:
              drop: [ALL]
              add: [BPF, PERFMON, NET_ADMIN, NET_RAW, SYS_RESOURCE]
            seccompProfile:
              type: Unconfined
            appArmorProfile:
              type: Unconfined
          volumeMounts:
            - name: bpffs
              mountPath: /sys/fs/bpf
              mountPropagation: HostToContainer
            - name: cgroup
              mountPath: /host/sys/fs/cgroup
              readOnly: true
            - name: xtables-lock
              mountPath: /run/xtables.lock
  - path: iptables.yaml
EOF
    cat >"$dir/iptables.yaml" <<EOF
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: ebpf-proxy
  namespace: kube-system
spec:
  template:
    spec:
      containers:
        - name: ebpf-proxy
          env:
            - name: EBPF_PROXY_MODE
              value: iptables
EOF
}

WORK=$(mktemp -d "${TMPDIR:-/tmp}/kind-e2e.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

if [ "$PRINT_MANIFESTS" = 1 ]; then
    command -v kubectl >/dev/null 2>&1 || { echo "$PROG: cannot run, missing:" >&2; echo "  - kubectl" >&2; exit 2; }
    render_overlay "$WORK/base" "${API_SERVER:-API_SERVER_HOST:6443}" 0
    render_iptables_overlay "$WORK/iptables"
    kubectl kustomize "$WORK/base"
    echo "---"
    kubectl kustomize "$WORK/iptables"
    exit 0
fi

preflight

# ---- the run -------------------------------------------------------------------------------------
export KUBECONFIG="$WORK/kubeconfig"
CREATED=0
FAILURES=0
RESULTS=()
STEP=setup

finish() {
    local rc=$?
    set +e
    if [ $rc -ne 0 ] && [ -s "$KUBECONFIG" ]; then
        log "failed during: $STEP; cluster state:"
        kubectl get nodes -o wide >&2
        kubectl get pods -A -o wide >&2
        kubectl -n kube-system logs -l 'k8s-app in (ebpf-proxy,ebpf-proxy-iptables)' --all-containers \
            --prefix --tail=40 >&2
    fi
    if [ "$CREATED" = 1 ]; then
        if [ "$KEEP" = 1 ]; then
            log "kept cluster '$CLUSTER_NAME': kind export kubeconfig --name $CLUSTER_NAME"
        else
            log "deleting cluster '$CLUSTER_NAME'"
            kind delete cluster --name "$CLUSTER_NAME" >/dev/null 2>&1
        fi
    fi
    rm -rf "$WORK"
    exit $rc
}
trap finish EXIT

k() { kubectl "$@"; }

STEP="create cluster"
if kind get clusters 2>/dev/null | grep -qx "$CLUSTER_NAME"; then
    log "reusing existing cluster '$CLUSTER_NAME'"
else
    log "creating cluster '$CLUSTER_NAME' (1 control plane, 2 workers, no kube-proxy)"
    kind create cluster --name "$CLUSTER_NAME" --config "$ROOT/manifests/kind/cluster.yaml" \
        --kubeconfig "$KUBECONFIG" --wait 0s
fi
CREATED=1
kind get kubeconfig --name "$CLUSTER_NAME" >"$KUBECONFIG"

STEP="build and load image"
log "building $IMAGE"
docker build -t "$IMAGE" "$ROOT"
kind load docker-image "$IMAGE" --name "$CLUSTER_NAME"

STEP="deploy ebpf-proxy"
if [ -z "$API_SERVER" ]; then
    api_ip=$(k -n default get endpointslices -l kubernetes.io/service-name=kubernetes \
        -o jsonpath='{.items[0].endpoints[0].addresses[0]}')
    api_port=$(k -n default get endpointslices -l kubernetes.io/service-name=kubernetes \
        -o jsonpath='{.items[0].ports[0].port}')
    API_SERVER="$api_ip:$api_port"
fi
log "agent's API server: $API_SERVER; mode: $MODE"
render_overlay "$WORK/base" "$API_SERVER" 0
k apply -k "$WORK/base"
k -n kube-system rollout status ds/ebpf-proxy --timeout="$TIMEOUT"
k wait --for=condition=Ready nodes --all --timeout="$TIMEOUT"
k -n kube-system rollout status deployment/coredns --timeout="$TIMEOUT"

STEP="deploy test workload"
k apply -f - <<EOF
apiVersion: v1
kind: Namespace
metadata:
  name: $NS
---
apiVersion: apps/v1
kind: Deployment
metadata:
  name: echo
  namespace: $NS
spec:
  replicas: 2
  selector:
    matchLabels: {app: echo}
  template:
    metadata:
      labels: {app: echo}
    spec:
      # One replica per worker: the control plane (tainted) has none, which is what the
      # externalTrafficPolicy Local probes need (a node without a local endpoint).
      affinity:
        podAntiAffinity:
          requiredDuringSchedulingIgnoredDuringExecution:
            - labelSelector:
                matchLabels: {app: echo}
              topologyKey: kubernetes.io/hostname
      containers:
        - name: echo
          image: $ECHO_IMAGE
          args: ["netexec", "--http-port=8080"]
          ports:
            - containerPort: 8080
          readinessProbe:
            httpGet: {path: /healthz, port: 8080}
---
apiVersion: v1
kind: Service
metadata:
  name: echo-cluster
  namespace: $NS
spec:
  type: NodePort
  externalTrafficPolicy: Cluster
  selector: {app: echo}
  ports:
    - port: 80
      targetPort: 8080
---
apiVersion: v1
kind: Service
metadata:
  name: echo-local
  namespace: $NS
spec:
  type: NodePort
  externalTrafficPolicy: Local
  selector: {app: echo}
  ports:
    - port: 80
      targetPort: 8080
---
apiVersion: v1
kind: Pod
metadata:
  name: client
  namespace: $NS
spec:
  containers:
    - name: client
      image: $CLIENT_IMAGE
      command: ["sleep", "infinity"]
---
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: hostnet
  namespace: $NS
spec:
  selector:
    matchLabels: {app: hostnet}
  template:
    metadata:
      labels: {app: hostnet}
    spec:
      hostNetwork: true
      dnsPolicy: ClusterFirstWithHostNet
      tolerations:
        - operator: Exists
      containers:
        - name: client
          image: $CLIENT_IMAGE
          command: ["sleep", "infinity"]
EOF
k -n "$NS" rollout status deployment/echo --timeout="$TIMEOUT"
k -n "$NS" rollout status daemonset/hostnet --timeout="$TIMEOUT"
k -n "$NS" wait --for=condition=Ready pod/client --timeout="$TIMEOUT"

# ---- probes --------------------------------------------------------------------------------------
record() {   # round probe verdict detail
    RESULTS+=("$1|$2|$3|$4")
    [ "$3" = PASS ] || FAILURES=$((FAILURES + 1))
    log "round $1: $3 $2 ($4)"
}

# attempt N cmd...: runs cmd N times; sets OK (successes) and DISTINCT (distinct outputs).
attempt() {
    local n=$1 i out outs=""
    shift
    OK=0
    for ((i = 0; i < n; i++)); do
        if out=$("$@" 2>/dev/null) && [ -n "$out" ]; then
            OK=$((OK + 1))
            outs+="$out"$'\n'
        fi
    done
    DISTINCT=$(printf '%s' "$outs" | sort -u | grep -c . || true)
    LAST_OUT=${out:-}
}

from_client() { k -n "$NS" exec client -- wget -qO- -T 3 "http://$1"; }
from_node() {   # node url
    local pod
    pod=$(k -n "$NS" get pods -l app=hostnet --field-selector "spec.nodeName=$1" -o name)
    k -n "$NS" exec "$pod" -- wget -qO- -T 3 "http://$2"
}
from_host() {
    if command -v curl >/dev/null 2>&1; then curl -fsS -m 3 "http://$1"; else wget -qO- -T 3 "http://$1"; fi
}

expect_ok() {   # round probe n cmd...
    local round=$1 probe=$2 n=$3
    shift 3
    attempt "$n" "$@"
    if [ "$OK" -eq "$n" ]; then record "$round" "$probe" PASS "$OK/$n"
    else record "$round" "$probe" FAIL "$OK/$n answered"; fi
}
expect_spread() {   # round probe n cmd...: every request answered, by more than one backend
    local round=$1 probe=$2 n=$3
    shift 3
    attempt "$n" "$@"
    if [ "$OK" -eq "$n" ] && [ "$DISTINCT" -ge 2 ]; then record "$round" "$probe" PASS "$OK/$n, $DISTINCT backends"
    else record "$round" "$probe" FAIL "$OK/$n answered, $DISTINCT backends"; fi
}
expect_refused() {   # round probe n cmd...
    local round=$1 probe=$2 n=$3
    shift 3
    attempt "$n" "$@"
    if [ "$OK" -eq 0 ]; then record "$round" "$probe" PASS "no answer, as expected"
    else record "$round" "$probe" FAIL "$OK/$n answered, expected none"; fi
}

run_probes() {   # round
    local round=$1 cip lip npc npl node ip nodes_with_backend client_ip
    cip=$(k -n "$NS" get svc echo-cluster -o jsonpath='{.spec.clusterIP}')
    lip=$(k -n "$NS" get svc echo-local -o jsonpath='{.spec.clusterIP}')
    npc=$(k -n "$NS" get svc echo-cluster -o jsonpath='{.spec.ports[0].nodePort}')
    npl=$(k -n "$NS" get svc echo-local -o jsonpath='{.spec.ports[0].nodePort}')
    nodes_with_backend=" $(k -n "$NS" get pods -l app=echo -o jsonpath='{.items[*].spec.nodeName}') "
    mapfile -t NODE_LINES < <(k get nodes -o \
        jsonpath='{range .items[*]}{.metadata.name}{" "}{.status.addresses[?(@.type=="InternalIP")].address}{"\n"}{end}')
    local node_ips=" "
    for line in "${NODE_LINES[@]}"; do node_ips+="${line#* } "; done

    expect_spread "$round" "pod -> ClusterIP $cip:80 (eTP Cluster)" 10 from_client "$cip/hostname"
    expect_ok "$round" "pod -> ClusterIP $lip:80 (eTP Local service)" 3 from_client "$lip/hostname"
    expect_ok "$round" "pod -> echo-cluster.$NS.svc.cluster.local (DNS via the CoreDNS VIP)" 3 \
        from_client "echo-cluster.$NS.svc.cluster.local/hostname"
    for line in "${NODE_LINES[@]}"; do
        node=${line%% *} ip=${line#* }
        expect_ok "$round" "pod -> NodePort $node $ip:$npc (eTP Cluster)" 3 from_client "$ip:$npc/hostname"
        expect_ok "$round" "hostNetwork@$node -> ClusterIP $cip:80" 3 from_node "$node" "$cip/hostname"
        expect_ok "$round" "hostNetwork@$node -> NodePort $ip:$npc" 3 from_node "$node" "$ip:$npc/hostname"
        expect_ok "$round" "host -> NodePort $node $ip:$npc (eTP Cluster)" 3 from_host "$ip:$npc/hostname"
        if [[ "$nodes_with_backend" == *" $node "* ]]; then
            expect_ok "$round" "host -> NodePort $node $ip:$npl (eTP Local, local backend)" 3 \
                from_host "$ip:$npl/hostname"
            attempt 1 from_host "$ip:$npl/clientip"
            client_ip=${LAST_OUT%:*}
            if [ "$OK" -eq 1 ] && [[ "$node_ips" != *" $client_ip "* ]]; then
                record "$round" "host -> NodePort $node (eTP Local) keeps the client's source IP" PASS "$client_ip"
            else
                record "$round" "host -> NodePort $node (eTP Local) keeps the client's source IP" FAIL \
                    "backend saw '${client_ip:-nothing}' (a node address means SNAT)"
            fi
        else
            expect_refused "$round" "host -> NodePort $node $ip:$npl (eTP Local, no local backend)" 2 \
                from_host "$ip:$npl/hostname"
        fi
    done
}

agent_modes() {   # "node=mode(from log)" for every agent pod
    local pod node mode out=""
    while read -r pod node; do
        [ -n "$pod" ] || continue
        mode=$(k -n kube-system logs "$pod" -c ebpf-proxy 2>/dev/null \
            | grep -o '"mode": *"[a-z]*"' | tail -n 1 | grep -o '"[a-z]*"$' | tr -d '"' || true)
        out+="$node=${mode:-?} "
    done < <(k -n kube-system get pods -l 'k8s-app in (ebpf-proxy,ebpf-proxy-iptables)' \
        -o jsonpath='{range .items[*]}{.metadata.name}{" "}{.spec.nodeName}{"\n"}{end}')
    echo "${out% }"
}

STEP="probes, round 1"
ROUND1_MODES="all nodes --mode $MODE; running: $(agent_modes)"
run_probes 1

STEP="switch one worker to iptables"
SWITCHED=$(k get nodes -l '!node-role.kubernetes.io/control-plane' -o jsonpath='{.items[-1:].metadata.name}')
log "switching $SWITCHED to --mode iptables"
k label node "$SWITCHED" "$MODE_LABEL=iptables" --overwrite
render_overlay "$WORK/base" "$API_SERVER" 1
render_iptables_overlay "$WORK/iptables"
k apply -k "$WORK/base"
k apply -k "$WORK/iptables"
k -n kube-system rollout status ds/ebpf-proxy --timeout="$TIMEOUT"
k -n kube-system wait --for=delete pod -l k8s-app=ebpf-proxy --field-selector "spec.nodeName=$SWITCHED" \
    --timeout="$TIMEOUT" 2>/dev/null || true
k -n kube-system rollout status ds/ebpf-proxy-iptables --timeout="$TIMEOUT"

STEP="probes, round 2"
ROUND2_MODES="$SWITCHED --mode iptables, others --mode $MODE; running: $(agent_modes)"
run_probes 2

# ---- report --------------------------------------------------------------------------------------
STEP="report (probes failed)"
{
    echo
    echo "ebpf-proxy kind e2e: cluster $CLUSTER_NAME, image $IMAGE"
    echo "  round 1: $ROUND1_MODES"
    echo "  round 2: $ROUND2_MODES"
    echo
    printf '%-5s  %-4s  %-80s  %s\n' round ok probe detail
    for r in "${RESULTS[@]}"; do
        IFS='|' read -r round probe verdict detail <<<"$r"
        printf '%-5s  %-4s  %-80s  %s\n' "$round" "$verdict" "$probe" "$detail"
    done
    echo
    echo "${#RESULTS[@]} probes, $FAILURES failed"
}
[ "$FAILURES" -eq 0 ]
