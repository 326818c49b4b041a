# Copyright: (c) 2026, meridian.node developers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Run a module of ours in Ansible's own worker when the module would run there anyway.

A module call costs a whole process: Ansible builds the AnsiballZ payload (0.26 s for engine_set here),
writes it, starts an interpreter that unpacks and imports it all again, and reads its JSON back. A one-task
play with engine_set took 1.15 s that way and 0.58-0.61 s run in the worker; a loop of 8 engine_instance
no-ops pays that cost 8 times (``bench/engines.py`` and ``bench/agent.py`` print today's figures). When the task
runs on this very machine, as this very user and with this very interpreter - the agent's root apply unit and a
pull from implicit localhost are exactly that - the worker process Ansible forked for the task *is* the process
the module would have been, so the module's outcome is computed there, from the same ``module_utils`` code, with
the same argument validation (``ArgumentSpecValidator``, which ``AnsibleModule`` uses), the same no_log masking
(``remove_values`` over the result) and the same ``invocation``.

Anything else runs the module as Ansible always does (``_execute_module``): another connection (ssh, docker,
...), become, delegation, async, a task environment, an interpreter other than the controller's, or the host
variable the action names (``meridian_engine_set_in_worker``, ``meridian_engine_instance_in_worker``) set false.
``-vvv`` says which way a task went and why.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ansible.module_utils.common.arg_spec import ArgumentSpecValidator
from ansible.module_utils.common.parameters import remove_values
from ansible.module_utils.errors import UnsupportedError
from ansible.module_utils.parsing.convert_bool import boolean
from ansible.plugins.action import ActionBase
from ansible.utils.display import Display

display = Display()

Outcome = Callable[..., dict[str, Any]]


@dataclass(frozen=True)
class ModuleCode:
    """What a module shell hands ``AnsibleModule`` and ``run_module``: its spec, the spec's constraints, and the
    outcome function of its ``*_args`` file (called with the validated parameters and ``check_mode``)."""

    argument_spec: Mapping[str, Any]
    outcome: Outcome
    constraints: Mapping[str, Sequence[Any]] = field(default_factory=dict)


class InWorkerAction(ActionBase):  # type: ignore[misc]  # ansible-core ships no type information
    """The action plugin of the module ``MODULE``: its outcome in the worker where that is the same process, the
    module otherwise. A subclass names the module, the host variable that switches it off, and its code."""

    _supports_check_mode = True
    _supports_async = True
    MODULE = ""
    SWITCH = ""

    def module_code(self) -> ModuleCode:
        """The module's spec and outcome, imported only when the task runs in the worker."""
        raise NotImplementedError

    def run(self, tmp: str | None = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        task_vars = task_vars or {}
        result: dict[str, Any] = super().run(tmp, task_vars)
        del tmp
        reason = self._module_reason(task_vars)
        if reason is not None:
            display.vvv(f"{self.MODULE}: runs as a module ({reason})", host=self._play_context.remote_addr)
            wrap_async = bool(self._task.async_val) and not self._connection.has_native_async
            result.update(self._execute_module(module_name=self.MODULE, task_vars=task_vars, wrap_async=wrap_async))
            if not wrap_async:
                self._remove_tmp_path(self._connection._shell.tmpdir)
            return result
        display.vvv(
            f"{self.MODULE}: runs in the worker (local, interpreter {sys.executable})",
            host=self._play_context.remote_addr,
        )
        result.update(self._run_in_worker())
        return result

    def _module_reason(self, task_vars: dict[str, Any]) -> str | None:
        """Why this task must run as a module, or None when the worker is the process the module would be."""
        switch = self._templar.template(task_vars.get(self.SWITCH, True))
        if not boolean(switch, strict=False):
            return f"{self.SWITCH} is false"
        if self._connection.transport != "local":
            return f"connection {self._connection.transport!r}, not local"
        if self._play_context.become:
            return "become"
        if self._task.delegate_to:
            return "delegate_to"
        if self._task.async_val:
            return "async"
        if any(self._task.environment or ()):
            return "the task has an environment"
        interpreter = self._templar.template(task_vars.get("ansible_python_interpreter") or "")
        if not same_interpreter(str(interpreter), sys.executable):
            return f"ansible_python_interpreter {interpreter or '(discovered)'!s} is not {sys.executable}"
        return None

    def _run_in_worker(self) -> dict[str, Any]:
        code = self.module_code()
        validation = ArgumentSpecValidator(dict(code.argument_spec), **code.constraints).validate(dict(self._task.args))
        # As AnsibleModule: the run and the invocation see the spec's options, with their defaults.
        params = {name: validation.validated_parameters.get(name) for name in code.argument_spec}
        no_log_values = validation._no_log_values
        if validation.error_messages:
            msg = validation.errors.msg
            if isinstance(validation.errors[0], UnsupportedError):
                msg = f"Unsupported parameters for ({self.MODULE}) module: {msg}"
            return _finish({"failed": True, "msg": msg}, params, no_log_values)
        try:
            outcome = code.outcome(params, check_mode=bool(self._task.check_mode))
        except Exception as exc:  # noqa: BLE001 - a module process would die with this; the task fails with it
            outcome = {
                "failed": True,
                "msg": f"{self.MODULE} failed unexpectedly: {type(exc).__name__}: {exc}",
                "exception": traceback.format_exc(),
            }
        return _finish(outcome, params, no_log_values)


def _finish(outcome: dict[str, Any], params: dict[str, Any], no_log_values: set[str]) -> dict[str, Any]:
    """The result as AnsibleModule would print it: ``invocation``, no_log values masked, JSON types."""
    outcome.setdefault("changed", False)
    outcome.setdefault("invocation", {"module_args": params})
    if not outcome.get("warnings"):
        outcome.pop("warnings", None)
    masked: dict[str, Any] = json.loads(json.dumps(remove_values(outcome, no_log_values)))
    return masked


def same_interpreter(interpreter: str, executable: str) -> bool:
    """The same file in the same directory: a virtualenv's ``python`` and ``python3`` are one interpreter, but
    ``/usr/bin/python3`` - the file the virtualenv's links resolve to - sees other site-packages."""
    if not interpreter or not os.path.isabs(interpreter):
        return False
    if os.path.dirname(os.path.abspath(interpreter)) != os.path.dirname(os.path.abspath(executable)):
        return False
    try:
        return os.path.samefile(interpreter, executable)
    except OSError:
        return False
