"""The bench's NodePort flood (bench/xdppps.py) on the e2e lab, in every mode: each SYN the generator
sends to a node without a local endpoint of an externalTrafficPolicy=Local NodePort is counted
exactly once as that drop (ebpf: DROP_NO_LOCAL_EXTERNAL, by TC in the agents' default XDP mode, off;
iptables: kube-proxy's DROP rule in filter KUBE-EXTERNAL-SERVICES), so the bench's xdp_pps rows
count what the node did, not what was sent."""

from __future__ import annotations

import pytest

from ebpf_proxy.bench import xdppps

pytestmark = [pytest.mark.root, pytest.mark.e2e]

NODE_PORT = 30666
MANIFEST = f"""
apiVersion: v1
kind: Service
metadata: {{name: flood-local}}
spec:
  type: NodePort
  externalTrafficPolicy: Local
  selector: {{app: web}}
  ports: [{{port: 80, targetPort: 80, nodePort: {NODE_PORT}}}]
"""


def test_every_flooded_syn_is_one_counted_drop(e2e_lab):
    lab = e2e_lab
    lab.apply_manifests(MANIFEST, "flood")
    try:
        lab.wait_converged()
        binary = xdppps.build()
        mode = lab.mode
        variant = xdppps.Variant("default", mode)
        run = xdppps.measure(lab, binary, variant, NODE_PORT, 0.3)  # worker2: no web pod there
        assert run["sent"] > 1000 and run["dropped"] == run["sent"], run
        assert run["pps"] == run["sent_pps"]
    finally:
        lab.delete_manifests(MANIFEST, "flood")
