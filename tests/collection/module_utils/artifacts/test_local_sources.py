"""A signed manifest may name local files only inside the policy's ``store.local_sources``.

The manifest is signed by an artifact key, but its holder is not the host: a per-file ``url`` (or a
``base_url``) naming a local path would have root read any file or device there. Real files, a real
store, real signed manifests and the policy loaded from a real file; the module itself runs under
``ansible-playbook``. Each test names the attack; each checks nothing was read or changed.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from ansible_collections.meridian.node.plugins.module_utils.artifacts.fetch import (
    ArtifactSourceError,
    ArtifactTransferError,
    FetchConfig,
)
from ansible_collections.meridian.node.plugins.module_utils.artifacts.store import Store, ensure_artifact
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import Policy, load_policy
from ansible_collections.meridian.node.plugins.module_utils.trust.verify import verify_artifact_manifest
from ansible_collections.meridian.node.tests.support.engine_harness import run_playbook
from ansible_collections.meridian.node.tests.support.trust_fixtures import (
    artifact_manifest,
    make_key,
    signed,
    write_policy,
)

ARTIFACT = make_key()
CONTROL = make_key()
DATA = b"weights that happen to match what the signer expects\n" * 100
CONFIG = FetchConfig(timeout_s=5, attempts=1, sleep=lambda _seconds: None)


def _policy(tmp_path: Path, local_sources: list[str] | None = None) -> Policy:
    store: dict[str, Any] = {"path": str(tmp_path / "store"), "max_bytes": "1G"}
    if local_sources is not None:
        store["local_sources"] = local_sources
    return load_policy(write_policy(tmp_path / "etc", control=[CONTROL], artifact=[ARTIFACT], extra={"store": store}))


def _manifest(files: list[dict[str, Any]], **fields: Any) -> bytes:
    payload = artifact_manifest(**{"name": "m", "version": "1.0", "files": files, **fields})
    return signed("artifact-manifest", payload, [ARTIFACT])


def _entry(path: str = "weights.bin", data: bytes = DATA, **fields: Any) -> dict[str, Any]:
    return {"path": path, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(), **fields}


def _pull(policy: Policy, envelope: bytes, *, source: str | None = None, check_mode: bool = False) -> Any:
    verified = verify_artifact_manifest(envelope, policy)
    return ensure_artifact(
        Store.for_policy(policy.store),
        verified.manifest,
        manifest_sha256=verified.payload_sha256,
        source=source,
        config=CONFIG,
        check_mode=check_mode,
    )


def _nothing_read(policy: Policy) -> None:
    root = Path(policy.store.path)
    for sub in ("blobs/sha256", "staging", "artifacts/m"):
        directory = root / sub
        assert not directory.exists() or not any(directory.iterdir()), f"{directory} is not empty"


def _outside_file(tmp_path: Path) -> Path:
    """A file of the host's the signer should have no say over (a key, a config), with content it knows."""
    secret = tmp_path / "host" / "etc" / "secret.bin"
    secret.parent.mkdir(parents=True)
    secret.write_bytes(DATA)
    return secret


def test_manifest_url_naming_a_host_file_is_refused_without_local_sources(tmp_path: Path) -> None:
    secret = _outside_file(tmp_path)
    policy = _policy(tmp_path)
    assert policy.store.local_sources == ()
    for url in (str(secret), f"file://{secret}", f"file://localhost{secret}"):
        with pytest.raises(ArtifactSourceError) as refused:
            _pull(policy, _manifest([_entry(url=url)]))
        message = str(refused.value)
        assert str(secret) in message and "'weights.bin'" in message
        assert "store.local_sources" in message and "(allowed: none)" in message
        _nothing_read(policy)


@pytest.mark.timeout(30)  # without the check, opening the FIFO blocks for ever
def test_manifest_url_naming_a_fifo_is_refused_before_it_is_opened(tmp_path: Path) -> None:
    # Opening a FIFO for reading blocks until a writer comes: the run would hang as root, forever.
    fifo = tmp_path / "host" / "pipe"
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    policy = _policy(tmp_path)
    with pytest.raises(ArtifactSourceError, match="outside the directories"):
        _pull(policy, _manifest([_entry(url=str(fifo))]))


def test_manifest_base_url_naming_a_local_directory_is_refused_outside_local_sources(tmp_path: Path) -> None:
    secret = _outside_file(tmp_path)
    policy = _policy(tmp_path, [str(tmp_path / "inbox")])
    with pytest.raises(ArtifactSourceError) as refused:
        _pull(policy, _manifest([_entry(path="secret.bin")], base_url=str(secret.parent)))
    assert str(secret) in str(refused.value) and str(tmp_path / "inbox") in str(refused.value)
    _nothing_read(policy)


def test_local_file_inside_local_sources_is_installed(tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    (inbox / "m").mkdir(parents=True)
    (inbox / "m" / "weights.bin").write_bytes(DATA)
    (inbox / "m" / "config.json").write_bytes(b"{}")
    policy = _policy(tmp_path, [str(inbox)])
    envelope = _manifest(
        [
            _entry(url=str(inbox / "m" / "weights.bin")),
            _entry(path="config.json", data=b"{}", url=f"file://{inbox}/m/config.json"),
        ]
    )
    outcome = _pull(policy, envelope)
    assert outcome.changed and outcome.result is not None and len(outcome.result.fetched) == 2
    version = Path(policy.store.path) / "artifacts" / "m" / "1.0"
    assert (version / "weights.bin").read_bytes() == DATA
    # And through a local base_url (a directory, not a file: paths below it).
    other = _manifest([_entry(path="m/weights.bin")], base_url=f"file://{inbox}", version="1.1")
    verified = verify_artifact_manifest(other, policy)
    assert verified.manifest.version == "1.1"
    assert _pull(policy, other).result is not None


def test_symlink_inside_local_sources_that_leads_out_is_refused_after_realpath(tmp_path: Path) -> None:
    secret = _outside_file(tmp_path)
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "weights.bin").symlink_to(secret)
    policy = _policy(tmp_path, [str(inbox)])
    with pytest.raises(ArtifactSourceError) as refused:
        _pull(policy, _manifest([_entry(url=str(inbox / "weights.bin"))]))
    assert f"{inbox / 'weights.bin'} (resolved: {secret})" in str(refused.value)
    _nothing_read(policy)


def test_dot_dot_out_of_local_sources_is_refused(tmp_path: Path) -> None:
    secret = _outside_file(tmp_path)
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    policy = _policy(tmp_path, [str(inbox)])
    sneaky = f"{inbox}/../host/etc/{secret.name}"
    with pytest.raises(ArtifactSourceError) as refused:
        _pull(policy, _manifest([_entry(url=sneaky)]))
    assert f"(resolved: {secret})" in str(refused.value)
    # A directory whose name merely starts like the allowed one is not inside it either.
    lookalike = tmp_path / "inbox-evil"
    lookalike.mkdir()
    (lookalike / "weights.bin").write_bytes(DATA)
    with pytest.raises(ArtifactSourceError):
        _pull(policy, _manifest([_entry(url=str(lookalike / "weights.bin"))]))


def test_relative_path_and_unknown_scheme_in_a_manifest_are_refused_naming_them(tmp_path: Path) -> None:
    policy = _policy(tmp_path, ["/"])
    for url, expected in (
        ("weights.bin", "neither an http(s) URL nor an absolute local path"),
        ("ftp://mirror.example/weights.bin", "neither an http(s) URL nor an absolute local path"),
        ("file://otherhost/srv/weights.bin", "without another host"),
    ):
        with pytest.raises(ArtifactSourceError) as refused:
            _pull(policy, _manifest([_entry(url=url)]))
        assert url in str(refused.value) and expected in str(refused.value)


def test_check_mode_refuses_the_same_location_and_a_refusal_evicts_nothing(tmp_path: Path) -> None:
    secret = _outside_file(tmp_path)
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "old.bin").write_bytes(b"old version")
    policy = _policy(tmp_path, [str(inbox)])
    store = Store.for_policy(policy.store)
    old_envelope = _manifest([_entry(data=b"old version", url=str(inbox / "old.bin"))], version="0.9")
    old = verify_artifact_manifest(old_envelope, policy)
    # Not promoted, so evictable: the budget below would evict it to make room for 1.0.
    installed = ensure_artifact(store, old.manifest, manifest_sha256=old.payload_sha256, promote=False, config=CONFIG)
    assert installed.changed
    bad = verify_artifact_manifest(_manifest([_entry(url=str(secret))]), policy)
    options: dict[str, Any] = {"manifest_sha256": bad.payload_sha256, "max_bytes": len(DATA) + 5, "config": CONFIG}
    with pytest.raises(ArtifactSourceError):
        ensure_artifact(store, bad.manifest, check_mode=True, **options)
    with pytest.raises(ArtifactSourceError):
        ensure_artifact(store, bad.manifest, **options)
    assert (Path(policy.store.path) / "artifacts" / "m" / "0.9" / "weights.bin").read_bytes() == b"old version"
    assert not (Path(policy.store.path) / "artifacts" / "m" / "1.0").exists()


def test_operator_source_directory_is_read_as_given_even_outside_local_sources(tmp_path: Path) -> None:
    # The source is the caller's instruction (a playbook task, 'artifact pull --source'), not the signer's.
    inbox = tmp_path / "operator-inbox"
    inbox.mkdir()
    (inbox / "weights.bin").write_bytes(DATA)
    policy = _policy(tmp_path)
    outcome = _pull(policy, _manifest([_entry(url="/nonexistent/ignored.bin")]), source=str(inbox))
    assert outcome.result is not None and len(outcome.result.fetched) == 1


@pytest.mark.timeout(30)  # without the check, opening the FIFO blocks for ever
def test_a_fifo_in_the_operators_source_directory_is_refused_not_waited_on(tmp_path: Path) -> None:
    inbox = tmp_path / "operator-inbox"
    inbox.mkdir()
    os.mkfifo(inbox / "weights.bin")
    policy = _policy(tmp_path)

    with pytest.raises(ArtifactTransferError, match="is not a regular file"):
        _pull(policy, _manifest([_entry(url="/nonexistent/ignored.bin")]), source=str(inbox))


def test_module_refuses_a_manifest_naming_a_host_file_and_installs_from_local_sources(tmp_path: Path) -> None:
    secret = _outside_file(tmp_path)
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "weights.bin").write_bytes(DATA)
    store = tmp_path / "store"

    def policy_file(name: str, local_sources: list[str]) -> Path:
        section = {"path": str(store), "max_bytes": "1G", "local_sources": local_sources}
        return write_policy(tmp_path / name, control=[CONTROL], artifact=[ARTIFACT], extra={"store": section})

    stolen = tmp_path / "stolen.json"
    stolen.write_bytes(_manifest([_entry(url=str(secret))]))
    inboxed = tmp_path / "inboxed.json"
    inboxed.write_bytes(_manifest([_entry(url=str(inbox / "weights.bin"))]))
    report = tmp_path / "report.json"
    tasks = [
        {
            "name": "a manifest naming a host file",
            "meridian.node.verified_artifact": {"manifest": str(stolen), "policy": str(policy_file("open", []))},
            "register": "stolen",
            "ignore_errors": True,
        },
        {
            "name": "a manifest naming a file in the inbox the policy allows",
            "meridian.node.verified_artifact": {
                "manifest": str(inboxed),
                "policy": str(policy_file("inbox", [str(inbox)])),
            },
            "register": "inboxed",
        },
        {
            "name": "report",
            "ansible.builtin.copy": {
                "dest": str(report),
                "content": "{{ {'stolen': stolen, 'inboxed': inboxed} | to_json }}",
            },
        },
    ]
    playbook = tmp_path / "play.yml"
    playbook.write_text(yaml.safe_dump([{"hosts": "localhost", "gather_facts": False, "tasks": tasks}]))
    proc = run_playbook(playbook, temp_dir=tmp_path / "ansible-tmp")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(report.read_text())
    assert results["stolen"]["failed"]
    assert str(secret) in results["stolen"]["msg"] and "store.local_sources" in results["stolen"]["msg"]
    assert results["inboxed"]["changed"] and not results["inboxed"].get("failed")
    assert (store / "artifacts" / "m" / "1.0" / "weights.bin").read_bytes() == DATA
