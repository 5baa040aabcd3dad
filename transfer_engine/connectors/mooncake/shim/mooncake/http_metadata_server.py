"""``mooncake.http_metadata_server``: the project's HTTP metadata server."""

from transfer_engine.connectors.mooncake.metadata import MetadataServer, main

__all__ = ["MetadataServer", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
