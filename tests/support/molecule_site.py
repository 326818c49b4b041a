"""``make molecule``: build what the molecule scenarios need, then run them.

The scenarios (``molecule/<name>/``) run against systemd-booting Debian containers and a control plane on
this machine, so something has to exist before molecule starts and be removed after it ends. This entry
point does that, once for all scenarios:

* the systemd host images (``systemd_host.ensure_host_image``), one per Debian suite, and for each suite a
  wheelhouse (the project wheel built from this checkout plus every dependency for that suite's Python);
* the collections molecule and the playbooks load, in a directory that holds nothing else: this checkout
  built with ``ansible-galaxy collection build`` and installed with ``ansible-galaxy collection install``
  (what an operator does), and community.docker / ansible.posix taken from the ``ansible`` wheel on PyPI
  (Galaxy is not reachable here), cached under ``cache_dir()``;
* a devserver (``meridian-node-devserver serve``) on 127.0.0.1 that the nodes enroll with, and the
  stand-in vLLM engine image the published states name;
* an air-gap authority key for the air-gapped nodes' bundles (``make-bundle --key``), and the public half
  their policy trusts;
* ``site.json``, which tells the playbooks all of the above; each scenario reads its own copy,
  ``site-SCENARIO.json`` (``MERIDIAN_MOLECULE_SITE``), whose ``engine_prefix`` names the scenario.

Then ``molecule test -s NAME`` for each scenario, timed, ``--lanes`` of them side by side (``make molecule``:
``MOLECULE_LANES``, default one per CPU). Scenarios share nothing that could collide: their targets have names of
their own (``mn-node-*``, ``mn-airgap-*``, ``mn-pull-*``, ``mn-fleet-*``), their engines a name prefix and ports of
their own (``site-SCENARIO.json``'s ``engine_prefix``; the node ports of node_agent and node_agent_airgap 45 apart),
and each molecule its own ``ANSIBLE_HOME``, where its prerun installs the collection. Beside another, a scenario's
output is kept and printed whole when it ends. The engines each scenario started are removed when it ends and the
devserver stopped, whatever happened. Run it as ``make molecule`` or
``python -m ansible_collections.meridian.node.tests.support.molecule_site [--lanes N] [SCENARIO ...]``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ansible_collections.meridian.node.tests.support.engine_harness import free_ports
from ansible_collections.meridian.node.tests.support.standin_image import (
    LocalImage,
    _locked,
    cache_dir,
    ensure_base_image,
    ensure_engine_image,
)
from ansible_collections.meridian.node.tests.support.systemd_host import (
    BROUGHT_PYTHON,
    CHECKOUT,
    SystemdHostError,
    ensure_host_image,
    ensure_python_image,
    ensure_wheelhouse,
)

__all__ = ["ENGINE_REPOSITORY", "PORT_RANGE", "SCENARIOS", "collections_path", "main", "third_party_collections"]

MOLECULE_DIR = CHECKOUT / "molecule"
# The order `make molecule` runs them in; each molecule.yml names the suites it boots.
SCENARIOS = ("node_agent", "node_agent_airgap", "ansible_pull", "engines")
# The collections the scenarios need besides ours, from this release of the `ansible` package.
ANSIBLE_PACKAGE = "ansible==12.3.0"
THIRD_PARTY = ("community/docker", "community/library_inventory_filtering_v1", "ansible/posix")
# Engines the scenarios start run on this machine's Docker Engine: a repository and a port range of their
# own keep the reconcile playbook's pruning away from other suites' engines on the same engine.
ENGINE_REPOSITORY = "meridian-node/molecule-standin"
PORT_RANGE = (9500, 9599)
SUITES = ("bullseye", "bookworm", "trixie")


class MoleculeSiteError(SystemdHostError):
    """Preparing the scenarios' site failed; the message says what and how to fix it."""


def _run(argv: Sequence[str], what: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(argv), capture_output=True, text=True, check=False, timeout=900, **kwargs)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).splitlines()[-30:])
        raise MoleculeSiteError(f"{what} failed ({' '.join(argv)} exited {result.returncode}):\n{tail}")
    return result


def _bin(name: str) -> str:
    """A tool of the interpreter running this (the venv's), which need not be on PATH."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def third_party_collections() -> Path:
    """A directory holding ``ansible_collections/`` with THIRD_PARTY, extracted once from the ``ansible`` wheel."""
    version = ANSIBLE_PACKAGE.split("==")[1]
    root = cache_dir() / "collections" / f"ansible-{version}"
    if (root / ".complete").is_file():
        return root
    with _locked(cache_dir() / "collections.lock"):
        if (root / ".complete").is_file():
            return root
        with tempfile.TemporaryDirectory(prefix="ansible-wheel-") as download:
            _run(
                [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                 "--dest", download, ANSIBLE_PACKAGE],
                f"downloading the {ANSIBLE_PACKAGE} wheel for its collections (needs PyPI)",
            )  # fmt: skip
            (wheel,) = Path(download).glob("ansible-*.whl")
            shutil.rmtree(root, ignore_errors=True)
            with zipfile.ZipFile(wheel) as archive:
                prefixes = tuple(f"ansible_collections/{name}/" for name in THIRD_PARTY)
                archive.extractall(root, [name for name in archive.namelist() if name.startswith(prefixes)])
        missing = [name for name in THIRD_PARTY if not (root / "ansible_collections" / name / "plugins").is_dir()]
        if missing:
            raise MoleculeSiteError(f"{ANSIBLE_PACKAGE} has no {', '.join(missing)}: pick a release that has them")
        (root / ".complete").write_text(ANSIBLE_PACKAGE + "\n")
    return root


def collections_path(work: Path) -> Path:
    """``work/collections``: meridian.node as ``ansible-galaxy collection install`` puts the tarball built
    from this checkout, beside copies of THIRD_PARTY, and nothing else (not the checkout itself)."""
    dist, path = work / "dist", work / "collections"
    galaxy = _bin("ansible-galaxy")
    _run(
        [galaxy, "collection", "build", "--force", "--output-path", str(dist), str(CHECKOUT)], "building the collection"
    )
    (tarball,) = dist.glob("meridian-node-*.tar.gz")
    _run(
        [galaxy, "collection", "install", "--offline", "--force", "-p", str(path), str(tarball)],
        "installing the collection",
    )
    for name in THIRD_PARTY:
        shutil.copytree(third_party_collections() / "ansible_collections" / name, path / "ansible_collections" / name)
    return path


def _standin_engine(client: Any) -> LocalImage:
    """The stand-in vLLM image under ENGINE_REPOSITORY, pinned by id as the policy requires."""
    from ansible_collections.meridian.node.tests.support.engine_harness import SERVER

    image = ensure_engine_image(client, ensure_base_image(client), SERVER, engine="vllm")
    tag = image.tag.rsplit(":", 1)[1]
    client.images.get(image.id).tag(ENGINE_REPOSITORY, tag=tag)
    return LocalImage(tag=f"{ENGINE_REPOSITORY}:{tag}", id=image.id)


@dataclass
class Timing:
    scenario: str
    seconds: float
    returncode: int


@contextmanager
def _site(work: Path, suites: Sequence[str]) -> Iterator[dict[str, Any]]:
    import docker

    from ansible_collections.meridian.node.tests.devserver.devserver_process import devserver_command, running

    client = docker.from_env(timeout=300)
    run = secrets.token_hex(3)
    # Where the system's Python is too old for the agent, the image carries the one the role is pointed at.
    images = {
        suite: ensure_python_image(suite, client=client)
        if suite in BROUGHT_PYTHON
        else ensure_host_image(suite, client=client)
        for suite in suites
    }
    wheelhouses = {suite: str(ensure_wheelhouse(suite)) for suite in suites}
    engine = _standin_engine(client)
    collections = collections_path(work)
    authority = _airgap_authority(work)
    with running(work / "devserver") as server:
        site = {
            "run": run,
            "images": images,
            "wheelhouses": wheelhouses,
            "collections_path": str(collections),
            "devserver": {
                "command": devserver_command(),
                "data_dir": str(server.data_dir),
                "url": server.base_url,
                "ca_bundle": server.ca_bundle.read_text(),
                "control_public_key": server.control_public_key.read_text(),
            },
            "engine": {"image": engine.pinned, "repository": ENGINE_REPOSITORY, "port_range": list(PORT_RANGE)},
            "engine_prefix": f"mn-mol-{run}-",
            # The nodes share this machine's network (host network mode): each agent's metrics endpoint needs a
            # port of its own.
            "metrics_ports": dict(zip(suites, free_ports(len(suites)), strict=True)),
            "airgap": authority,
        }
        try:
            yield site
        finally:
            _remove_engines(site)
            client.close()


def _airgap_authority(work: Path) -> dict[str, Any]:
    """A fresh air-gap authority key for this run: the private PEM (0600, for make-bundle on this machine), its
    public PEM (for the nodes' policy) and the command that makes bundles."""
    from ansible_collections.meridian.node.plugins.module_utils.trust.dsse import (
        generate_private_key_pem,
        load_private_key_pem,
        public_key_pem,
    )

    pem, _keyid = generate_private_key_pem()
    path = work / "airgap-authority.pem"
    path.touch(mode=0o600)
    path.write_bytes(pem)
    return {
        "authority_key": str(path),
        "authority_public_key": public_key_pem(load_private_key_pem(pem)).decode(),
        "make_bundle": [_bin("meridian-node")],
    }


def _remove_engines(site: dict[str, Any]) -> None:
    import docker

    client = docker.from_env(timeout=60)
    try:
        for container in client.containers.list(all=True, filters={"name": site["engine_prefix"]}):
            container.remove(force=True)
    finally:
        client.close()


def run_scenarios(scenarios: Sequence[str], *, suites: Sequence[str] = SUITES, lanes: int = 1) -> list[Timing]:
    """``molecule test`` of each scenario, ``lanes`` at a time, in the order given; their timings in that order."""
    # Not under /tmp: scenarios bind-mount it into the targets, and trixie mounts a tmpfs on /tmp.
    with tempfile.TemporaryDirectory(prefix="meridian-molecule-", dir="/var/tmp") as scratch:
        work = Path(scratch)
        started = time.monotonic()
        with _site(work, suites) as site:
            print(f"molecule site ready in {time.monotonic() - started:.0f} s (run {site['run']})", flush=True)
            (work / "site.json").write_text(json.dumps(site, indent=2))
            env = {key: value for key, value in os.environ.items() if key != "ANSIBLE_PYTHON_INTERPRETER"}
            env |= {
                "MERIDIAN_MOLECULE_RUN": site["run"],
                "MERIDIAN_MOLECULE_WORK": str(work),
                "NO_COLOR": "1",  # CI keeps the log as text
                "ANSIBLE_NOCOLOR": "1",
                "ANSIBLE_COLLECTIONS_PATH": site["collections_path"],
                # Only that path: not the checkout that the editable install puts on sys.path, so the roles
                # and modules the scenarios run are the ones `ansible-galaxy collection install` put there.
                "ANSIBLE_COLLECTIONS_SCAN_SYS_PATH": "false",
                # Molecule shells out to ansible-config and ansible-playbook: the venv's.
                "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
                **{f"MERIDIAN_MOLECULE_IMAGE_{suite.upper()}": image for suite, image in site["images"].items()},
            }
            lanes = max(1, min(lanes, len(scenarios)))
            printing = threading.Lock()

            def one(scenario: str) -> Timing:
                return _run_scenario(scenario, site, work, env, printing, streamed=lanes == 1)

            with ThreadPoolExecutor(max_workers=lanes) as pool:
                return list(pool.map(one, scenarios))


def _run_scenario(
    scenario: str, site: dict[str, Any], work: Path, env: dict[str, str], printing: threading.Lock, *, streamed: bool
) -> Timing:
    """``molecule test -s scenario`` with a site file and an ``ANSIBLE_HOME`` of its own; its output streamed, or
    kept and printed whole when it ends (``streamed`` False: scenarios run side by side)."""
    own = {**site, "engine_prefix": f"{site['engine_prefix']}{scenario.replace('_', '-')}-"}
    site_file = work / f"site-{scenario}.json"
    site_file.write_text(json.dumps(own, indent=2))
    env = env | {"MERIDIAN_MOLECULE_SITE": str(site_file), "ANSIBLE_HOME": str(work / f"ansible-home-{scenario}")}
    argv = [_bin("molecule"), "test", "-s", scenario]
    begin = time.monotonic()
    if streamed:
        print(f"--- molecule test -s {scenario}", flush=True)
        returncode = subprocess.run(argv, cwd=CHECKOUT, env=env, check=False).returncode
    else:
        with printing:
            print(f"--- molecule test -s {scenario}: started beside others; output when it ends", flush=True)
        log = work / f"{scenario}.log"
        with log.open("wb") as output:
            returncode = subprocess.run(
                argv, cwd=CHECKOUT, env=env, stdout=output, stderr=subprocess.STDOUT, check=False
            ).returncode
        with printing:
            print(f"--- molecule test -s {scenario}: its output", flush=True)
            sys.stdout.buffer.write(log.read_bytes())
            print(f"--- molecule test -s {scenario}: ended, exit {returncode}", flush=True)
    seconds = time.monotonic() - begin
    # The engines a scenario started outlive its targets (they run on this machine's engine).
    _remove_engines(own)
    return Timing(scenario, seconds, returncode)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make molecule", description=__doc__.split("\n\n")[0])
    parser.add_argument("scenarios", nargs="*", default=list(SCENARIOS), help=f"default: {' '.join(SCENARIOS)}")
    parser.add_argument(
        "--lanes", type=int, default=len(os.sched_getaffinity(0)), help="scenarios side by side (default: the CPUs)"
    )
    args = parser.parse_args(argv)
    unknown = [name for name in args.scenarios if not (MOLECULE_DIR / name / "molecule.yml").is_file()]
    if unknown:
        parser.error(f"no scenario {', '.join(unknown)} in {MOLECULE_DIR} (there are: {', '.join(SCENARIOS)})")
    began = time.monotonic()
    timings = run_scenarios(args.scenarios, lanes=args.lanes)
    print("\nscenario           seconds  result")
    for timing in timings:
        print(f"{timing.scenario:<18} {timing.seconds:7.0f}  {'passed' if timing.returncode == 0 else 'FAILED'}")
    failed = [timing.scenario for timing in timings if timing.returncode != 0]
    lanes = max(1, min(args.lanes, len(timings)))
    took = time.monotonic() - began
    print(f"{len(timings) - len(failed)} passed, {len(failed)} failed; {took:.0f} s in all, {lanes} at a time")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
