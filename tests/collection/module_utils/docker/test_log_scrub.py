"""``docker.log_scrub``: the engine's own environment never survives into a kept log, and nothing else is
mangled. Pure: strings in, strings out."""

from __future__ import annotations

from ansible_collections.meridian.node.plugins.module_utils.docker.log_scrub import (
    MIN_SCRUBBED_CHARS,
    REDACTED,
    EnvScrubber,
)

IMAGE_ENV = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin", "LANG=C.UTF-8"]
SECRET = "hf_s3cr3t-Token-Value"


def _scrubber(*entries: str) -> EnvScrubber:
    return EnvScrubber.from_env([*IMAGE_ENV, *entries], IMAGE_ENV)


def test_a_long_value_is_replaced_wherever_the_engine_prints_it() -> None:
    scrubber = _scrubber(f"HF_TOKEN={SECRET}")

    text = scrubber.scrub(f"HF_TOKEN={SECRET}\nusing token {SECRET} for hub, again:{SECRET}!\n")

    assert SECRET not in text
    assert text == f"HF_TOKEN={REDACTED}\nusing token {REDACTED} for hub, again:{REDACTED}!\n"


def test_a_value_shorter_than_the_minimum_is_scrubbed_only_where_printed_after_its_name() -> None:
    # Real env values are 0, 1, true, tgi: replacing them everywhere would make every log unreadable.
    short = "x" * (MIN_SCRUBBED_CHARS - 1)
    scrubber = _scrubber(f"API_KEY={short}", "WORKERS=1")

    text = scrubber.scrub(f"API_KEY={short}\nWORKERS=1\nloaded 1 model, key {short}, 100% of layers\n")

    assert text.splitlines() == [
        f"API_KEY={REDACTED}",
        f"WORKERS={REDACTED}",
        f"loaded 1 model, key {short}, 100% of layers",  # documented: a short value printed elsewhere stays
    ]


def test_a_value_at_the_minimum_length_is_replaced_as_a_bare_string() -> None:
    value = "y" * MIN_SCRUBBED_CHARS
    assert _scrubber(f"PASSWORD={value}").scrub(f"pw is {value}") == f"pw is {REDACTED}"


def test_what_the_image_itself_sets_is_left_alone() -> None:
    # PATH and LANG are public in the image; scrubbing them would cut every path out of every log.
    text = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin\nLANG=C.UTF-8\nexec /usr/local/bin/serve\n"
    assert _scrubber(f"HF_TOKEN={SECRET}").scrub(text) == text


def test_a_value_the_engine_overrides_from_the_image_is_the_engines_own() -> None:
    scrubber = EnvScrubber.from_env(["LANG=secret-locale-xyz"], IMAGE_ENV)
    assert scrubber.scrub("LANG=secret-locale-xyz") == f"LANG={REDACTED}"


def test_a_value_with_a_newline_in_it_is_found_whole_across_lines() -> None:
    key = "-----BEGIN KEY-----\nMIIBVwIBADANBgkqhkiG9w0BAQEFAASCAUEwggE9\n-----END KEY-----"
    scrubber = _scrubber(f"TLS_KEY={key}")

    text = scrubber.scrub(f"read key:\n{key}\ndone\n")

    assert "MIIBVwIBADANBgkqhkiG9w0BAQEFAASCAUEwggE9" not in text
    assert text == f"read key:\n{REDACTED}\ndone\n"


def test_a_longer_value_containing_a_shorter_one_is_replaced_whole() -> None:
    scrubber = _scrubber("SHORT=abcdefgh", "LONG=abcdefgh-and-more")
    assert scrubber.scrub("abcdefgh-and-more / abcdefgh") == f"{REDACTED} / {REDACTED}"


def test_a_name_inside_a_longer_name_does_not_redact_that_line() -> None:
    scrubber = _scrubber("TOKEN=1")
    assert scrubber.scrub("MY_TOKEN=visible\nTOKEN=1") == f"MY_TOKEN=visible\n{'TOKEN=' + REDACTED}"


def test_an_engine_name_holding_a_short_value_is_printed_whole() -> None:
    # Issue 25's complaint about no_log: 'aud-********' for an engine named aud-tgi whose env held tgi.
    assert _scrubber("DRIVER=tgi").scrub("engine aud-tgi ready") == "engine aud-tgi ready"


def test_no_environment_scrubs_nothing() -> None:
    assert EnvScrubber.from_env([], []).scrub("A=b\nhello") == "A=b\nhello"
