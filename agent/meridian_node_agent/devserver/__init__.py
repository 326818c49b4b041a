"""``meridian-node-devserver``: the reference control plane for protocol v1 (docs/PROTOCOL.md).

Modules, each with one job: ``ca`` (certificates), ``store`` (SQLite), ``control`` (what the control
plane does, shared by HTTP and CLI), ``app`` (FastAPI handlers), ``tls`` (mutual TLS under uvicorn),
``server`` (running uvicorn), ``cli`` (the command line), ``files`` (private key files), ``openapi`` (the
``/openapi.json`` document), ``json_schema`` (the contract models' JSON Schemas, for it and contracts/v1).
"""
