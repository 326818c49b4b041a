"""The NVML seam: the one place in meridian.node that imports ``pynvml`` (package nvidia-ml-py).

Everything that reads GPUs goes through :func:`nvml_session`, which hands out an initialised library
and always shuts it down again, or raises :class:`NvmlUnavailable` with a sentence a person can act on.
Tests put a fake ``pynvml`` first on ``sys.path`` (``tests/support/fakes``) or pass one in as ``lib``; nothing
else in the collection knows the difference.
"""

from __future__ import annotations

import functools
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError

try:
    import pynvml as _pynvml
except ImportError:
    PYNVML_IMPORT_ERROR: str | None = traceback.format_exc()
    _pynvml = None
else:
    PYNVML_IMPORT_ERROR = None

__all__ = [
    "PYNVML_IMPORT_ERROR",
    "NvmlSession",
    "NvmlUnavailable",
    "active_nvlinks",
    "cuda_version_text",
    "error_name",
    "nvml_session",
]

# What to do about the errors nvmlInit reports on real hosts; the NVML error text alone rarely says.
_INIT_HINTS = {
    "NVML_ERROR_LIBRARY_NOT_FOUND": (
        "libnvidia-ml.so.1 could not be loaded: no NVIDIA driver is installed on this host "
        "(or its library is not on the loader path)"
    ),
    "NVML_ERROR_DRIVER_NOT_LOADED": (
        "the NVIDIA kernel module is not loaded: check 'lsmod | grep nvidia' and dmesg, or reboot after "
        "a driver install"
    ),
    "NVML_ERROR_NO_PERMISSION": "this user may not open /dev/nvidia*: run as a user allowed to (often the video group)",
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH": (
        "the NVIDIA user-space library and kernel module versions differ: reboot or reload the module "
        "after a driver upgrade"
    ),
    "NVML_ERROR_FUNCTION_NOT_FOUND": "the installed NVIDIA driver is too old for this nvidia-ml-py",
}


class NvmlUnavailable(MeridianError):
    """NVML cannot be used on this host; ``reason`` says why and what to do about it."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@functools.lru_cache(maxsize=4)
def _error_names(lib: Any) -> dict[int, str]:
    # Cached per library module: its constants never change, and on a host without NVML every read of the
    # agent's cycle fails and would otherwise rebuild this map by scanning the whole module (~1.4 ms).
    return {
        value: name for name, value in vars(lib).items() if name.startswith("NVML_ERROR_") and isinstance(value, int)
    }


def error_name(lib: Any, exc: BaseException, names: dict[int, str] | None = None) -> str:
    """``NVML_ERROR_GPU_IS_LOST`` for an NVMLError carrying that code; the class name otherwise."""
    value = getattr(exc, "value", None)
    if isinstance(value, int):
        return (names if names is not None else _error_names(lib)).get(value, f"NVML_ERROR_{value}")
    return type(exc).__name__


def _error_text(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - pynvml's __str__ calls into the library, which may be gone
        return type(exc).__name__


def cuda_version_text(value: int | None) -> str | None:
    """NVML reports the CUDA driver API version as 1000 * major + 10 * minor: 12040 is "12.4"."""
    if value is None or value <= 0:
        return None
    return f"{value // 1000}.{(value % 1000) // 10}"


@dataclass
class NvmlSession:
    """An initialised NVML library plus the error codes callers branch on, looked up once."""

    lib: Any
    not_supported: int
    not_found: int
    invalid_argument: int
    # Codes after which nothing more can be read from that device this cycle.
    device_gone: frozenset[int] = field(default_factory=frozenset)
    success: int = 0
    timeout: int = -1
    function_not_found: int = -1

    _names: dict[int, str] | None = field(default=None, repr=False)

    def name(self, exc: BaseException) -> str:
        # Built on the first error only: a healthy cycle never pays for the reverse map.
        if self._names is None:
            self._names = _error_names(self.lib)
        return error_name(self.lib, exc, self._names)

    def code_name(self, code: int) -> str:
        """``NVML_ERROR_NOT_SUPPORTED`` for a bare return code (field values carry one per field)."""
        if self._names is None:
            self._names = _error_names(self.lib)
        return self._names.get(code, f"NVML_ERROR_{code}")


def _code(lib: Any, name: str) -> int:
    value = getattr(lib, name, None)
    return value if isinstance(value, int) else -1


@contextmanager
def nvml_session(lib: Any = None) -> Iterator[NvmlSession]:
    """Initialise NVML for one read and shut it down afterwards, whatever happens in between.

    ``lib`` is a pynvml-compatible module (a fake in tests); by default the imported ``pynvml``.
    Raises :class:`NvmlUnavailable` when the package is missing or ``nvmlInit`` fails.
    """
    if lib is None:
        lib = _pynvml
    if lib is None:
        raise NvmlUnavailable(
            f"the Python package nvidia-ml-py (module pynvml) is not installed for {sys.executable}: "
            "install it with 'pip install nvidia-ml-py'"
        )
    try:
        lib.nvmlInit()
    except lib.NVMLError as exc:
        name = error_name(lib, exc)
        hint = _INIT_HINTS.get(name, "see the NVIDIA driver documentation for this error")
        raise NvmlUnavailable(f"nvmlInit failed with {name} ({_error_text(exc)}): {hint}") from exc
    session = NvmlSession(
        lib=lib,
        not_supported=_code(lib, "NVML_ERROR_NOT_SUPPORTED"),
        not_found=_code(lib, "NVML_ERROR_NOT_FOUND"),
        invalid_argument=_code(lib, "NVML_ERROR_INVALID_ARGUMENT"),
        success=_code(lib, "NVML_SUCCESS"),
        timeout=_code(lib, "NVML_ERROR_TIMEOUT"),
        function_not_found=_code(lib, "NVML_ERROR_FUNCTION_NOT_FOUND"),
        device_gone=frozenset(
            _code(lib, name)
            for name in (
                "NVML_ERROR_GPU_IS_LOST",
                "NVML_ERROR_GPU_NOT_FOUND",
                "NVML_ERROR_RESET_REQUIRED",
                "NVML_ERROR_UNINITIALIZED",
                "NVML_ERROR_DRIVER_NOT_LOADED",
                "NVML_ERROR_LIB_RM_VERSION_MISMATCH",
            )
        ),
    )
    try:
        yield session
    finally:
        # A shutdown failure leaves nothing for us to undo, and the facts already read are good.
        with suppress(lib.NVMLError):
            lib.nvmlShutdown()


def active_nvlinks(session: NvmlSession, handle: Any, on_error: Callable[[Any, int], bool]) -> list[int]:
    """The NVLinks of ``handle`` that are trained up, in link order.

    ``on_error(exc, link)`` hears of every error but the two that end the scan quietly, and answers whether
    the device is gone (the scan stops there). INVALID_ARGUMENT means past this GPU's last link, and
    NOT_SUPPORTED on link 0 means no NVLink at all: stopping there keeps a PCIe GPU at one call instead of
    NVML_NVLINK_MAX_LINKS.
    """
    lib = session.lib
    links: list[int] = []
    for link in range(lib.NVML_NVLINK_MAX_LINKS):
        try:
            state = lib.nvmlDeviceGetNvLinkState(handle, link)
        except lib.NVMLError as exc:
            if exc.value == session.invalid_argument or (exc.value == session.not_supported and link == 0):
                break
            if exc.value != session.not_supported and on_error(exc, link):
                break
            continue
        if state == lib.NVML_FEATURE_ENABLED:
            links.append(link)
    return links
