"""``mooncake.engine`` on the transfer-engine project (see docs/mooncake.md)."""

from transfer_engine.connectors.mooncake import *  # noqa: F403
from transfer_engine.connectors.mooncake import __all__  # noqa: F401
from transfer_engine.connectors.mooncake.engine import SUPPORT_CUDA  # noqa: F401

SUPPORT_EFA = SUPPORT_HIP = SUPPORT_MNNVL = SUPPORT_MUSA = SUPPORT_INTRA_NVLINK = False
