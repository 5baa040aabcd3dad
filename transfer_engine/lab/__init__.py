"""A fleet lab on one machine: network namespaces as hosts, rate-limited veths as NICs.

Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2; :func:`lab_skip_reason` says why
not where it cannot run. Only 198.18.0.0/15 is ever addressed. See :mod:`.fleet`.
"""

from transfer_engine.lab.fleet import Lab, LabConfig, LabHost, LabNic, down
from transfer_engine.lab.netns import LabError, lab_skip_reason

__all__ = ["Lab", "LabConfig", "LabHost", "LabNic", "LabError", "down", "lab_skip_reason"]
