"""``_module.run_module``: how every module shell hands its outcome to Ansible.

A stand-in for ``AnsibleModule`` records the calls; the shells themselves are driven by the playbook tests
beside this file.
"""

from __future__ import annotations

from typing import Any, NoReturn

import pytest

from ansible_collections.meridian.node.plugins.module_utils._module import run_module


class RecordingModule:
    def __init__(self) -> None:
        self.warned: list[str] = []
        self.ended: tuple[str, dict[str, Any]] | None = None

    def warn(self, warning: str) -> None:
        self.warned.append(warning)

    def fail_json(self, **result: Any) -> NoReturn:
        self.ended = ("fail_json", result)
        raise SystemExit(1)

    def exit_json(self, **result: Any) -> NoReturn:
        self.ended = ("exit_json", result)
        raise SystemExit(0)


def test_a_success_exits_with_every_key_but_the_warnings() -> None:
    module = RecordingModule()
    outcome = {"changed": True, "engines": {"a": {}}, "warnings": ["first", "second"]}
    with pytest.raises(SystemExit):
        run_module(module, outcome)
    assert module.warned == ["first", "second"]
    assert module.ended == ("exit_json", {"changed": True, "engines": {"a": {}}})
    assert outcome["warnings"] == ["first", "second"]  # the caller's dict is left as it was


def test_a_failure_fails_with_its_message_and_fields_and_still_warns() -> None:
    module = RecordingModule()
    outcome = {"failed": True, "msg": "Error reading policy p: bad", "check": "policy", "warnings": ["w"]}
    with pytest.raises(SystemExit):
        run_module(module, outcome)
    assert module.warned == ["w"]
    assert module.ended == ("fail_json", {"msg": "Error reading policy p: bad", "check": "policy"})


def test_a_missing_library_keeps_its_traceback_as_exception() -> None:
    module = RecordingModule()
    with pytest.raises(SystemExit):
        run_module(module, {"failed": True, "msg": "Failed to import PyYAML", "exception": "Traceback ..."})
    assert module.warned == []
    assert module.ended == ("fail_json", {"msg": "Failed to import PyYAML", "exception": "Traceback ..."})


def test_failed_false_is_a_success() -> None:
    module = RecordingModule()
    with pytest.raises(SystemExit):
        run_module(module, {"failed": False, "changed": False})
    assert module.ended == ("exit_json", {"changed": False})
