"""The one error every CLI verb raises for bad arguments or unreadable inputs: exit status 2."""


class UsageError(Exception):
    """Bad arguments, an invalid policy or an unreadable file; never confused with a rejection (exit 1)."""
