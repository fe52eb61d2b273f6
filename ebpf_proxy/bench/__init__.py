"""`ebpf-proxy bench`: data path and control plane figures for each mode, side by side, in one run.

The bench drives a lab (ebpf_proxy.lab) and never the agent's internals: it installs Services at
the lab's API server, switches the lab's mode, generates load between the lab's own namespaces,
and reads the kernel state the agents leave. Modules, one job each:

    ports        which backend port each (mode, path) uses, and the measured Services' names
    stats        percentiles, medians and spread: the one definition every figure uses
    loadgen      the C load generator: build it, run it inside a netns, parse its JSON
    rest         a keep-alive JSON client for the lab's API server (thousands of writes)
    services     the N Services and their hand-written EndpointSlices
    procstat     an agent's CPU seconds and peak RSS from /proc
    kernelstate  what the kernel holds: iptables rules, BPF map entries, programmed endpoints
    traffic      data path points: conn/s, latency, UDP rate
    controlplane full sync, single-change latency, burst convergence
    results      results.json: raw samples, machine, parameters, the `summary` rows, checks
    report       report.md and the PNG plots
    compare      ratio table between two results.json
    runner       the whole run, with a live table
    soak         `ebpf-proxy soak`: minutes of Service churn under steady traffic, leak check
"""
