"""Every statement ``database.Database`` runs, built once per ``Database`` with named parameters.

Why built once: making a Core construct (``select(...).where(...)``) and its cache key on every call cost more
than running it. Measured here on a SQLite file, ``latest_desired``: 238 µs a call with the statement built in
the call, 62 µs with it built once (the stdlib ``sqlite3`` query alone: 4 µs). SQLAlchemy then finds the compiled
form in its cache by the statement's identity.

Parameters are named ``b_*`` in UPDATE and INSERT ... SELECT statements: SQLAlchemy keeps a column's own name for
the values of its SET and VALUES clauses. Plain ``insert(table)`` statements take the columns' names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    Delete,
    Insert,
    Select,
    Update,
    bindparam,
    delete,
    func,
    insert,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite

from meridian_node_agent.devserver.store.schema import (
    CHANGE_MARKER_ROW,
    Stamp,
    certificates,
    change_marker,
    desired_states,
    nodes,
    observations,
    tokens,
)

__all__ = ["StoreQueries"]

_LEASE_COLUMNS = (nodes.c.epoch, nodes.c.lease_expires_at, nodes.c.renewed_at)


def _node(column: Any) -> Any:
    return column == bindparam("b_node_id")


@dataclass(frozen=True)
class StoreQueries:
    """The statements, for one backend (``postgresql``: its INSERT ... ON CONFLICT, its change marker)."""

    token_used_by: Select[Any]
    token_delete: Delete
    token_insert: Insert
    token_by_digest: Select[Any]
    token_consume: Update
    node_insert_if_missing: Any  # the backend's INSERT ... ON CONFLICT DO NOTHING
    node_enroll: Update
    node_lock_lease: Select[Any]
    node_lease: Select[Any]
    node_epoch: Select[Any]
    node_epoch_locked: Select[Any]
    node_epochs_locked: Select[Any]
    node_renew_lease: Update
    node_renew_leases: Update
    node_fence: Update
    node_revoke: Update
    certificates_revoke: Update
    certificate_insert: Insert
    certificate_owner: Select[Any]
    certificate: Select[Any]
    last_generation: Select[Any]
    desired_insert: Insert
    latest_desired: Select[Any]
    latest_desired_all: Select[Any]
    valid_certificates: Select[Any]
    observation_upsert: Any  # the backend's fenced INSERT ... SELECT ... ON CONFLICT DO UPDATE
    serving_observations: Select[Any]
    nodes_listing: Select[Any]
    marker_bump: Update
    marker_row_value: Select[Any]
    node_change_seq: Update
    nodes_changed_since: Select[Any]
    last_change_seq: Select[Any]

    @classmethod
    def for_backend(cls, *, postgresql_backend: bool) -> StoreQueries:
        dialect_insert = postgresql.insert if postgresql_backend else sqlite.insert
        return cls(
            token_used_by=select(tokens.c.used_by).where(tokens.c.name == bindparam("b_name")).with_for_update(),
            token_delete=delete(tokens).where(tokens.c.name == bindparam("b_name")),
            token_insert=insert(tokens),
            token_by_digest=select(tokens.c.name, tokens.c.used_at, tokens.c.node_id)
            .where(tokens.c.value_sha256 == bindparam("b_digest"))
            .with_for_update(),
            token_consume=update(tokens)
            .where(tokens.c.name == bindparam("b_name"))
            .values(used_at=bindparam("b_used_at", type_=Stamp()), used_by=bindparam("b_used_by")),
            node_insert_if_missing=dialect_insert(nodes)
            .values(node_id=bindparam("b_node_id"), epoch=1)
            .on_conflict_do_nothing(),
            node_enroll=update(nodes)
            .where(_node(nodes.c.node_id))
            .values(
                enrolled_at=bindparam("b_now", type_=Stamp()),
                revoked_at=None,
                lease_expires_at=bindparam("b_expires_at", type_=Stamp()),
                renewed_at=bindparam("b_now", type_=Stamp()),
            )
            .returning(*_LEASE_COLUMNS),
            node_lock_lease=select(*_LEASE_COLUMNS).where(_node(nodes.c.node_id)).with_for_update(),
            node_lease=select(*_LEASE_COLUMNS).where(_node(nodes.c.node_id)),
            node_epoch=select(nodes.c.epoch).where(_node(nodes.c.node_id)),
            node_epoch_locked=select(nodes.c.epoch).where(_node(nodes.c.node_id)).with_for_update(),
            node_epochs_locked=select(nodes.c.node_id, nodes.c.epoch)
            .where(nodes.c.node_id.in_(bindparam("b_node_ids", expanding=True)))
            .order_by(nodes.c.node_id)
            .with_for_update(read=True),
            node_renew_lease=update(nodes)
            .where(_node(nodes.c.node_id))
            .values(
                lease_expires_at=bindparam("b_expires_at", type_=Stamp()),
                renewed_at=bindparam("b_renewed_at", type_=Stamp()),
            )
            .returning(*_LEASE_COLUMNS),
            node_renew_leases=update(nodes)
            .where(_node(nodes.c.node_id), *_later_renewal(postgresql_backend))
            .values(
                lease_expires_at=bindparam("b_expires_at", type_=Stamp()),
                renewed_at=bindparam("b_renewed_at", type_=Stamp()),
            ),
            node_fence=update(nodes)
            .where(_node(nodes.c.node_id))
            .values(epoch=nodes.c.epoch + 1)
            .returning(nodes.c.epoch),
            node_revoke=update(nodes)
            .where(_node(nodes.c.node_id))
            .values(revoked_at=bindparam("b_now", type_=Stamp()))
            .returning(nodes.c.node_id),
            certificates_revoke=update(certificates)
            .where(_node(certificates.c.node_id), certificates.c.revoked_at.is_(None))
            .values(revoked_at=bindparam("b_now", type_=Stamp()), revoked_reason=bindparam("b_reason")),
            certificate_insert=insert(certificates),
            certificate_owner=select(certificates.c.node_id, certificates.c.revoked_at).where(
                certificates.c.serial == bindparam("b_serial")
            ),
            certificate=select(
                certificates.c.serial,
                certificates.c.node_id,
                certificates.c.not_after,
                certificates.c.revoked_at,
                certificates.c.revoked_reason,
            ).where(certificates.c.serial == bindparam("b_serial")),
            last_generation=select(func.coalesce(func.max(desired_states.c.generation), 0)).where(
                _node(desired_states.c.node_id)
            ),
            desired_insert=insert(desired_states),
            latest_desired=select(
                desired_states.c.generation,
                desired_states.c.lease_epoch,
                desired_states.c.envelope,
                desired_states.c.etag,
            )
            .where(_node(desired_states.c.node_id))
            .order_by(desired_states.c.generation.desc())
            .limit(1),
            latest_desired_all=_latest_desired_all(),
            valid_certificates=select(
                certificates.c.serial,
                certificates.c.node_id,
                certificates.c.not_after,
                certificates.c.revoked_at,
                certificates.c.revoked_reason,
            ).where(certificates.c.revoked_at.is_(None)),
            observation_upsert=_observation_upsert(dialect_insert),
            serving_observations=select(
                observations.c.node_id, observations.c.lease_epoch, observations.c.remote_host, observations.c.body
            )
            .join(nodes, nodes.c.node_id == observations.c.node_id)
            .where(nodes.c.revoked_at.is_(None)),
            nodes_listing=_nodes_listing(),
            marker_bump=update(change_marker)
            .where(change_marker.c.id == CHANGE_MARKER_ROW)
            .values(value=change_marker.c.value + 1),
            marker_row_value=select(change_marker.c.value).where(change_marker.c.id == CHANGE_MARKER_ROW),
            node_change_seq=update(nodes).where(_node(nodes.c.node_id)).values(change_seq=bindparam("b_seq")),
            nodes_changed_since=_nodes_changed_since(),
            last_change_seq=select(func.coalesce(func.max(nodes.c.change_seq), 0)),
        )


def _observation_upsert(dialect_insert: Any) -> Any:
    """Insert or replace a node's observation, only if its epoch is the node's current one (else no row).

    The node's row is share-locked (PostgreSQL) while its epoch is compared, so a concurrent ``fence`` either
    waits for this write or is seen by it. ``b_remote_host`` NULL keeps the address stored for the node (else
    its node id stands in).
    """
    previous = observations.alias("previous")
    kept_host = select(previous.c.remote_host).where(previous.c.node_id == nodes.c.node_id).scalar_subquery()
    source = (
        select(
            nodes.c.node_id,
            nodes.c.epoch,
            bindparam("b_observed_at", type_=Stamp()),
            bindparam("b_received_at", type_=Stamp()),
            func.coalesce(
                bindparam("b_remote_host", type_=observations.c.remote_host.type), kept_host, nodes.c.node_id
            ),
            bindparam("b_body", type_=observations.c.body.type),
        )
        .where(_node(nodes.c.node_id), nodes.c.epoch == bindparam("b_epoch"))
        .with_for_update(read=True)
    )
    columns = ["node_id", "lease_epoch", "observed_at", "received_at", "remote_host", "body"]
    statement = dialect_insert(observations).from_select(columns, source)
    # preserve_rowcount: SQLAlchemy keeps an INSERT's row count only when asked (record_observation reads it).
    return statement.on_conflict_do_update(
        index_elements=[observations.c.node_id],
        set_={name: statement.excluded[name] for name in columns[1:]},
    ).execution_options(preserve_rowcount=True)


def _later_renewal(postgresql_backend: bool) -> list[Any]:
    """PostgreSQL, where replicas share the database: a flush never moves a lease back (a node that moved from one
    replica to another is renewed by both, and the slower flush may carry the older renewal). SQLite has one server,
    whose flushes only carry newer renewals, and its stamps are text that sorts right only at equal precision."""
    if not postgresql_backend:
        return []
    renewed_at = bindparam("b_renewed_at", type_=Stamp())
    return [or_(nodes.c.renewed_at.is_(None), nodes.c.renewed_at < renewed_at)]


def _nodes_changed_since() -> Select[Any]:
    """What a server's cache compares, for the nodes stamped above ``b_seq`` (an index range: usually none)."""
    generation = (
        select(func.max(desired_states.c.generation))
        .where(desired_states.c.node_id == nodes.c.node_id)
        .scalar_subquery()
    )
    return select(
        nodes.c.node_id,
        nodes.c.epoch,
        nodes.c.enrolled_at,
        nodes.c.revoked_at,
        generation.label("generation"),
        nodes.c.change_seq,
    ).where(nodes.c.change_seq > bindparam("b_seq"))


def _latest_desired_all() -> Select[Any]:
    latest = (
        select(desired_states.c.node_id, func.max(desired_states.c.generation).label("generation"))
        .group_by(desired_states.c.node_id)
        .subquery()
    )
    return select(
        desired_states.c.node_id,
        desired_states.c.generation,
        desired_states.c.lease_epoch,
        desired_states.c.envelope,
        desired_states.c.etag,
    ).join(
        latest,
        (latest.c.node_id == desired_states.c.node_id) & (latest.c.generation == desired_states.c.generation),
    )


def _nodes_listing() -> Select[Any]:
    valid_certificates = (
        select(func.count())
        .select_from(certificates)
        .where(certificates.c.node_id == nodes.c.node_id, certificates.c.revoked_at.is_(None))
        .scalar_subquery()
    )
    generation = (
        select(func.max(desired_states.c.generation))
        .where(desired_states.c.node_id == nodes.c.node_id)
        .scalar_subquery()
    )
    observed_at = select(observations.c.observed_at).where(observations.c.node_id == nodes.c.node_id).scalar_subquery()
    return select(
        nodes.c.node_id,
        nodes.c.epoch,
        nodes.c.lease_expires_at,
        nodes.c.enrolled_at,
        nodes.c.revoked_at,
        valid_certificates.label("certs"),
        generation.label("generation"),
        observed_at.label("observed_at"),
    )
