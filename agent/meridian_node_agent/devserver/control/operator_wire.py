"""The operator socket's messages: how ``publish`` beside a running server hands its work to that server.

Runs on: the devserver (the ``serve`` process and the CLI).

A CLI verb is a process of its own, and opening the control plane costs it most of its time: ``publish`` spent
0.39 of its 0.42 s importing the store (SQLAlchemy alone 0.14 s), the CA and the contracts before its 0.03 s of
work (``bench/agent.py`` counts that command in publish-to-ready). A ``serve`` process has all of that loaded
and the node's long-poll parked in memory, so it listens on ``DATA_DIR/operator.sock`` (``serving/
operator_socket.py``) and the CLI asks it first (``cli/operate.py``); with no server there, or one serving
another database, the CLI does the work itself as before. Either way the same ``ControlPlane.publish`` signs and
stores the state and the output is the same.

Who may ask: the socket is a file in the data dir (0700, the server's) made 0600, and the server also checks the
peer's credentials (``SO_PEERCRED``): only its own user or root. That is who can read the control key in that
directory anyway; nothing here is reachable by anyone the data dir does not already trust.

One request per connection: the client writes one JSON object and shuts its side down; the server answers one
JSON object and closes. JSON by the standard library on both sides (no hand parsing); at most
``MAX_REQUEST_BYTES`` read, within ``TIMEOUT_S``.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError

__all__ = [
    "MAX_ANSWER_BYTES",
    "MAX_DOCUMENT_BYTES",
    "MAX_REQUEST_BYTES",
    "SOCKET_NAME",
    "TIMEOUT_S",
    "OperatorSocketError",
    "PublishRequest",
    "ask_server",
    "decode_request",
    "encode_answer",
    "socket_path",
    "unix_address",
]

SOCKET_NAME = "operator.sock"
MAX_DOCUMENT_BYTES = 1024 * 1024  # a desired state's YAML, as the CLI reads it (its own cap)
# The document in base64 (4/3 of it) and the few other fields.
MAX_REQUEST_BYTES = MAX_DOCUMENT_BYTES * 4 // 3 + 64 * 1024
MAX_ANSWER_BYTES = 4 * 1024 * 1024  # a signed envelope of the largest state, in base64
# A publish is a transaction and a signature: far below this even on a loaded machine. A peer that sends
# nothing for this long loses its connection.
TIMEOUT_S = 30.0


class OperatorSocketError(MeridianError):
    """The server took the request and then failed to answer it: whether the state was published is unknown."""


def socket_path(data_dir: Path) -> Path:
    return Path(data_dir) / SOCKET_NAME


# sun_path holds 108 bytes with its NUL; a data dir under pytest's or a deep home directory is longer.
_UNIX_PATH_MAX = 107


@contextlib.contextmanager
def unix_address(path: Path) -> Iterator[str]:
    """``path`` as ``bind``/``connect`` of an AF_UNIX socket can take it: itself when it fits, else the same file
    through ``/proc/self/fd`` of its directory, opened for the block (Linux resolves that link to the directory)."""
    if len(os.fsencode(str(path))) <= _UNIX_PATH_MAX:
        yield str(path)
        return
    directory = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{directory}/{path.name}"
    finally:
        os.close(directory)


@dataclass(frozen=True)
class PublishRequest:
    """``publish``'s arguments: the node, the document's bytes as read from ``where`` (named in messages), the
    state's time to live (None: the server's default), and the database the CLI would open (None: the data dir's
    SQLite file), which must be the server's for the server to take it."""

    node: str
    document: bytes
    where: str
    ttl_s: int | None
    database: str | None

    def encode(self) -> bytes:
        return json.dumps(
            {
                "verb": "publish",
                "node": self.node,
                "document": base64.b64encode(self.document).decode("ascii"),
                "where": self.where,
                "ttl_s": self.ttl_s,
                "database": self.database,
            }
        ).encode()


def decode_request(data: bytes) -> PublishRequest:
    """The request in ``data``; ValueError naming what is wrong with it."""
    if len(data) > MAX_REQUEST_BYTES:
        raise ValueError(f"the request is larger than {MAX_REQUEST_BYTES} bytes")
    try:
        message: Any = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"the request is not JSON: {exc}") from exc
    if not isinstance(message, dict):
        raise ValueError(f"the request must be a JSON object, got {type(message).__name__}")
    fields = {"verb", "node", "document", "where", "ttl_s", "database"}
    if set(message) != fields:
        raise ValueError(f"the request must have exactly the fields {sorted(fields)}, got {sorted(message)}")
    if message["verb"] != "publish":
        raise ValueError(f"unknown verb {message['verb']!r}: the operator socket takes only 'publish'")
    for name in ("node", "document", "where"):
        if not isinstance(message[name], str):
            raise ValueError(f"{name} must be a string")
    ttl_s = message["ttl_s"]
    if ttl_s is not None and (not isinstance(ttl_s, int) or isinstance(ttl_s, bool)):
        raise ValueError("ttl_s must be an integer or null")
    if message["database"] is not None and not isinstance(message["database"], str):
        raise ValueError("database must be a string or null")
    try:
        document = base64.b64decode(message["document"], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"document is not base64: {exc}") from exc
    return PublishRequest(message["node"], document, message["where"], ttl_s, message["database"])


def encode_answer(status: str, **fields: Any) -> bytes:
    """An answer: ``status`` is ``published`` (with generation, lease_epoch, envelope in base64), ``elsewhere``
    (this server serves another database: the CLI does the work itself), ``usage`` or ``refused`` (with
    message: what the CLI would have said doing it itself)."""
    return json.dumps({"status": status, **fields}).encode()


def ask_server(data_dir: Path, request: PublishRequest) -> dict[str, Any] | None:
    """The answer of the server listening on ``data_dir``'s operator socket to ``request``; None when no server
    can be reached there (no socket, one a stopped server left, one this user may not open) or it serves another
    database. ``OperatorSocketError`` when it took the request and gave no answer."""
    path = socket_path(data_dir)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client.settimeout(TIMEOUT_S)
        try:
            with unix_address(path) as address:
                client.connect(address)
        except OSError:
            return None  # none there, one a stopped server left, one this user may not open: the CLI does it
        received = bytearray()
        try:
            client.sendall(request.encode())
            client.shutdown(socket.SHUT_WR)
            while len(received) <= MAX_ANSWER_BYTES:
                chunk = client.recv(65536)
                if not chunk:
                    break
                received += chunk
        except OSError as exc:
            raise OperatorSocketError(f"the server at {path} did not answer ({exc}){_UNKNOWN}") from exc
    finally:
        client.close()
    try:
        answer: Any = json.loads(received) if len(received) <= MAX_ANSWER_BYTES else None
    except ValueError:
        answer = None
    if not isinstance(answer, dict) or not isinstance(answer.get("status"), str):
        shown = bytes(received[:200])
        raise OperatorSocketError(f"the server at {path} answered {shown!r}, which is not an answer{_UNKNOWN}")
    return None if answer["status"] == "elsewhere" else answer


_UNKNOWN = "; whether the state was published is unknown: `meridian-node-devserver nodes` shows the generation"
