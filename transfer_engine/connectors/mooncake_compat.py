"""Kept for code written against earlier releases: the Mooncake-compatible engine now
lives in :mod:`transfer_engine.connectors.mooncake`."""

from transfer_engine.connectors.mooncake.engine import *  # noqa: F403
from transfer_engine.connectors.mooncake.engine import __all__  # noqa: F401
