"""The meridian-node pull agent: CLI, agent loop and reference control plane.

Everything the agent shares with the collection's modules (contracts, trust, policy, NVML, engines,
artifact store) lives in ``ansible_collections.meridian.node.plugins.module_utils``; this package only
adds what runs off the managed path.
"""

__version__ = "0.1.0"
