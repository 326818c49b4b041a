"""The GPU identifiers and the instant that the pure GPU-health tests share.

The health rules, the hold file and placement by health all speak of the same two H100s (``GPU_A`` is the first
GPU of the fake NVML's eight-gpus scenario) and two MIG instances, judged at ``NOW``: one spelling of each, so
that a test of one layer and a test of the next mean the same device.
"""

from datetime import datetime

from ansible_collections.meridian.node.plugins.module_utils._compat import UTC

__all__ = ["GPU_A", "GPU_B", "MIG_A", "MIG_B", "NOW"]

NOW = datetime(2026, 12, 3, 12, 0, 0, tzinfo=UTC)
GPU_A = "GPU-2f1b7c2e-8d3a-4c51-b0e6-1a9e4f7d3c01"
GPU_B = "GPU-7d0c9a51-3e2f-4b86-a1d4-5c8e2f9b6a02"
MIG_A = "MIG-4c7a1e92-0b3d-5f6e-8a21-9d0c3b7e5f41"
MIG_B = "MIG-8e2b5d03-7c1a-5e49-b6f0-2a8d4c1e9b52"
