"""The engines' metrics text, read by ``engines/prometheus_text.py`` and held to ``prometheus_client``'s parser.

The reader is hand-written (hosts do not carry ``prometheus_client``) and reads what a remote peer sends, so
every text below is also given to the maintained parser: where that one reads samples, both read the same
names, labels and values; where the reader refuses a text, the maintained parser refuses it too, or the text
is one the reader is documented to refuse (it never guesses).
"""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ansible_collections.meridian.node.plugins.module_utils.engines.prometheus_text import (
    MetricsFormatError,
    parse_prometheus_text,
)

# Texts both must read alike: the engines' own gauges, label escapes, special values, timestamps, comments.
AGREED = [
    'vllm:num_requests_running{model_name="tiny"} 2.0\nvllm:num_requests_waiting{model_name="tiny"} 0.0\n',
    "# HELP tgi_queue_size Queue\n# TYPE tgi_queue_size gauge\ntgi_queue_size 3\ntgi_batch_current_size 1\n",
    'm{a="x,y",b="say \\"hi\\"",c="{}",d="back\\\\slash",e="two\\nlines",f="with space"} 1.5e+3\n',
    "a 1 1700000000000\nb +Inf\nc -Inf\n\n",
    "llamacpp:requests_processing 1\nllamacpp:requests_deferred 0\n",
    'sglang:num_running_reqs{model_name="m",tp_rank="0"} 4\nsglang:num_queue_reqs{model_name="m",tp_rank="0"} 7\n',
    "x NaN\n",
]
# Texts the reader refuses; the maintained parser must not read them as samples either.
REFUSED = [
    "<html><body>502 Bad Gateway</body></html>\n",
    'ok 1\nbad{x="unterminated} 2\n',
    "ok 1\nm three\n",
    "ok 1\nb{x=1} 2\n",
]


def _maintained(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [
        (sample.name, dict(sample.labels), sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def _ours(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(sample.name, dict(sample.labels), sample.value) for sample in parse_prometheus_text(text)]


def _same(left: list[tuple[str, dict[str, str], float]], right: list[tuple[str, dict[str, str], float]]) -> bool:
    def key(item: tuple[str, dict[str, str], float]) -> tuple[str, tuple[tuple[str, str], ...], str]:
        name, labels, value = item
        return name, tuple(sorted(labels.items())), "nan" if math.isnan(value) else repr(float(value))

    return sorted(map(key, left)) == sorted(map(key, right))


@pytest.mark.parametrize("text", AGREED)
def test_the_reader_agrees_with_prometheus_client(text: str) -> None:
    assert _same(_ours(text), _maintained(text))


@pytest.mark.parametrize("text", REFUSED)
def test_what_the_reader_refuses_prometheus_client_does_not_read_either(text: str) -> None:
    with pytest.raises(MetricsFormatError):
        parse_prometheus_text(text)
    with pytest.raises(ValueError):
        _maintained(text)


def test_labels_with_escapes_commas_braces_and_spaces_parse() -> None:
    text = 'm{a="x,y",b="say \\"hi\\"",c="{}",d="back\\\\slash",e="two\\nlines",f="with space",} 1.5e+3\n'
    (sample,) = parse_prometheus_text(text)
    assert sample.name == "m"
    assert sample.value == 1500.0
    assert dict(sample.labels) == {
        "a": "x,y",
        "b": 'say "hi"',
        "c": "{}",
        "d": "back\\slash",
        "e": "two\nlines",
        "f": "with space",
    }


def test_timestamps_special_values_and_exemplars_parse() -> None:
    text = 'a 1 1700000000000\nb +Inf\nc -Inf\nd_total{x="1"} 3 # {trace_id="abc"} 1.0 1700000000.1\n   \n# EOF\n'
    samples = {s.name: s.value for s in parse_prometheus_text(text)}
    assert samples["a"] == 1.0
    assert samples["b"] == math.inf
    assert samples["c"] == -math.inf
    assert samples["d_total"] == 3.0


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("<html><body>502 Bad Gateway</body></html>\n", 1),
        ("# TYPE a gauge\na 1\nb{x=1} 2\n", 3),
        ('ok 1\nbad{x="unterminated} 2\n', 2),
        ("ok 1\nnovalue\n", 2),
        ("ok 1\nm three\n", 2),
        ("ok 1\nm 1 2 3\n", 2),
    ],
)
def test_text_that_is_not_prometheus_exposition_is_refused_naming_the_line(text: str, line: int) -> None:
    with pytest.raises(MetricsFormatError, match=f"line {line} "):
        parse_prometheus_text(text)
