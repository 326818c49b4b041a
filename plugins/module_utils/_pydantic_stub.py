"""Just enough of pydantic's names for ``contracts`` to be *imported* where pydantic is missing.

Modules must be importable without their third-party requirements so that they can report the missing
library through ``missing_required_lib`` instead of a traceback (ansible-test's import sanity test checks
exactly this). Nothing here validates anything: ``contracts.require_pydantic()`` refuses to run first.
"""

from __future__ import annotations

from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError


class BaseModel:
    pass


class ValidationError(MeridianError, ValueError):
    pass


def ConfigDict(**kwargs: Any) -> dict[str, Any]:
    return dict(kwargs)


def Field(*args: Any, **kwargs: Any) -> Any:
    return None


class _Marker:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


AfterValidator = PlainSerializer = _Marker
AwareDatetime = object


def model_validator(*args: Any, **kwargs: Any) -> Any:
    return lambda func: func
