"""The devserver's schema migrations (Alembic), run by ``database.Database`` when it opens a database.

Users need no ``alembic.ini``: ``upgrade`` points Alembic at this package (``env.py``, ``versions/``) and hands it
the caller's connection, inside the caller's transaction. ``database.Database`` holds that transaction with the
write lock taken first (SQLite: ``BEGIN IMMEDIATE``; PostgreSQL: a transaction-scoped advisory lock), so two
processes opening the same database at once migrate it once: the second finds it at the head.

``HEAD`` is the newest revision. A database already there is opened without importing Alembic at all (one
``SELECT`` of ``alembic_version``): importing it costs about 0.15 s, measured on every CLI verb's start here.
``tests/devserver/test_store_backends.py`` checks that ``HEAD`` is the versions' head.

Databases from before Alembic (tables made by the devserver's old ``CREATE TABLE IF NOT EXISTS`` script, no
``alembic_version``) are adopted by the first revision itself: ``r0001`` creates the tables that are missing and
adds the columns the old code added on open (``tokens.node_id``, ``certificates.revoked_reason``), so an empty
database and an old one arrive at the same schema by the same path. A database at a revision this package does not
know (a newer devserver migrated it) is refused and left as it is.

A new revision: a file in ``versions/`` (copy the newest one), ``down_revision`` the previous ``revision``, DDL
through ``alembic.op`` that runs on SQLite and PostgreSQL alike (SQLite alters a table only by adding a column:
use ``op.batch_alter_table`` for the rest), and ``HEAD`` moved to it.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Connection

from meridian_node_agent.devserver.store.errors import DatabaseUnavailable

__all__ = ["HEAD", "upgrade"]

HEAD = "0003"
_HERE = Path(__file__).resolve().parent


def upgrade(connection: Connection) -> None:
    """Bring the database on ``connection`` to ``HEAD``, inside the transaction the caller holds (not committed)."""
    from alembic import command
    from alembic.config import Config
    from alembic.migration import MigrationContext
    from alembic.script import ScriptDirectory

    config = Config()
    # A ConfigParser value: '%' would start an interpolation.
    config.set_main_option("script_location", str(_HERE).replace("%", "%%"))
    current = MigrationContext.configure(connection).get_current_revision()
    known = {script.revision for script in ScriptDirectory.from_config(config).walk_revisions()}
    if current is not None and current not in known:
        raise DatabaseUnavailable(
            f"the database's schema is at revision {current!r}, which this devserver does not know (its newest is "
            f"{HEAD!r}): a newer devserver migrated it; run that version or a newer one against it"
        )
    config.attributes["connection"] = connection
    command.upgrade(config, "head")
