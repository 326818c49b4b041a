"""What an engine prints of its own environment, scrubbed before any of its log is kept, shown or reported.

Used by the agent's log keepers (root's observe unit under the split, the agent in-process:
``meridian_node_agent/collectors/engine_log_keeper.py``), which scrub what they read from Docker before it is
written; it lives here so that anything else that shows an engine's log (a module's failure message) can scrub it
the same way. Pure and standard library only: strings in, strings out. Runs on the managed host's Python (3.9+).

The environment is the container's own (``Config.Env`` of its inspect, which holds both the spec's ``env`` and
its ``secret_env``), less the entries its image already sets (``PATH``, ``LANG``: public in the image, and
scrubbing them would mangle every log that prints a path). Two rules, applied to the whole text before it is
split into lines (so a value printed with a newline in it is still found whole):

1. every occurrence of a value of ``MIN_SCRUBBED_CHARS`` characters or more becomes ``<redacted>``;
2. wherever a line prints ``NAME=`` for one of those names (``env``, ``printenv``, ``set``), the rest of that
   line becomes ``<redacted>``, whatever the value's length.

Shorter values are not hunted as bare strings: real ones are ``0``, ``1``, ``true``, ``auto``, and replacing
them everywhere would make the log unreadable (the mangling issue 25 reports of Ansible's ``no_log``). What
cannot be scrubbed, and docs/LOGS.md says so: a value the engine transforms before printing it (base64, URL- or
JSON-escaped, quoted with escapes, upper-cased), one Docker split across two lines (lines over 16 KiB), a short
value printed anywhere but after its ``NAME=``, and anything the engine derives from a secret (a token's hash).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["MIN_SCRUBBED_CHARS", "REDACTED", "EnvScrubber"]

REDACTED = "<redacted>"
# Below this a value is only scrubbed after its NAME= (rule 2): see the module's docstring.
MIN_SCRUBBED_CHARS = 6


@dataclass(frozen=True)
class EnvScrubber:
    """The names and values of one container's own environment, and how to scrub them out of its log."""

    names: frozenset[str]
    # Longest first: a value that contains another is replaced whole, not around the shorter one.
    values: tuple[str, ...]

    @classmethod
    def from_env(cls, container_env: Iterable[str], image_env: Iterable[str] = ()) -> EnvScrubber:
        """From ``Config.Env`` entries (``NAME=value``) of the container and of its image."""
        inherited = set(image_env)
        names: set[str] = set()
        values: set[str] = set()
        for entry in container_env:
            if entry in inherited:
                continue
            name, sep, value = entry.partition("=")
            if not sep or not name:
                continue
            names.add(name)
            if len(value) >= MIN_SCRUBBED_CHARS:
                values.add(value)
        return cls(names=frozenset(names), values=tuple(sorted(values, key=lambda v: (-len(v), v))))

    def scrub(self, text: str) -> str:
        """``text`` with every value replaced (rule 1) and every ``NAME=...`` line tail redacted (rule 2)."""
        for value in self.values:
            text = text.replace(value, REDACTED)
        if not self.names:
            return text
        # A name must start where a word does: HF_TOKEN= must not redact MY_HF_TOKEN='s line by accident (its own
        # name, if it is one of ours, is matched on its own).
        alternatives = "|".join(re.escape(name) for name in sorted(self.names, key=lambda n: (-len(n), n)))
        assignment = re.compile(rf"(?<![A-Za-z0-9_])({alternatives})=[^\r\n]+")
        return assignment.sub(lambda match: f"{match.group(1)}={REDACTED}", text)
