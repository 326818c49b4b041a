"""The operator socket of a ``serve`` process: ``DATA_DIR/operator.sock``, where ``publish`` beside it hands the
server its work (``control/operator_wire.py`` says why, and what goes over it).

Runs on: the devserver's ``serve`` process.

The socket is bound under a temporary name, made 0600 and then renamed into place, so that it is never there with
wider permissions; a socket already there that answers belongs to another server on the same data dir (replicas
sharing one), which keeps it; one that does not answer was left by a server that died, and is replaced. Each
connection is served on this module's thread, one at a time: one request read within ``TIMEOUT_S`` and at most
``MAX_REQUEST_BYTES`` (read before any refusal, so that a refused peer still gets its answer), then the peer's
credentials (``SO_PEERCRED``: the server's user or root, else refused), then the same ``ControlPlane.publish`` the
CLI would call. A request for another database
than this server's is answered ``elsewhere``, and the CLI does the work itself. On close the socket is removed if
it is still the one this server made.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import secrets
import socket
import struct
import threading
from pathlib import Path

from meridian_node_agent.devserver.control.operator_wire import (
    MAX_REQUEST_BYTES,
    TIMEOUT_S,
    decode_request,
    encode_answer,
    socket_path,
    unix_address,
)
from meridian_node_agent.devserver.control.plane import ControlPlane, parse_desired_document

__all__ = ["OperatorSocket"]

_log = logging.getLogger("meridian_node_agent.devserver")

# How often the accept loop looks whether it should stop.
_ACCEPT_WAIT_S = 0.25
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
# At most this much of a peer's excess is read and dropped after its answer (4 requests' worth).
_DRAIN_BYTES = 4 * MAX_REQUEST_BYTES


class OperatorSocket:
    """``control``'s operator socket in ``data_dir``; ``database``: the database this server was told to open (None:
    the data dir's SQLite file), compared as given with the one a request names."""

    def __init__(self, control: ControlPlane, data_dir: Path, database: str | None) -> None:
        self._control = control
        self.path = socket_path(data_dir)
        self._database = database
        self._listener: socket.socket | None = None
        self._identity: tuple[int, int] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        """Listen and serve on a thread; False (and a warning) when another server holds the socket."""
        if _answers(self.path):
            _log.warning("operator socket %s is another server's: CLI verbs will reach that one", self.path)
            return False
        scratch = self.path.with_name(f".{self.path.name}.{secrets.token_hex(4)}")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with unix_address(scratch) as address:
                listener.bind(address)
            scratch.chmod(0o600)
            listener.listen(8)
            scratch.replace(self.path)
        except OSError:
            listener.close()
            with contextlib.suppress(OSError):
                scratch.unlink()
            raise
        info = self.path.lstat()
        self._identity = (info.st_dev, info.st_ino)
        listener.settimeout(_ACCEPT_WAIT_S)
        self._listener = listener
        self._thread = threading.Thread(target=self._run, name="devserver-operator-socket", daemon=True)
        self._thread.start()
        return True

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=TIMEOUT_S + 1)
        if self._listener is not None:
            self._listener.close()
        with contextlib.suppress(OSError):
            info = self.path.lstat()
            if (info.st_dev, info.st_ino) == self._identity:
                self.path.unlink()

    def _run(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                connection, _address = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stop.is_set():
                    return
                _log.warning("operator socket %s: accept failed: %s", self.path, exc)
                self._stop.wait(_ACCEPT_WAIT_S)
                continue
            with connection:
                try:
                    connection.settimeout(TIMEOUT_S)
                    answer = self._answer(connection)
                    if answer:
                        connection.sendall(answer)
                        _drain(connection)
                except OSError as exc:
                    _log.warning("operator socket %s: a request was cut off: %s", self.path, exc)

    def _answer(self, connection: socket.socket) -> bytes:
        """The answer to the request on ``connection`` (read first, at most ``MAX_REQUEST_BYTES`` and one more, so
        that a refused peer still reads its answer); empty for a peer that sent nothing."""
        received = bytearray()
        while len(received) <= MAX_REQUEST_BYTES:
            chunk = connection.recv(65536)
            if not chunk:
                break
            received += chunk
        if not received:
            return b""  # a peer that only looked whether a server listens here (another server starting)
        _pid, uid, _gid = _UCRED.unpack(connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        if uid not in (os.geteuid(), 0):
            _log.warning("operator socket %s: refused uid %d", self.path, uid)
            return encode_answer(
                "refused", message=f"uid {uid} may not use this server's operator socket (only uid {os.geteuid()})"
            )
        try:
            request = decode_request(bytes(received))
        except ValueError as exc:
            return encode_answer("refused", message=f"operator socket: {exc}")
        if request.database != self._database:
            return encode_answer("elsewhere")
        try:
            document = parse_desired_document(request.document, request.where)
        except ValueError as exc:
            return encode_answer("usage", message=str(exc))
        try:
            published = self._control.publish(request.node, document, ttl_s=request.ttl_s)
        except ValueError as exc:
            return encode_answer("refused", message=str(exc))
        except Exception as exc:  # noqa: BLE001 - the database failed: the CLI says so, and the server serves on
            _log.warning("operator socket: publishing for node %s failed: %s", request.node, exc)
            return encode_answer("refused", message=f"the server could not publish: {type(exc).__name__}: {exc}")
        _log.info("operator socket: node %s generation %d published", request.node, published.generation)
        return encode_answer(
            "published",
            generation=published.generation,
            lease_epoch=published.lease_epoch,
            envelope=base64.b64encode(published.envelope).decode("ascii"),
        )


def _drain(connection: socket.socket) -> None:
    """Read what the peer still sends after its answer (a request cut at the limit), up to ``_DRAIN_BYTES`` or the
    connection's timeout, so that closing does not reset the connection before the peer has read the answer."""
    with contextlib.suppress(OSError):
        connection.shutdown(socket.SHUT_WR)
        drained = 0
        while drained < _DRAIN_BYTES:
            chunk = connection.recv(65536)
            if not chunk:
                return
            drained += len(chunk)


def _answers(path: Path) -> bool:
    """Whether a server listens on the socket at ``path`` now."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        with unix_address(path) as address:
            probe.connect(address)
    except OSError:
        return False
    finally:
        probe.close()
    return True
