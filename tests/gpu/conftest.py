"""The real NVML's GPU count, the gate of these tests (tests/support/real_nvml.py)."""

from ansible_collections.meridian.node.tests.support.real_nvml import gpu_count  # noqa: F401
