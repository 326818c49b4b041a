"""An air-gapped node under the privilege split, on a real systemd, attacked by the ``meridian`` user.

One bookworm host booting systemd as PID 1 (tests/support/systemd_host.py), the wheel and the checkout's
units installed, sharing this machine's network and Docker socket (see test_privilege_boundary.py for why).
The inbox is root's (``/var/lib/meridian-node-inbox``, 0700). A bundle renamed into it fires
``meridian-node-airgap.path``; root's ``meridian-node-airgap.service`` verifies it against root's record,
stages its artifact, applies it (the stand-in engine starts on this machine's Docker Engine) and publishes
the outcome in ``public/airgap-outcomes.json``; the agent (``meridian-node.service``, mode air-gapped) reads
that and writes a signed journal record and observation into its outbox.

Then the attacks: the agent's user cannot write or list the inbox, cannot plant anything in root's
``public/``; an inbox symlink to a bundle the agent owns, and a bundle file the agent owns, are refused
(never read for the agent); a hostile bundle ends in ``rejected/`` with its reason; and through all of it
root's record, the engine container and the artifact store do not change.
"""

from __future__ import annotations

import base64
import hashlib
import json
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.tests.support.bundle_fixtures import ARTIFACT, AUTHORITY, CONTROL
from ansible_collections.meridian.node.tests.support.systemd_host import SystemdHost
from ansible_collections.meridian.node.tests.support.systemd_site import (
    AGENT_DIR,
    AGENT_UNIT,
    BIN,
    ROOT_DIR,
    SiteParts,
    SplitSite,
    as_meridian,
    install_site,
    refused_as_meridian,
    site_policy,
    split_config,
    wait_until,
)
from ansible_collections.meridian.node.tests.support.trust_fixtures import artifact_manifest, current_state, envelope
from meridian_node_agent.boundary.outbox import verify_outbox_record
from meridian_node_agent.cli.bundle import BundleInputs, build_bundle

pytestmark = [pytest.mark.docker, pytest.mark.slow]

PATH_UNIT, INBOX_UNIT = "meridian-node-airgap.path", "meridian-node-airgap.service"
INBOX = "/var/lib/meridian-node-inbox"
OUTBOX = f"{AGENT_DIR}/outbox"
OUTCOMES = f"{ROOT_DIR}/public/airgap-outcomes.json"
STORE = "/var/lib/meridian-node-artifacts"
# The inbox unit copies the apply unit's sandbox; its own bound at the apply unit's (test_privilege_boundary).
INBOX_UNIT_MAX_EXPOSURE = 4.5
WEIGHTS = b"air-gapped weights\n" * 256


@dataclass
class Site(SplitSite):
    made: Path  # bundles are made here, on this machine, then copied in as an operator would

    def bundle(self, name: str, generation: int, **state: Any) -> Path:
        """A bundle with the engine and a small artifact, valid now, signed by the site's authority."""
        now = datetime.now(UTC).replace(microsecond=0)
        model = self.made / "model"
        model.mkdir(exist_ok=True)
        (model / "weights.bin").write_bytes(WEIGHTS)
        entry = {"path": "weights.bin", "size": len(WEIGHTS), "sha256": hashlib.sha256(WEIGHTS).hexdigest()}
        manifest = envelope("artifact-manifest", artifact_manifest(files=[entry]), [ARTIFACT])
        (self.made / "manifest.json").write_text(json.dumps(manifest))
        document = current_state(
            generation,
            node_id=self.node_id,
            artifacts=[{"name": "tiny-model", "version": "1.0.0", "manifest": manifest}],
            engines=[self.stand_in.spec()],
            **state,
        )
        out = self.made / name
        build_bundle(
            out,
            BundleInputs(
                desired_envelope=envelope("desired-state", document, [CONTROL]),
                node_id=self.node_id,
                authority_keys=[AUTHORITY.private],
                expires=timedelta(days=1),
                now=now - timedelta(minutes=1),
                artifacts=[(self.made / "manifest.json", model)],
            ),
        )
        return out

    def drop(self, bundle: bytes, name: str, *, owner: str = "root") -> None:
        """As an operator: copy under a temporary name, then rename into place (which fires the path unit)."""
        self.host.put_file(f"{INBOX}/.{name}.part", bundle, mode=0o640, owner=owner)
        self.host.exec(["mv", f"{INBOX}/.{name}.part", f"{INBOX}/{name}"])

    def filed(self, folder: str, name: str) -> dict[str, Any] | None:
        result = self.host.exec(["cat", f"{INBOX}/{folder}/{name}.reason.json"], check=False)
        return json.loads(result.stdout) if result.returncode == 0 else None

    def outbox(self) -> list[str]:
        return sorted(self.host.exec(["ls", OUTBOX], check=False).stdout.split())

    def wait(self, what: str, check: Callable[[], object], timeout: float = 240) -> Any:
        """What ``check`` returned once it returned something true (a liveness bound: see ``wait_until``)."""
        return wait_until(what, check, self.host, (INBOX_UNIT, AGENT_UNIT), timeout=timeout)

    def untouched(self) -> tuple[Any, ...]:
        """What a refused bundle must leave as it was: root's record, the engine container, the store."""
        container = self.docker.containers.get(self.engine)
        store = self.host.exec(["sh", "-c", f"find {STORE} -type f | sort | xargs -r sha256sum"]).stdout
        return self.root_record(), container.id, container.status, store


@pytest.fixture(scope="module")
def site(site_parts: SiteParts) -> Iterator[Site]:
    host = site_parts.host
    node_id = site_parts.node_id("airgap")
    with site_parts.engine("airgap", stop_units=(AGENT_UNIT, PATH_UNIT)) as engine:
        trust = {"control": "control.pem", "artifact": "artifact.pem", "air_gap_authority": "authority.pem"}
        air_gap = {"inbox": INBOX, "outbox": OUTBOX, "poll_seconds": 1}
        # The operator's inbox, root's: made before the config is checked (check-config checks it).
        host.exec(["install", "-d", "-o", "root", "-g", "root", "-m", "0700", INBOX])
        install_site(
            host,
            policy=site_policy(trust=trust, modes=["air-gapped"]),
            config=split_config(node_id, "air-gapped", air_gap=air_gap),
            keys={
                "control.pem": CONTROL.public_pem,
                "artifact.pem": ARTIFACT.public_pem,
                "authority.pem": AUTHORITY.public_pem,
            },
        )
        host.exec(["systemctl", "enable", "--now", PATH_UNIT, AGENT_UNIT])
        made = site_parts.tmp_path_factory.mktemp("sd-airgap-bundles")
        site = Site(host, node_id, engine, site_parts.docker, made=made)
        with host.logs_on_failure(INBOX_UNIT, AGENT_UNIT):
            site.drop(site.bundle("g1.tar", 1).read_bytes(), "g1.tar")
            site.wait("g1.tar filed in processed/", lambda: site.filed("processed", "g1.tar"))
            site.wait(f"engine {engine.name} serving", site.serving)
            site.wait("a journal record in the outbox", lambda: any("-journal" in n for n in site.outbox()))
        yield site


def test_a_bundle_in_roots_inbox_is_applied_by_root_and_the_agent_writes_signed_records(site: Site) -> None:
    host = site.host
    reason = site.filed("processed", "g1.tar")
    assert reason is not None and reason["result"] == "applied", reason
    assert site.root_record()["generation"] == 1  # root's record decided and moved
    assert "bundle g1.tar: applied" in host.journal(INBOX_UNIT)
    assert host.read_file(f"{STORE}/artifacts/tiny-model/1.0.0/weights.bin") == WEIGHTS
    outcomes = json.loads(host.read_file(OUTCOMES))
    assert [(o["name"], o["result"]) for o in outcomes["outcomes"]] == [("g1.tar", "applied")]
    assert host.exec(["stat", "-c", "%U %G %a", OUTCOMES]).stdout.split() == ["root", "meridian", "640"]

    # The outbox: a journal record for root's run and an observation of the engine, signed by the node key.
    site.wait("an observation listing the engine", lambda: _observed_engine(site))
    key_pem = host.exec(["runuser", "-u", "meridian", "--", BIN, "outbox-key"]).stdout.encode()
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    key = load_pem_public_key(key_pem)
    records = [
        verify_outbox_record(name, host.read_file(f"{OUTBOX}/{name}"), {site.node_id: key})  # type: ignore[dict-item]
        for name in site.outbox()
    ]
    journals = [r.journal for r in records if r.journal is not None]
    assert [(j.generation, j.status, j.ident) for j in journals] == [
        (1, "successful", outcomes["outcomes"][0]["run"]["ident"])
    ]
    assert host.exec(["find", AGENT_DIR, "-user", "root"]).stdout == ""  # root wrote nothing of the agent's

    status = json.loads(host.exec([BIN, "status", "--json"]).stdout)
    assert status["agent"]["air_gap"]["last_bundle"]["result"] == "applied"
    assert status["agent"]["air_gap"]["applied_generation"] == 1

    score = host.unit_security_score(INBOX_UNIT)
    print(f"systemd-analyze security: {INBOX_UNIT} {score}")
    assert score <= INBOX_UNIT_MAX_EXPOSURE


def _observed_engine(site: Site) -> bool:
    for name in reversed(site.outbox()):
        if name.endswith("-observation.json"):
            envelope_ = json.loads(site.host.read_file(f"{OUTBOX}/{name}"))
            body = json.loads(base64.b64decode(envelope_["payload"]))
            engines = body["observation"]["engines"]
            return any(e["name"] == site.engine and e.get("ready") for e in engines)
    return False


def test_the_agents_user_can_neither_write_nor_read_the_inbox_nor_plant_in_public(site: Site) -> None:
    scripts = [
        f"touch {INBOX}/x.tar",
        f"ls {INBOX}",
        f"cat {INBOX}/processed/g1.tar.reason.json",
        f"ln -sf /etc/shadow {ROOT_DIR}/public/airgap-outcomes.json",
        f"touch {ROOT_DIR}/public/.airgap-outcomes.json.x.tmp",
    ]
    refused_as_meridian(site.host, scripts, reasons=["Permission denied"])


@pytest.mark.parametrize("plant", ["symlink-to-the-agents-file", "owned-by-the-agent"])
def test_an_inbox_entry_the_agent_controls_is_refused_and_never_read(site: Site, plant: str) -> None:
    host = site.host
    before = site.untouched()
    bundle = site.bundle(f"{plant}.tar", site.root_record()["generation"] + 1).read_bytes()
    name = f"{plant}.tar"
    if plant == "symlink-to-the-agents-file":
        # A valid bundle the agent holds in its own directory, linked in by an operator who was fooled.
        as_meridian(host, f"cat > {AGENT_DIR}/mine.tar", input=bundle)
        host.exec(["ln", "-s", f"{AGENT_DIR}/mine.tar", f"{INBOX}/{name}"])
        expected = "not-a-file"
    else:
        site.drop(bundle, name, owner="meridian")
        expected = "untrusted-entry"

    reason = site.wait(f"{name} filed in rejected/", lambda: site.filed("rejected", name))

    assert reason["reason"] == expected, reason
    assert site.untouched() == before
    assert f"bundle {name}: rejected ({expected}" in host.journal(INBOX_UNIT)


def test_a_hostile_bundle_ends_in_rejected_with_its_reason_and_nothing_changes(site: Site) -> None:
    before = site.untouched()
    path = site.bundle("tampered.tar", site.root_record()["generation"] + 1)
    data = bytearray(path.read_bytes())
    # Flip one byte of the artifact's weights: its digest no longer matches the signed listing.
    with tarfile.open(path) as tar:
        member = tar.getmember("artifacts/tiny-model/1.0.0/files/weights.bin")
    data[member.offset_data + 10] ^= 0x01
    site.drop(bytes(data), "tampered.tar")

    reason = site.wait("tampered.tar filed in rejected/", lambda: site.filed("rejected", "tampered.tar"))

    assert reason["reason"] == "digest-mismatch" and reason["member"].endswith("weights.bin"), reason
    assert site.untouched() == before
    outcomes = json.loads(site.host.read_file(OUTCOMES))["outcomes"]
    assert outcomes[-1]["name"] == "tampered.tar" and outcomes[-1]["reason"] == "digest-mismatch"
    assert site.serving()


# What the agent's user runs: open every file of root's directory it can, take an flock on each, report
# which opened and which locked, then hold them all until the test removes its go file.
_HOLD_ROOTS_FILES = r"""
import fcntl, json, os, sys, time
held, report = [], {"opened": [], "locked": []}
for path in sys.argv[2:]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        continue
    report["opened"].append(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        report["locked"].append(path)
    except OSError:
        pass
    held.append(fd)
with open(sys.argv[1] + ".tmp", "w") as out:
    json.dump(report, out)
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
while os.path.exists(sys.argv[1]):
    time.sleep(0.2)
"""


def test_the_agents_user_holds_no_lock_of_roots_and_root_takes_a_bundle_while_it_tries(site: Site) -> None:
    """Issue 22: every file in root's directory, opened and flocked as ``meridian`` and held while root's
    inbox unit takes and applies a bundle. Only ``public/`` opens (root never locks it), and root finishes."""
    host = site.host
    files = host.exec(["find", ROOT_DIR, "-type", "f", "-not", "-path", f"{ROOT_DIR}/journal/*"]).stdout.split()
    assert f"{ROOT_DIR}/applied.json.lock" in files and f"{ROOT_DIR}/airgap-inbox.lock" in files
    report = f"{AGENT_DIR}/held.json"
    host.exec(
        ["sh", "-c", 'runuser -u meridian -- python3 -c "$0" "$@" >/dev/null 2>&1 &', _HOLD_ROOTS_FILES, report, *files]
    )
    try:
        held = json.loads(site.wait("the agent's user holding what it could open", lambda: _read_or_none(host, report)))
        assert all(path.startswith(f"{ROOT_DIR}/public/") for path in held["opened"]), held
        generation = site.root_record()["generation"] + 1
        site.drop(site.bundle("while-held.tar", generation).read_bytes(), "while-held.tar")

        reason = site.wait("while-held.tar filed", lambda: site.filed("processed", "while-held.tar"))

        assert reason["result"] == "applied", reason
        assert site.root_record()["generation"] == generation
        assert "inbox-busy" not in host.journal(INBOX_UNIT)
    finally:
        host.exec(["rm", "-f", report], check=False)


def _read_or_none(host: SystemdHost, path: str) -> str | None:
    result = host.exec(["cat", path], check=False)
    return result.stdout if result.returncode == 0 and result.stdout else None
