"""``control_plane.replica_urls``: more base URLs of one control plane, each https://, each once, none equal to
``url``; every refusal names the entry, its value and what to do."""

from pathlib import Path

import pytest
import yaml

from meridian_node_agent.config import ConfigError, ControlPlaneConfig, load_config

URL = "https://meridian.example:8443"


def _load(tmp_path: Path, control_plane: dict[str, object]) -> ControlPlaneConfig:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"node_id": "gpu-node-1", "control_plane": control_plane}))
    loaded = load_config(path).control_plane
    assert loaded is not None
    return loaded


def test_replica_urls_default_to_none_and_keep_their_order(tmp_path: Path) -> None:
    alone = _load(tmp_path, {"url": URL})
    listed = _load(tmp_path, {"url": URL, "replica_urls": ["https://b.example:8443", "https://a.example/cp"]})

    assert alone.replica_urls == []
    assert [str(url) for url in listed.replica_urls] == ["https://b.example:8443/", "https://a.example/cp"]


@pytest.mark.parametrize(
    ("replica_urls", "expected"),
    [
        (
            ["https://b.example", "http://c.example"],
            "control_plane: replica_urls[1] must be https:// like url (mutual TLS is how the node proves who it is), "
            "got http://c.example/",
        ),
        (
            ["https://b.example", "https://B.example:443/"],
            "control_plane: replica_urls[1] (https://b.example/) is the same URL as replica_urls[0]: list each "
            "replica once, and not url again",
        ),
        ([f"{URL}/"], f"replica_urls[0] ({URL}/) is the same URL as url: list each replica once, and not url again"),
        ("https://b.example", "control_plane.replica_urls: input should be a valid list (got 'https://b.example')"),
        (["not a url"], "control_plane.replica_urls[0]: input should be a valid URL"),
    ],
)
def test_bad_replica_urls_are_refused_naming_the_entry(tmp_path: Path, replica_urls: object, expected: str) -> None:
    with pytest.raises(ConfigError) as refused:
        _load(tmp_path, {"url": URL, "replica_urls": replica_urls})

    assert expected in str(refused.value)
