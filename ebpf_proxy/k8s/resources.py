"""Every API call the agent makes, in one place: the RBAC ClusterRole is checked against this list.

A test fails if code in k8s/ watches or writes a resource that is not listed here, and the
manifests' test fails if the role grants less (or more) than this.
"""

# (apiGroup, resource, verbs)
AGENT_API_CALLS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("", "services", ("get", "list", "watch")),
    ("discovery.k8s.io", "endpointslices", ("get", "list", "watch")),
    ("", "nodes", ("get", "list", "watch")),
    ("", "events", ("create", "patch")),
    ("events.k8s.io", "events", ("create", "patch")),
)
