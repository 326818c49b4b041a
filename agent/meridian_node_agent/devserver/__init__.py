"""``meridian-node-devserver``: the reference control plane for protocol v1 (docs/PROTOCOL.md).

Modules, each with one job: ``ca`` (certificates), ``store`` (the database: SQLite or PostgreSQL, with
``store_schema``, ``store_queries``, ``store_engine``, ``store_errors`` and Alembic's ``migrations``), ``control``
(what the control plane does, shared by HTTP and CLI), ``hot_path`` (how ``serve`` answers a node's steady calls from
memory: ``lease_table``, ``state_cache``, ``observation_writer``, ``long_poll``, and ``change_feed`` with
``change_watcher`` for other processes' changes), ``app`` (FastAPI handlers), ``tls`` (mutual TLS under uvicorn),
``server`` (running uvicorn), ``cli`` (the command line), ``files`` (private key files), ``openapi`` (the
``/openapi.json`` document), ``json_schema`` (the contract models' JSON Schemas, for it and contracts/v1).
"""
