"""The policy's images section: how a missing image may be pulled (issue 26), each mistake named with its value."""

from pathlib import Path

import pytest

from ansible_collections.meridian.node.plugins.module_utils.trust.policy import PolicyError, load_policy
from ansible_collections.meridian.node.tests.support.trust_fixtures import make_key, write_policy


def policy_with(tmp_path: Path, images: dict[str, object]) -> Path:
    return write_policy(tmp_path, control=[make_key()], extra={"images": {"allowed_repositories": ["a/b"], **images}})


def test_pull_limits_default_to_a_two_minute_stall_bound_a_1gib_floor_and_no_credentials(tmp_path: Path) -> None:
    images = load_policy(policy_with(tmp_path, {}), keys=False).images
    assert (images.pull_stall_seconds, images.min_free_bytes, images.registry_auth_file) == (120, 1024**3, None)


def test_pull_limits_are_read_as_written(tmp_path: Path) -> None:
    path = policy_with(
        tmp_path, {"pull_stall_seconds": 30, "min_free_bytes": "20Gi", "registry_auth_file": "/etc/meridian/auth.json"}
    )
    images = load_policy(path, keys=False).images
    assert (images.pull_stall_seconds, images.min_free_bytes) == (30, 20 * 1024**3)
    assert images.registry_auth_file == "/etc/meridian/auth.json"


def test_a_zero_floor_switches_it_off(tmp_path: Path) -> None:
    assert load_policy(policy_with(tmp_path, {"min_free_bytes": 0}), keys=False).images.min_free_bytes == 0


@pytest.mark.parametrize(
    ("images", "expected"),
    [
        ({"pull_stall_seconds": 0}, "images.pull_stall_seconds: must be >= 1"),
        ({"pull_stall_seconds": "2m"}, "images.pull_stall_seconds"),
        ({"min_free_bytes": -1}, "images.min_free_bytes"),
        ({"min_free_bytes": "lots"}, "images.min_free_bytes"),
        ({"min_free_bytes": True}, "images.min_free_bytes"),
        ({"registry_auth_file": "auth.json"}, "images.registry_auth_file: must be a normal absolute path"),
        ({"registry_auth_file": "/etc/../tmp/auth.json"}, "images.registry_auth_file"),
        ({"registry_auth": "/etc/auth.json"}, "registry_auth"),
        ({"prune_grace_seconds": -1}, "images.prune_grace_seconds: must be >= 0"),
        ({"prune_grace_seconds": "1d"}, "images.prune_grace_seconds"),
        ({"prune_grace_seconds": True}, "images.prune_grace_seconds"),
        ({"prune_grace_seconds": 366 * 86400}, "images.prune_grace_seconds"),
    ],
)
def test_bad_pull_limits_are_refused_naming_the_field(tmp_path: Path, images: dict[str, object], expected: str) -> None:
    with pytest.raises(PolicyError, match=expected.replace(".", r"\.")):
        load_policy(policy_with(tmp_path, images), keys=False)


def test_the_image_prune_grace_defaults_to_a_day_and_zero_means_at_once(tmp_path: Path) -> None:
    assert load_policy(policy_with(tmp_path, {}), keys=False).images.prune_grace_seconds == 86400
    other = tmp_path / "zero"
    assert load_policy(policy_with(other, {"prune_grace_seconds": 0}), keys=False).images.prune_grace_seconds == 0
