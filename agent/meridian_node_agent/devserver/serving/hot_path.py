"""The server's answers to a node's steady calls, from memory: what the HTTP handlers call.

``ControlPlane`` is what the control plane does, against the database, for the CLI and for every process; this
is how a ``serve`` process answers the fleet's frequent calls without a database statement each:

* a **heartbeat** renews the lease in ``LeaseTable`` (flushed in one transaction every 0.5 s) and answers with the
  epoch from ``NodeStateCache``: no statement;
* a **desired-state fetch** answers from the cache (a 304 costs no statement) and a **long-poll** parks on
  ``DesiredStateWaiters`` until ``ChangeWatcher`` or an in-process verb wakes its node (a publish; a revocation
  or a re-enrollment, which the certificate's check then refuses) or ends its wait (a fence); its certificate is
  checked again before every answer;
* an **observation** is checked against the cached epoch (a stale one is refused at once), then stored through
  ``ObservationWriter``'s batches, whose upsert checks the epoch again;
* every authenticated call looks its certificate's record up in the cache: a revocation drops it;
* ``GET /v1/serving`` is rebuilt at most once a second (``SERVING_MAX_AGE_S``), or after this server stored an
  observation or learnt of a revocation, however many gateways ask.

Before any of these reads memory, ``fresh`` makes sure no announcement of another process is waiting unread (on
SQLite one ``stat(2)``; see ``change_watcher.py``). The bounds, the costs and what a crash loses are in
docs/PROTOCOL.md ("How the server answers a fleet").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Collection
from datetime import timedelta

from ansible_collections.meridian.node.plugins.module_utils.contracts import (
    CertificateRenewalRequest,
    EnrollmentRequest,
    EnrollmentResponse,
    Lease,
    Observation,
    ServingProjection,
)
from meridian_node_agent.devserver.control.plane import (
    ControlPlane,
    check_observation_node,
    epoch_refusal,
    unknown_node,
)
from meridian_node_agent.devserver.serving.change_watcher import BACKSTOP_S, ChangeWatcher
from meridian_node_agent.devserver.serving.lease_table import DEFAULT_LEASE_FLUSH_S, LeaseTable
from meridian_node_agent.devserver.serving.long_poll import DesiredStateWaiters
from meridian_node_agent.devserver.serving.observation_writer import ObservationWriter
from meridian_node_agent.devserver.serving.state_cache import NodeStateCache
from meridian_node_agent.devserver.store.database import ObservationWrite, PublishedState, UnknownNode

__all__ = ["SERVING_MAX_AGE_S", "HotPath"]

SERVING_MAX_AGE_S = 1.0


class HotPath:
    """The handlers' entry (see the module doc). Building it starts nothing; ``start`` starts the watcher and the two
    writers, ``close`` stops them after writing what they hold."""

    def __init__(
        self,
        control: ControlPlane,
        *,
        lease_flush_s: float = DEFAULT_LEASE_FLUSH_S,
        backstop_s: float = BACKSTOP_S,
        serving_max_age_s: float = SERVING_MAX_AGE_S,
    ) -> None:
        self.control = control
        self.waiters = DesiredStateWaiters()
        self.cache = NodeStateCache(
            control.store,
            on_desired=self.waiters.wake,
            on_certificates=self._certificates_changed,
            on_fenced=self.waiters.end,
        )
        self.leases = LeaseTable(control.store, flush_interval_s=lease_flush_s)
        self.writer = ObservationWriter(control.store, on_flushed=self._serving_changed)
        self.watcher = ChangeWatcher(control.store, control.feed, self.cache, backstop_s=backstop_s)
        self._serving_max_age_s = serving_max_age_s
        self._serving_lock = asyncio.Lock()
        self._serving: tuple[float, ServingProjection] | None = None
        self._serving_stale = False

    def start(self, *, threads: bool = True) -> None:
        """Read every node, its certificates and its desired state once (``NodeStateCache.warm``), and start the
        threads. Without ``threads`` (tests that step each part themselves)
        nothing runs in the background: leases and observations are written by ``leases.flush()`` and
        ``writer.flush()``, announcements applied by ``watcher.step()``."""
        self.control.local = self.cache
        self.watcher.start(thread=threads)
        self.cache.warm()
        if threads:
            self.leases.start()
            self.writer.start()

    def close(self) -> None:
        self.watcher.close()
        self.writer.close()
        self.leases.close()
        if self.control.local is self.cache:
            self.control.local = None

    async def fresh(self) -> None:
        """Apply what another process announced and this one has not read yet, before answering from memory."""
        if self.watcher.behind():
            await asyncio.to_thread(self.watcher.catch_up)

    def authenticate(self, certificate_der: bytes | None, node_id: str | None) -> str:
        return self.control.authenticate(certificate_der, node_id, records=self.cache.certificate)

    def enroll(self, request: EnrollmentRequest, remote_host: str | None) -> EnrollmentResponse:
        return self.control.enroll(request, remote_host)

    def renew_certificate(
        self, certificate_der: bytes | None, node_id: str, request: CertificateRenewalRequest
    ) -> EnrollmentResponse:
        return self.control.renew_certificate(certificate_der, node_id, request, records=self.cache.certificate)

    def heartbeat(self, node_id: str) -> Lease:
        try:
            epoch = self.cache.epoch(node_id)
        except UnknownNode as exc:
            raise unknown_node(node_id) from exc
        lease_for = timedelta(seconds=self.control.settings.lease_s)
        record = self.leases.renew(node_id, epoch, self.control.now(), lease_for)
        return Lease(node_id=node_id, epoch=epoch, expires_at=record.expires_at, renewed_at=record.renewed_at)

    async def desired_state(
        self,
        node_id: str,
        certificate_der: bytes | None,
        known: Collection[str],
        wait_s: float,
        disconnected: Callable[[], Awaitable[object]],
    ) -> PublishedState | None:
        """The node's latest state, waiting up to ``wait_s`` for one whose ETag is not in ``known`` (``*`` matches
        any), until ``disconnected()`` completes (the client left), or until the node's epoch moves up
        (``DesiredStateWaiters.end``), whichever comes first. A revocation or re-enrollment of the node wakes it, and
        the certificate's check refuses it.

        Whatever ends the wait, the answer is decided by one more look, after the last wait: ``certificate_der`` is
        authenticated for ``node_id`` again (``ProtocolError`` 403, as for a new request, if it was revoked or
        superseded meanwhile), then the state is read. Each look is a dict lookup in the cache (for a node it holds: no
        statement).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        stayed = True
        parked = self.waiters.park(node_id)
        try:
            while True:
                parked.rearm()
                self.authenticate(certificate_der, node_id)
                current = self.cache.desired(node_id)
                left_s = deadline - loop.time()
                if not stayed or parked.ended or left_s <= 0 or _new_to(known, current):
                    return current
                stayed = await parked.sleep(left_s, disconnected())
                await self.fresh()
        finally:
            self.waiters.unpark(parked)

    async def observe(self, node_id: str, observation: Observation, remote_host: str) -> None:
        check_observation_node(node_id, observation)
        try:
            epoch = self.cache.epoch(node_id)
            if observation.lease_epoch > epoch:
                # Above what this server knows: another replica may have fenced the node a moment ago.
                epoch = self.cache.current_epoch(node_id)
        except UnknownNode as exc:
            raise unknown_node(node_id) from exc
        if observation.lease_epoch != epoch:
            raise epoch_refusal(node_id, observation.lease_epoch, epoch)
        row = ObservationWrite(
            node_id=node_id,
            lease_epoch=observation.lease_epoch,
            body=observation.model_dump_json().encode("utf-8"),
            received_at=self.control.now(),
            observed_at=observation.observed_at,
            remote_host=remote_host,
        )
        if await self.writer.write(row):
            return
        # The database's fence refused it: the epoch moved under the check above (or the node is gone).
        try:
            epoch = self.cache.current_epoch(node_id)
        except UnknownNode as exc:
            raise unknown_node(node_id) from exc
        raise epoch_refusal(node_id, observation.lease_epoch, epoch)

    async def serving(self) -> ServingProjection:
        """The projection, rebuilt when it is older than ``SERVING_MAX_AGE_S`` or stale, by one caller at a time and
        off the event loop: it reads and parses every node's latest observation (about a second for 5,000 8-GPU
        nodes), which must not stall the fleet's heartbeats."""
        async with self._serving_lock:
            cached = self._serving
            if (
                cached is not None
                and not self._serving_stale
                and time.monotonic() - cached[0] < self._serving_max_age_s
            ):
                return cached[1]
            # Cleared before reading: what changes while it is read marks it stale again.
            self._serving_stale = False
            built_at = time.monotonic()
            projection = await asyncio.to_thread(self.control.serving)
            self._serving = (built_at, projection)
            return projection

    def _certificates_changed(self, node_id: str) -> None:
        # Woken, not ended: each parked request checks its certificate again, and a revoked or superseded one is
        # refused at once; one still valid (the records are also dropped when a refresh first sees a node, as a
        # precaution) parks again rather than answer early.
        self.waiters.wake(node_id)
        self._serving_changed()

    def _serving_changed(self) -> None:
        self._serving_stale = True


def _new_to(known: Collection[str], state: PublishedState | None) -> bool:
    """Whether ``state`` is one the client does not hold (``known``: its ETags, ``*`` for any)."""
    return state is not None and state.etag not in known and "*" not in known
