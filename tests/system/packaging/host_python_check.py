"""Run module code on the interpreter running this file: the managed host's Python, 3.9 or newer.

``test_packaging_host_pythons.py`` runs it on each target Python it finds, in a venv holding only the
modules' own requirements. What vermin (``make compat``) cannot see is checked here by running it:
annotations pydantic evaluates when it builds a model, enum and datetime behaviour. Usage:
``python host_python_check.py COLLECTIONS_DIR FIXTURES_DIR``. Prints one line per check and
``N passed, N failed``; exits 1 when any failed. Written for Python 3.9, like the code it checks.
"""

from __future__ import annotations

import base64
import importlib
import json
import pkgutil
import sys
import tempfile
import traceback
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

NOW = datetime(2026, 11, 30, tzinfo=timezone.utc)  # inside the fixture full.json's validity window


def check_imports() -> None:
    import ansible_collections.meridian.node.plugins.module_utils as module_utils
    import ansible_collections.meridian.node.plugins.modules as modules

    # Every module of every room (module_utils' subpackages included), on the host's Python.
    for package in (module_utils, modules):
        for info in pkgutil.walk_packages(package.__path__, prefix=f"{package.__name__}."):
            importlib.import_module(info.name)


def check_fixtures(fixtures: Path) -> None:
    import yaml

    from ansible_collections.meridian.node.plugins.module_utils.contracts import (
        SCHEMAS,
        JsonError,
        ValidationError,
        describe_validation_error,
        parse_document,
    )

    for kind, model in SCHEMAS.items():
        for path in sorted((fixtures / kind / "valid").glob("*.json")):
            document = parse_document(model, path.read_bytes())
            assert parse_document(model, document.model_dump_json().encode()) == document, path
        expected = yaml.safe_load((fixtures / kind / "invalid" / "EXPECTED.yaml").read_text(encoding="utf-8"))
        for name, words in expected.items():
            try:
                parse_document(model, (fixtures / kind / "invalid" / name).read_bytes())
            except ValidationError as exc:
                message = describe_validation_error(exc)
            except JsonError as exc:
                message = str(exc)
            else:
                raise AssertionError(f"{kind}/invalid/{name} was accepted")
            assert words in message, f"{kind}/invalid/{name}: {words!r} not in {message!r}"


def check_enums() -> None:
    from ansible_collections.meridian.node.plugins.module_utils.engines.plan import Action
    from ansible_collections.meridian.node.plugins.module_utils.trust.verify import RejectionCode

    code = RejectionCode.EXPIRED
    assert (str(code), f"{code}", f"{code:>8}", json.dumps(code)) == ("expired", "expired", " expired", '"expired"')
    assert code == "expired" and RejectionCode("expired") is code
    assert [str(action) for action in Action][:2] == ["clean-up", "drain"]


def check_desired_state_twice(fixtures: Path) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from ansible_collections.meridian.node.plugins.module_utils.trust import dsse
    from ansible_collections.meridian.node.plugins.module_utils.trust.desired_state import reconcile_desired_state
    from ansible_collections.meridian.node.plugins.module_utils.trust.verify import Rejection, RejectionCode

    body = (fixtures / "desired-state" / "valid" / "full.json").read_bytes()
    key = Ed25519PrivateKey.generate()
    envelope = json.dumps(dsse.sign(dsse.PAYLOAD_TYPES["desired-state"], body, [key])).encode()
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        (root / "control.pem").write_bytes(dsse.public_key_pem(key))
        policy = root / "policy.yaml"
        policy.write_text(json.dumps({"trust": {"control": {"threshold": 1, "public_keys": ["control.pem"]}}}))

        def reconcile(data: bytes) -> bool:
            outcome = reconcile_desired_state(
                data,
                policy_path=str(policy),
                node_id="gpu-node-01",
                state_dir=root / "state",
                record=True,
                check_mode=False,
                now=NOW,
            )
            return outcome.changed

        assert reconcile(envelope) is True
        assert reconcile(envelope) is False  # the same generation again: already applied
        forged = json.loads(envelope)
        forged["payload"] = base64.b64encode(body.replace(b'"generation": 7', b'"generation": 8')).decode()
        try:
            reconcile(json.dumps(forged).encode())
        except Rejection as exc:
            assert exc.code is RejectionCode.THRESHOLD_NOT_MET, exc.code
        else:
            raise AssertionError("an envelope whose payload was changed after signing was accepted")


def main(argv: list[str]) -> int:
    collections, fixtures = Path(argv[1]), Path(argv[2])
    sys.path.insert(0, str(collections))
    checks: list[tuple[str, Callable[[], None]]] = [
        ("import every module and module_utils", check_imports),
        ("every golden fixture through the contract models", lambda: check_fixtures(fixtures)),
        ("StrEnum members read as their values", check_enums),
        (
            "a signed desired state recorded, then a no-op, a forgery refused",
            lambda: check_desired_state_twice(fixtures),
        ),
    ]
    failed = 0
    for name, check in checks:
        try:
            check()
        except Exception:  # every failure is reported, with its traceback, and counted
            failed += 1
            print(f"FAIL {name}\n{traceback.format_exc()}")
        else:
            print(f"ok   {name}")
    print(f"Python {sys.version.split()[0]}: {len(checks) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
