"""``python -m transfer_engine.connectors.mooncake``: the ``te-mooncake`` command."""

from transfer_engine.connectors.mooncake.cli import main

raise SystemExit(main())
