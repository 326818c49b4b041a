"""Alembic's entry point for the devserver's migrations: run on the connection ``migrations.upgrade`` hands over.

There is no offline (SQL script) mode and no URL of its own: the store always migrates the database it opens.
"""

from __future__ import annotations

from alembic import context

from meridian_node_agent.devserver.store.schema import METADATA

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError(
        "the devserver's migrations run when meridian-node-devserver opens its database (store.Database), "
        "not from the alembic command line"
    )
context.configure(connection=connection, target_metadata=METADATA)
with context.begin_transaction():
    context.run_migrations()
