"""The devserver's SQLite schema before Alembic (its store.py's ``_SCHEMA``), as old devservers left their files:
what the migration and token-binding tests open with today's code."""

from __future__ import annotations

__all__ = ["BEFORE_TOKEN_BINDING", "OLD_TOKENS_TABLE"]

# The tokens table as devservers created it before tokens could be bound to a node (no node_id column).
OLD_TOKENS_TABLE = """
CREATE TABLE IF NOT EXISTS tokens (
    name TEXT PRIMARY KEY,
    value_sha256 TEXT NOT NULL UNIQUE,
    created_at TEXT NOT NULL,
    used_at TEXT,
    used_by TEXT
);
"""

# The whole schema before Alembic, without the two columns it added on open later: tokens.node_id (token binding)
# and certificates.revoked_reason (revocation reasons).
BEFORE_TOKEN_BINDING = (
    OLD_TOKENS_TABLE
    + """
CREATE TABLE IF NOT EXISTS nodes (
    node_id TEXT PRIMARY KEY,
    epoch INTEGER NOT NULL CHECK (epoch >= 1),
    lease_expires_at TEXT,
    renewed_at TEXT,
    enrolled_at TEXT,
    revoked_at TEXT
);
CREATE TABLE IF NOT EXISTS certificates (
    serial TEXT PRIMARY KEY,
    node_id TEXT NOT NULL REFERENCES nodes(node_id),
    issued_at TEXT NOT NULL,
    not_after TEXT NOT NULL,
    revoked_at TEXT
);
CREATE TABLE IF NOT EXISTS desired_states (
    node_id TEXT NOT NULL REFERENCES nodes(node_id),
    generation INTEGER NOT NULL CHECK (generation >= 1),
    lease_epoch INTEGER NOT NULL,
    envelope BLOB NOT NULL,
    etag TEXT NOT NULL,
    published_at TEXT NOT NULL,
    PRIMARY KEY (node_id, generation)
);
CREATE TABLE IF NOT EXISTS observations (
    node_id TEXT PRIMARY KEY REFERENCES nodes(node_id),
    lease_epoch INTEGER NOT NULL,
    observed_at TEXT NOT NULL,
    received_at TEXT NOT NULL,
    remote_host TEXT NOT NULL,
    body TEXT NOT NULL
);
"""
)
