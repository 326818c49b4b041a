"""The policy's ``air_gap`` section and ``trust.air_gap_authority.max_lifetime``: defaults, and each bad
value refused naming the field and the value."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from ansible_collections.meridian.node.plugins.module_utils.airgap.bundle_reader import BundleRefused, check_bundle
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import (
    DEFAULT_BUNDLE_SCRATCH,
    PolicyError,
    load_policy,
    parse_policy,
)
from ansible_collections.meridian.node.plugins.module_utils.trust.verify import AppliedState, RejectionCode
from ansible_collections.meridian.node.tests.support.bundle_fixtures import good_bundle, make_site
from ansible_collections.meridian.node.tests.support.trust_fixtures import NODE_ID, NOW

TRUST = "trust: {control: {public_keys: [k.pem]}}\n"


def test_air_gap_defaults_are_roots_scratch_and_generous_caps(tmp_path: Path) -> None:
    caps = parse_policy(TRUST, tmp_path, keys=False).air_gap
    assert caps.scratch_dir == DEFAULT_BUNDLE_SCRATCH == "/var/lib/meridian-node-apply/bundle-scratch"
    assert (caps.max_bytes, caps.max_members) == (1024**4, 10_000)


def test_air_gap_caps_take_sizes(tmp_path: Path) -> None:
    text = TRUST + "air_gap: {scratch_dir: /srv/scratch, max_bytes: 2TiB, max_members: 50}\n"
    caps = parse_policy(text, tmp_path, keys=False).air_gap
    assert (caps.scratch_dir, caps.max_bytes, caps.max_members) == ("/srv/scratch", 2 * 1024**4, 50)


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        (
            "{scratch_dir: scratch}",
            "air_gap.scratch_dir: must be an absolute path without '.', '..', '//' or a trailing '/' (got 'scratch')",
        ),
        ("{scratch_dir: /srv/../tmp}", "air_gap.scratch_dir: must be an absolute path"),
        ("{scratch_dir: /}", "air_gap.scratch_dir: must be an absolute path"),
        ("{max_bytes: lots}", "air_gap.max_bytes: must be a byte count or a size like 500G"),
        ("{max_bytes: true}", "air_gap.max_bytes: must be a byte count or a size like 2TiB (got True)"),
        ("{max_members: 0}", "air_gap.max_members"),
        ("{scratch: /srv}", "air_gap.scratch: unknown field"),
    ],
)
def test_bad_air_gap_values_are_refused_naming_the_field(tmp_path: Path, section: str, expected: str) -> None:
    with pytest.raises(PolicyError) as caught:
        parse_policy(TRUST + f"air_gap: {section}\n", tmp_path, keys=False)
    assert expected in str(caught.value)


def test_bundle_valid_longer_than_the_authoritys_max_lifetime_is_refused(tmp_path: Path) -> None:
    site = make_site(tmp_path)
    bundle = good_bundle(site)  # valid for a day
    strict = site.root / "etc" / "strict.yaml"
    strict.write_text(
        "trust:\n"
        "  control: {public_keys: [keys/control-0.pem]}\n"
        "  artifact: {public_keys: [keys/artifact-0.pem]}\n"
        "  air_gap_authority: {public_keys: [keys/air_gap_authority-0.pem], max_lifetime: 12h}\n"
    )
    policy = load_policy(strict)
    assert policy.max_lifetime("air_gap_authority") == timedelta(hours=12)
    with pytest.raises(BundleRefused) as caught:
        check_bundle(str(bundle), policy, node_id=NODE_ID, now=NOW, applied=AppliedState())
    assert caught.value.reason is RejectionCode.SCHEMA
    assert "is valid for 1d, longer than trust.air_gap_authority.max_lifetime 12h" in caught.value.message
    # The site's own policy sets no cap: the same bundle is accepted there.
    assert check_bundle(str(bundle), site.policy, node_id=NODE_ID, now=NOW, applied=AppliedState()).bytes_read
