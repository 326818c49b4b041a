"""The policy file: what it accepts, and that every mistake is reported with its field and value."""

from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from ansible_collections.meridian.node.plugins.module_utils import contracts
from ansible_collections.meridian.node.plugins.module_utils.trust import dsse, policy
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import (
    DEFAULT_POLICY_PATH,
    DEFAULT_STORE_PATH,
    LEGACY_STORE_PATH,
    Policy,
    PolicyError,
    load_policy,
    parse_policy,
    parse_size,
)
from ansible_collections.meridian.node.tests.support.trust_fixtures import make_key, write_policy

CONTROL = make_key()
CONTROL_2 = make_key()
ARTIFACT = make_key()
AUTHORITY = make_key()
DIGEST = "sha256:" + "a" * 64

FULL_POLICY = """\
trust:
  control:            {threshold: 2, public_keys: [keys/control-0.pem, keys/control-1.pem]}
  artifact:           {threshold: 1, public_keys: [keys/artifact-0.pem]}
  air_gap_authority:  {threshold: 1, public_keys: [keys/air_gap_authority-0.pem]}
images:  {allowed_repositories: [ghcr.io/acme/vllm, registry.local:5000/engines/*], require_digest: true}
engines: {allowed_drivers: [vllm, tgi], bind_address: 127.0.0.1, port_range: [8000, 8099]}
store:   {path: /var/lib/meridian-node-artifacts, max_bytes: 500G}
agent:   {allowed_modes: [observe-only, managed-host]}
"""


@pytest.fixture
def policy_dir(tmp_path: Path) -> Path:
    """A directory with the four keys written where FULL_POLICY expects them."""
    write_policy(tmp_path, control=[CONTROL, CONTROL_2], artifact=[ARTIFACT], air_gap_authority=[AUTHORITY])
    return tmp_path


def write(directory: Path, text: str) -> Path:
    path = directory / "policy.yaml"
    path.write_text(text)
    return path


def error_for(directory: Path, text: str) -> str:
    path = write(directory, text)
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    message = str(info.value)
    assert message.startswith(f"policy {path}: "), message
    return message


def with_control(extra: str = "", control: str = "{public_keys: [keys/control-0.pem]}") -> str:
    return f"trust:\n  control: {control}\n{extra}"


# --- a good policy --------------------------------------------------------------------------------------


def test_full_policy_loads_every_section(policy_dir: Path) -> None:
    policy = load_policy(write(policy_dir, FULL_POLICY))
    assert policy.threshold("control") == 2
    assert set(policy.trusted_keys("control")) == {CONTROL.keyid, CONTROL_2.keyid}
    assert set(policy.trusted_keys("artifact")) == {ARTIFACT.keyid}
    assert set(policy.trusted_keys("air_gap_authority")) == {AUTHORITY.keyid}
    assert policy.engines.allowed_drivers == ("vllm", "tgi")
    assert policy.engines.port_range == (8000, 8099)
    assert policy.engines.bind_address == "127.0.0.1"
    assert policy.store.max_bytes == 500 * 10**9
    assert policy.store.path == "/var/lib/meridian-node-artifacts"
    assert policy.store.path_source == "policy" and policy.store.relocate_to is None
    assert policy.agent.allowed_modes == ("observe-only", "managed-host")


def test_trusted_keys_map_keyids_to_the_keys_themselves(policy_dir: Path) -> None:
    policy = load_policy(write(policy_dir, FULL_POLICY))
    for keyid, key in policy.trusted_keys("control").items():
        assert dsse.keyid_for(key) == keyid


def test_relative_key_paths_resolve_against_the_policy_directory_not_the_cwd(
    policy_dir: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(policy_dir, FULL_POLICY)
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
    assert CONTROL.keyid in load_policy(path).trusted_keys("control")


def test_absolute_key_path_and_inline_pem_are_both_accepted(tmp_path: Path) -> None:
    key_file = tmp_path / "abs.pem"
    key_file.write_bytes(CONTROL.public_pem)
    document = {"trust": {"control": {"threshold": 2, "public_keys": [str(key_file), CONTROL_2.public_pem.decode()]}}}
    policy = parse_policy(yaml.safe_dump(document), tmp_path / "unused")
    assert set(policy.trusted_keys("control")) == {CONTROL.keyid, CONTROL_2.keyid}


def test_omitted_sections_take_safe_defaults(policy_dir: Path) -> None:
    policy = load_policy(write(policy_dir, with_control()))
    assert policy.images.allowed_repositories == ()  # no image may run until policy names some
    assert policy.images.require_digest is True
    assert policy.engines.allowed_drivers == contracts.DRIVERS
    assert policy.engines.port_range == (8000, 8999)
    assert policy.engines.bind_address == "127.0.0.1"
    assert policy.store.max_bytes == 500 * 10**9
    assert "managed-host" in policy.agent.allowed_modes


@pytest.fixture
def store_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """The new and the old default store paths, moved under ``tmp_path`` (neither exists yet)."""
    new, old = tmp_path / "meridian-node-artifacts", tmp_path / "meridian-node" / "artifacts"
    monkeypatch.setattr(policy, "DEFAULT_STORE_PATH", str(new))
    monkeypatch.setattr(policy, "LEGACY_STORE_PATH", str(old))
    return new, old


def test_the_default_store_is_roots_own_directory_outside_the_agents() -> None:
    assert DEFAULT_STORE_PATH == "/var/lib/meridian-node-artifacts"
    assert not DEFAULT_STORE_PATH.startswith("/var/lib/meridian-node/")
    assert LEGACY_STORE_PATH == "/var/lib/meridian-node/artifacts"


def test_a_policy_without_store_path_gets_the_new_default(policy_dir: Path, store_defaults: tuple[Path, Path]) -> None:
    new, _old = store_defaults
    store = load_policy(write(policy_dir, with_control())).store
    assert (store.path, store.path_source, store.relocate_to) == (str(new), "default", None)


@pytest.mark.parametrize("new_state", ["absent", "empty"])
def test_a_store_left_at_the_old_default_keeps_being_used_and_names_where_it_should_go(
    policy_dir: Path, store_defaults: tuple[Path, Path], new_state: str
) -> None:
    new, old = store_defaults
    (old / "blobs" / "sha256").mkdir(parents=True)
    (old / "index.json").write_text("{}")
    if new_state == "empty":
        new.mkdir()  # what the apply unit's StateDirectory= leaves before anyone moved the store
    store = load_policy(write(policy_dir, with_control())).store
    assert (store.path, store.path_source, store.relocate_to) == (str(old), "legacy-default", str(new))


def test_once_the_new_default_holds_a_store_the_old_one_is_ignored(
    policy_dir: Path, store_defaults: tuple[Path, Path]
) -> None:
    new, old = store_defaults
    (old / "artifacts").mkdir(parents=True)
    (new / "artifacts").mkdir(parents=True)
    store = load_policy(write(policy_dir, with_control())).store
    assert (store.path, store.path_source) == (str(new), "default")


def test_an_explicit_store_path_is_taken_as_is_even_at_the_old_default(
    policy_dir: Path, store_defaults: tuple[Path, Path]
) -> None:
    _new, old = store_defaults
    (old / "artifacts").mkdir(parents=True)
    store = load_policy(write(policy_dir, with_control(f"store: {{path: {old}}}"))).store
    assert (store.path, store.path_source, store.relocate_to) == (str(old), "policy", None)


def test_manifests_may_name_no_local_directory_unless_store_local_sources_lists_it(policy_dir: Path) -> None:
    assert load_policy(write(policy_dir, with_control())).store.local_sources == ()
    listed = with_control("store: {local_sources: [/var/lib/meridian-node/inbox, /srv/models]}")
    assert load_policy(write(policy_dir, listed)).store.local_sources == ("/var/lib/meridian-node/inbox", "/srv/models")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            "store: {local_sources: [inbox]}",
            "store.local_sources[0]: must be an absolute directory path (got 'inbox')",
            id="relative",
        ),
        pytest.param(
            "store: {local_sources: /srv/models}",
            "store.local_sources: input should be a valid list",
            id="not-a-list",
        ),
        pytest.param(
            "store: {local_sources: [/srv/models, 3]}",
            "store.local_sources[1]: input should be a valid string",
            id="not-a-string",
        ),
        pytest.param("store: {local_source: [/srv]}", "store.local_source: unknown field", id="misspelt"),
    ],
)
def test_malformed_store_local_sources_are_refused_naming_the_entry(policy_dir: Path, text: str, expected: str) -> None:
    assert expected in error_for(policy_dir, with_control(text))


def test_unconfigured_role_trusts_nobody(policy_dir: Path) -> None:
    policy = load_policy(write(policy_dir, with_control()))
    assert policy.trusted_keys("air_gap_authority") == {}
    assert policy.threshold("air_gap_authority") >= 1


def test_asking_for_an_unknown_role_is_a_caller_bug(policy_dir: Path) -> None:
    policy = load_policy(write(policy_dir, with_control()))
    with pytest.raises(ValueError, match="unknown trust role 'admin'"):
        policy.trusted_keys("admin")  # type: ignore[arg-type]


def test_policy_loaded_without_keys_checks_engines_and_refuses_to_answer_for_trust(tmp_path: Path) -> None:
    # No key file exists: the engine modules never read keys, so they do not depend on them being readable.
    policy = load_policy(write(tmp_path, FULL_POLICY), keys=False)

    assert policy.engines.port_range == (8000, 8099)
    assert policy.image_allowed(f"ghcr.io/acme/vllm@{DIGEST}") is None
    with pytest.raises(RuntimeError, match="loaded without its keys"):
        policy.trusted_keys("control")
    with pytest.raises(RuntimeError, match="loaded without its keys"):
        policy.threshold("control")


def test_policy_loaded_without_keys_still_refuses_a_malformed_trust_section(tmp_path: Path) -> None:
    path = write(tmp_path, "trust:\n  control: {threshhold: 1, public_keys: [k.pem]}\n")
    with pytest.raises(PolicyError, match="threshhold"):
        load_policy(path, keys=False)


def test_default_path_is_the_documented_one() -> None:
    assert DEFAULT_POLICY_PATH == "/etc/meridian/policy.yaml"


# --- sizes ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1234, 1234),
        ("500G", 500 * 1000**3),
        ("500GB", 500 * 1000**3),
        ("2TiB", 2 * 1024**4),
        ("2Ti", 2 * 1024**4),
        ("64Mi", 64 * 1024**2),
        ("10", 10),
    ],
)
def test_size_strings_are_decimal_or_binary_units(value: int | str, expected: int) -> None:
    assert parse_size(value) == expected


@pytest.mark.parametrize("value", ["lots", "5 PB", "-1G", "1.5G", 0, -5])
def test_nonsense_sizes_are_refused(value: int | str) -> None:
    with pytest.raises(ValueError, match=repr(value).replace("(", r"\(")):
        parse_size(value)


# --- images, drivers, ports, modes ---------------------------------------------------------------------


@pytest.fixture
def full(policy_dir: Path) -> Policy:
    return load_policy(write(policy_dir, FULL_POLICY))


def test_pinned_image_from_an_allowed_repository_may_run(full: Policy) -> None:
    assert full.image_allowed(f"ghcr.io/acme/vllm:0.6@{DIGEST}") is None
    assert full.image_allowed(f"registry.local:5000/engines/tgi@{DIGEST}") is None


def test_unpinned_image_is_refused(full: Policy) -> None:
    reason = full.image_allowed("ghcr.io/acme/vllm:latest")
    assert reason is not None and "unpinned" in reason


def test_image_from_an_unlisted_repository_is_refused(full: Policy) -> None:
    reason = full.image_allowed(f"ghcr.io/evil/vllm@{DIGEST}")
    assert reason is not None and "repository 'ghcr.io/evil/vllm' is not allowed" in reason


def test_lookalike_repository_does_not_match_a_prefix_entry(full: Policy) -> None:
    # "registry.local:5000/engines/*" must not admit "registry.local:5000/engines-evil/x".
    assert full.image_allowed(f"registry.local:5000/engines-evil/x@{DIGEST}") is not None


def test_invalid_image_reference_is_refused(full: Policy) -> None:
    reason = full.image_allowed("UPPER/case@sha256:zz")
    assert reason is not None and "not a valid reference" in reason


def test_tags_are_enough_when_policy_does_not_require_digests(policy_dir: Path) -> None:
    policy = load_policy(
        write(policy_dir, with_control("images: {allowed_repositories: [ghcr.io/acme/vllm], require_digest: false}"))
    )
    assert policy.image_allowed("ghcr.io/acme/vllm:0.6") is None


def test_drivers_ports_and_modes_are_checked_against_policy(full: Policy) -> None:
    assert full.driver_allowed("vllm") is None
    assert "driver 'ollama' is not allowed" in (full.driver_allowed("ollama") or "")
    assert full.port_allowed(8000) is None and full.port_allowed(8099) is None
    assert "port 8100 is outside" in (full.port_allowed(8100) or "")
    assert full.mode_allowed("observe-only") is None
    assert "'air-gapped' is not allowed" in (full.mode_allowed("air-gapped") or "")


# --- malformed policies: every message names the field and the value ----------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            with_control(control="{threshold: 0, public_keys: [keys/control-0.pem]}"),
            "trust.control.threshold: must be >= 1 (got 0)",
            id="threshold-zero",
        ),
        pytest.param(
            with_control(control="{threshold: 2, public_keys: [keys/control-0.pem, keys/control-0.pem]}"),
            "trust.control.threshold: must be <= the number of distinct public keys (1) (got 2)",
            id="threshold-met-by-one-key-listed-twice",
        ),
        pytest.param(
            with_control(control="{threshold: '1', public_keys: [keys/control-0.pem]}"),
            "trust.control.threshold: input should be a valid integer (got '1')",
            id="threshold-as-string",
        ),
        pytest.param(
            with_control(control="{threshhold: 1, public_keys: [keys/control-0.pem]}"),
            "trust.control.threshhold: unknown field (got 1)",
            id="misspelt-threshold",
        ),
        pytest.param(
            with_control(control="{public_keys: []}"),
            "trust.control.public_keys: list should have at least 1 item",
            id="no-keys",
        ),
        pytest.param("trust: {}\n", "trust.control: a required field is missing", id="no-control-role"),
        pytest.param(
            "trust: {control: null}\n",
            "trust.control: input should be a valid dictionary (got None)",
            id="null-control",
        ),
        pytest.param(
            with_control(control="{threshold: 1.0, public_keys: [keys/control-0.pem]}"),
            "trust.control.threshold: input should be a valid integer (got 1.0)",
            id="threshold-as-float",
        ),
        pytest.param(
            with_control("engines: {port_range: [8000, true]}"),
            "engines.port_range[1]: input should be a valid integer (got True)",
            id="port-as-boolean",
        ),
        pytest.param(
            with_control("images: null"), "images: input should be a valid dictionary (got None)", id="null-section"
        ),
        pytest.param(
            with_control("store: {max_bytes: 1.5}"), "store.max_bytes: must be a byte count", id="size-as-float"
        ),
        pytest.param("images: {}\n", "trust: a required field is missing", id="no-trust"),
        pytest.param(with_control("imagez: {}"), "imagez: unknown field (got {})", id="unknown-section"),
        pytest.param(
            with_control("engines: {allowed_drivers: [vllm, docker-run]}"),
            "engines.allowed_drivers: unknown driver 'docker-run'",
            id="unknown-driver",
        ),
        pytest.param(
            with_control("engines: {port_range: [9000, 8000]}"),
            "engines.port_range: must be [low, high] with 1 <= low <= high <= 65535 (got [9000, 8000])",
            id="reversed-port-range",
        ),
        pytest.param(
            with_control("engines: {port_range: [8000, 70000]}"),
            "engines.port_range: must be [low, high] with 1 <= low <= high <= 65535 (got [8000, 70000])",
            id="port-above-65535",
        ),
        pytest.param(
            with_control("engines: {port_range: [8000]}"),
            "engines.port_range: list should have at least 2 items",
            id="port-range-one-number",
        ),
        pytest.param(
            with_control("engines: {bind_address: 0.0.0.0.0}"),
            "engines.bind_address: must be an IP address such as 127.0.0.1 (got '0.0.0.0.0')",
            id="bad-bind-address",
        ),
        pytest.param(
            with_control("store: {max_bytes: lots}"),
            "store.max_bytes: must be a byte count or a size like 500G",
            id="bad-size",
        ),
        pytest.param(
            with_control("store: {max_bytes: 0}"), "store.max_bytes: must be more than 0 bytes (got 0)", id="zero-size"
        ),
        pytest.param(
            with_control("store: {path: relative/store}"),
            "store.path: must be an absolute path (got 'relative/store')",
            id="relative-store-path",
        ),
        pytest.param(
            with_control('images: {require_digest: "no"}'),
            "images.require_digest: input should be a valid boolean (got 'no')",
            id="digest-flag-as-string",
        ),
        pytest.param(
            with_control("agent: {allowed_modes: [yolo]}"),
            "agent.allowed_modes: unknown mode 'yolo'",
            id="unknown-mode",
        ),
        pytest.param(
            with_control(control="{public_keys: [keys/missing.pem]}"),
            "trust.control.public_keys[0]: cannot read key file",
            id="missing-key-file",
        ),
        pytest.param(
            with_control(control="{public_keys: ['-----BEGIN PUBLIC KEY-----\\nAAAA\\n-----END PUBLIC KEY-----']}"),
            "trust.control.public_keys[0]: inline PEM: not a PEM public key",
            id="bad-inline-pem",
        ),
        pytest.param("trust: {control: [\n", "not valid YAML", id="broken-yaml"),
        pytest.param("trust: {}\ntrust: {}\n", "not valid YAML: duplicate key 'trust' at line 2", id="duplicate-key"),
        pytest.param("- trust\n", "the top level must be a mapping", id="top-level-list"),
        pytest.param("", "the top level must be a mapping", id="empty-file"),
    ],
)
def test_malformed_policy_is_reported_with_field_and_value(policy_dir: Path, text: str, expected: str) -> None:
    message = error_for(policy_dir, text)
    assert expected in message


def test_missing_key_file_message_names_the_resolved_path(policy_dir: Path) -> None:
    message = error_for(policy_dir, with_control(control="{public_keys: [keys/missing.pem]}"))
    assert str(policy_dir / "keys" / "missing.pem") in message
    assert "No such file or directory" in message


def test_private_key_in_the_policy_is_refused(policy_dir: Path) -> None:
    (policy_dir / "keys" / "oops.pem").write_bytes(CONTROL.private_pem)
    message = error_for(policy_dir, with_control(control="{public_keys: [keys/oops.pem]}"))
    assert "trust.control.public_keys[0]" in message and "PRIVATE key" in message


def test_non_ed25519_key_in_the_policy_is_refused(policy_dir: Path) -> None:
    pem = (
        ec.generate_private_key(ec.SECP256R1())
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    (policy_dir / "keys" / "ec.pem").write_bytes(pem)
    message = error_for(policy_dir, with_control(control="{public_keys: [keys/control-0.pem, keys/ec.pem]}"))
    assert "trust.control.public_keys[1]" in message and "Ed25519 keys only" in message


def test_missing_policy_file_is_reported_with_its_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(PolicyError, match=f"policy {path}: cannot read the file: No such file or directory"):
        load_policy(path)


def test_policy_path_that_is_a_directory_is_reported(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match=f"policy {tmp_path}: cannot read the file: Is a directory"):
        load_policy(tmp_path)


def test_policy_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_bytes(b"trust: \xff\xfe\n")
    with pytest.raises(PolicyError, match="not UTF-8"):
        load_policy(path)


def test_yaml_error_names_the_line(policy_dir: Path) -> None:
    message = error_for(policy_dir, with_control("engines:\n  port_range: [8000, 9000\n"))
    assert "line" in message


def test_parse_policy_names_its_source_in_errors(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match=r"^policy inline-test: trust: a required field is missing$"):
        parse_policy("{}", tmp_path, source="inline-test")


# --- trust.control.max_lifetime ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected", "spelled"),
    [
        ("90s", timedelta(seconds=90), "1m 30s"),
        ("30m", timedelta(minutes=30), "30m"),
        ("12h", timedelta(hours=12), "12h"),
        ("7d", timedelta(days=7), "7d"),
        ("2w", timedelta(days=14), "14d"),
    ],
)
def test_control_max_lifetime_takes_a_duration(policy_dir: Path, value: str, expected: timedelta, spelled: str) -> None:
    text = with_control(control=f"{{max_lifetime: {value}, public_keys: [keys/control-0.pem]}}")
    assert load_policy(write(policy_dir, text)).max_lifetime("control") == expected
    assert policy.format_duration(expected) == spelled


def test_max_lifetime_is_unset_by_default_and_for_unconfigured_roles(policy_dir: Path) -> None:
    loaded = load_policy(write(policy_dir, with_control()))
    assert loaded.max_lifetime("control") is None
    assert loaded.max_lifetime("artifact") is None


DURATION_FORM = "must be a duration: a whole number and one unit of s, m, h, d or w, such as 7d or 12h"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param("'7'", f"{DURATION_FORM} (got '7')", id="no-unit"),
        pytest.param("7 days", f"{DURATION_FORM} (got '7 days')", id="words"),
        pytest.param("1.5d", f"{DURATION_FORM} (got '1.5d')", id="fraction"),
        pytest.param("-1d", f"{DURATION_FORM} (got '-1d')", id="negative"),
        pytest.param("1d12h", f"{DURATION_FORM} (got '1d12h')", id="two-units"),
        pytest.param("7D", f"{DURATION_FORM} (got '7D')", id="upper-case"),
        pytest.param("604800", f"{DURATION_FORM} (got 604800)", id="bare-number"),
        pytest.param("true", f"{DURATION_FORM} (got True)", id="boolean"),
        pytest.param("0d", "must be more than 0 and at most 100 years (got '0d')", id="zero"),
        pytest.param("40000d", "must be more than 0 and at most 100 years (got '40000d')", id="forever"),
    ],
)
def test_nonsense_max_lifetime_is_refused_naming_the_value(policy_dir: Path, value: str, expected: str) -> None:
    text = with_control(control=f"{{max_lifetime: {value}, public_keys: [keys/control-0.pem]}}")
    assert error_for(policy_dir, text).endswith(f": trust.control.max_lifetime: {expected}")


def test_max_lifetime_belongs_to_control_only(policy_dir: Path) -> None:
    text = with_control("  artifact: {max_lifetime: 7d, public_keys: [keys/artifact-0.pem]}\n")
    assert "trust.artifact.max_lifetime: unknown field (got '7d')" in error_for(policy_dir, text)


def test_policy_without_keys_still_checks_max_lifetime(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match=r"trust\.control\.max_lifetime: must be a duration"):
        parse_policy("trust: {control: {public_keys: [k.pem], max_lifetime: soon}}", tmp_path, keys=False)


# --- cordon --------------------------------------------------------------------------------------------


def test_cordon_section_names_gpus_drain_and_reason(policy_dir: Path) -> None:
    loaded = load_policy(write(policy_dir, with_control('cordon: {gpus: ["3", GPU-abc], drain: true, reason: fan}\n')))
    assert loaded.cordon == policy.CordonPolicy(gpus=("3", "GPU-abc"), drain=True, reason="fan")
    assert load_policy(write(policy_dir, with_control())).cordon is None


@pytest.mark.parametrize(
    ("section", "words"),
    [
        ("cordon: {gpus: []}", "cordon.gpus"),
        ("cordon: {drain: true}", "gpus"),
        ('cordon: {gpus: [" "]}', "cordon.gpus[0]"),
        ("cordon: {gpus: [3]}", "cordon.gpus[0]"),
        ('cordon: {gpus: ["3"], drain: "yes"}', "cordon.drain"),
        ('cordon: {gpus: ["3"], node: true}', "node"),
    ],
)
def test_a_malformed_cordon_section_is_refused_by_field(policy_dir: Path, section: str, words: str) -> None:
    assert words in error_for(policy_dir, with_control(section + "\n"))
