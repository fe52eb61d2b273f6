# syntax=docker/dockerfile:1
# ebpf-proxy image: the agent (`ebpf-proxy run`) and its cleanup (`ebpf-proxy cleanup`).
#   docker build -t ebpf-proxy:0.1.0 .
# Runtime needs from the node (mounted by manifests/daemonset.yaml): /sys/fs/bpf, the cgroup v2
# hierarchy, /lib/modules + /usr/src (the running kernel's headers, for bcc), /run/xtables.lock.

ARG BASE=debian:bookworm-slim

# ---- builder: a wheel of the package and of its dependencies, installed into a venv -------------
FROM ${BASE} AS builder
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
# Same interpreter path as in the runtime stage (Debian's /usr/bin/python3), so the venv can be copied.
RUN python3 -m venv /opt/ebpf-proxy
WORKDIR /src
COPY pyproject.toml README.md ./
COPY ebpf_proxy ./ebpf_proxy
RUN /opt/ebpf-proxy/bin/pip install --no-cache-dir --upgrade pip \
 && /opt/ebpf-proxy/bin/pip wheel --no-cache-dir --wheel-dir /wheels . \
 && /opt/ebpf-proxy/bin/pip install --no-cache-dir --no-index --find-links /wheels ebpf-proxy

# ---- runtime ------------------------------------------------------------------------------------
FROM ${BASE} AS runtime
# The same install script as `make setup` and CI, so CI exercises the image's install steps.
# --runtime installs only what the agent needs: libbpfcc (libbcc embeds LLVM/clang as libraries:
# libllvm14, libclang-cpp14), python3-bpfcc, iproute2, iptables, nftables, conntrack and the
# fallback kernel headers; no compiler packages.
ARG SETUP_ARGS=--runtime
COPY scripts/setup.sh /tmp/setup/scripts/setup.sh
RUN /tmp/setup/scripts/setup.sh ${SETUP_ARGS} \
 && rm -rf /tmp/setup /var/lib/apt/lists/* /var/cache/apt/archives/*.deb

# Fallback kernel headers (Debian's linux-headers-<ver>-common and -amd64), for nodes without the
# running kernel's headers. The DaemonSet mounts the host's /usr/src over /usr/src (that is where
# /lib/modules/$(uname -r)/build points), which would hide them: they are moved, unchanged, to a
# directory shaped like /usr/src that the toolchain also searches (EBPF_PROXY_FALLBACK_SRC_DIR).
RUN mkdir -p /opt/ebpf-proxy-src \
 && for d in /usr/src/linux-headers-*; do if [ -e "$d" ]; then mv "$d" /opt/ebpf-proxy-src/; fi; done
ENV EBPF_PROXY_FALLBACK_SRC_DIR=/opt/ebpf-proxy-src

COPY --from=builder /opt/ebpf-proxy /opt/ebpf-proxy
# The BPF C sources bcc compiles on the node (bpf/ is outside the Python package, so not in the wheel).
COPY bpf /opt/ebpf-proxy/bpf
ENV EBPF_PROXY_BPF_DIR=/opt/ebpf-proxy/bpf
# bcc is not on PyPI (the PyPI "bcc" is unrelated): link Debian's python3-bpfcc into the venv, as
# scripts/setup.sh does for the development venv.
RUN site=$(/opt/ebpf-proxy/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
 && ln -s /usr/lib/python3/dist-packages/bcc "$site/bcc" \
 && /opt/ebpf-proxy/bin/python -c 'import bcc, ebpf_proxy' \
 && /opt/ebpf-proxy/bin/ebpf-proxy --help >/dev/null

ENV PATH=/opt/ebpf-proxy/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

# Root, on purpose: Kubernetes gives added capabilities (BPF, NET_ADMIN, ...) to uid 0 only (there
# are no ambient capabilities for other users), and every call the agent makes (bpf(2), netlink,
# iptables-restore) checks them. The DaemonSet drops everything else (capabilities: drop ALL).
USER root
ENTRYPOINT ["ebpf-proxy"]
CMD ["run"]

LABEL org.opencontainers.image.title="ebpf-proxy" \
      org.opencontainers.image.description="Kubernetes service proxy replacing kube-proxy: eBPF datapath, iptables fallback" \
      org.opencontainers.image.licenses="Apache-2.0"
