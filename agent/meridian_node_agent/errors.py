"""The one error every CLI verb raises for bad arguments or unreadable inputs: exit status 2."""

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError


class UsageError(MeridianError):
    """Bad arguments, an invalid policy or an unreadable file; never confused with a rejection (exit 1)."""
