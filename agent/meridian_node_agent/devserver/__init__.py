"""``meridian-node-devserver``: the reference control plane for protocol v1 (docs/PROTOCOL.md).

Four rooms, each importing only the ones before it (tests/architecture/test_house_rules.py checks it):

* ``store/``: the database, SQLite or PostgreSQL (``database``: ``Database``, the one door; ``schema``, ``queries``,
  ``backends``, ``errors``; Alembic's ``migrations/``), and ``change_feed``, how a committed change is announced to
  every process on that database.
* ``control/``: what the control plane does, for the HTTP server and the CLI alike (``plane``: ``ControlPlane``;
  ``ca``, certificates; ``files``, key files; ``outbox_import``, an air-gapped node's outbox).
* ``serving/``: ``serve``: the FastAPI handlers (``app``), the fleet's steady calls in front of them
  (``steady_calls``), answered from memory (``hot_path`` with ``lease_table``, ``state_cache``,
  ``observation_writer``, ``long_poll`` and ``change_watcher``), uvicorn with mutual TLS (``server``, ``tls``), the
  ``/openapi.json`` document (``openapi``, ``json_schema``).
* ``cli/``: the command line, one module per verb family, loaded lazily; nothing imports it.
"""
