"""What refusing a hostile envelope costs, against verifying an honest one, in the same run.

    .venv/bin/python bench/trust.py [--signatures 2000] [--repeat 15]

The hostile envelope carries --signatures signatures that all name the one trusted control key and are
all invalid: real Ed25519 signatures by another key, so each costs a full verification where it is
checked (random bytes would mostly be refused by a cheap range check). Before verification cost was
bounded every one of them was checked, so the envelope's size set the CPU it cost. The honest envelope is
a desired state with one valid signature. Also timed: the costliest envelope within the policy's limit
(four signatures per trusted key, all naming the key, none valid). Prints the median of --repeat runs of
each and its ratio to the honest envelope, all in one run; the verifier runs in-process, as the agent
calls it. Run it with PYTHONPATH pointing at another checkout's collection to compare code versions.
"""

import argparse
import base64
import functools
import json
import os
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from timing import median_seconds

from ansible_collections.meridian.node.plugins.module_utils.contracts import format_rfc3339
from ansible_collections.meridian.node.plugins.module_utils.trust import dsse
from ansible_collections.meridian.node.plugins.module_utils.trust.verify import Rejection, verify_envelope

DESIRED = dsse.PAYLOAD_TYPES["desired-state"]


def _body() -> bytes:
    now = datetime.now(UTC).replace(microsecond=0)
    state = {
        "apiVersion": "meridian.node/v1",
        "kind": "DesiredState",
        "node_id": "gpu-node-1",
        "generation": 1,
        "lease_epoch": 1,
        "issued_at": format_rfc3339(now),
        "expires_at": format_rfc3339(now + timedelta(hours=1)),
    }
    return json.dumps(state).encode()


def _forged(keyid: str, body: bytes, count: int) -> list[dict[str, str]]:
    """Real Ed25519 signatures over this very body by another key, relabelled with the trusted keyid: well
    formed, so each costs a full verification (random bytes are mostly refused by a cheap range check)."""
    other = dsse.load_private_key_pem(dsse.generate_private_key_pem()[0])
    message = dsse.pae(DESIRED, body)
    return [
        {"keyid": keyid, "sig": base64.b64encode(other.sign(message + os.urandom(8))).decode()} for _ in range(count)
    ]


def _outcome(run: Callable[[], object]) -> str:
    try:
        run()
    except Rejection as rejection:
        return f"refused, {rejection.code.value}: {rejection.message[:110]}"
    return "accepted"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--signatures", type=int, default=2000, help="invalid signatures in the hostile envelope")
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()

    private_pem, keyid = dsse.generate_private_key_pem()
    private = dsse.load_private_key_pem(private_pem)
    keys = {keyid: private.public_key()}
    body = _body()
    honest = dsse.sign(DESIRED, body, [private])
    envelopes = {
        "honest (1 valid signature)": json.dumps(honest).encode(),
        f"hostile ({args.signatures} invalid, all naming the trusted key)": json.dumps(
            {**honest, "signatures": _forged(keyid, body, args.signatures)}
        ).encode(),
        "worst within the limit (4 invalid, all naming the trusted key)": json.dumps(
            {**honest, "signatures": _forged(keyid, body, 4)}
        ).encode(),
    }

    def verifier(data: bytes) -> Callable[[], object]:
        return lambda: verify_envelope(data, payload_type=DESIRED, keys=keys, threshold=1, role="control")

    timings = {}
    for name, data in envelopes.items():
        run = verifier(data)
        outcome = _outcome(run)
        timings[name] = median_seconds(functools.partial(_outcome, run), args.repeat)
        print(f"{name}: {len(data) / 1024:.1f} KiB, {timings[name] * 1e6:.0f} us, {outcome}")
    baseline = timings["honest (1 valid signature)"]
    for name, seconds in timings.items():
        print(f"  {name}: {seconds / baseline:.2f}x the honest envelope")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
