"""The node agent: watches the API server, tracks changes, and syncs a datapath at a bounded rate.

agent.py wires the pieces; config.py reads kube-proxy's flags and config file; runner.py decides
when to sync; health.py and metrics.py serve what kube-proxy serves.
"""
