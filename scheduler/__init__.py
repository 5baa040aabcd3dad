"""Request routing and traffic policy for prefill/decode fleets.

- :mod:`scheduler.fleet`: the live view of instances (registry events, load reports,
  prefix caches);
- :mod:`scheduler.router`: picks prefill and decode instances per request;
- :mod:`scheduler.policy`: path preference, RDMA/TCP share, circuit breakers;
- :mod:`scheduler.sim`: replays request traces over simulated fleets.
"""

from scheduler.cost import SLO, CostModel
from scheduler.errors import NoInstanceError, SchedulerError, TraceError, UnknownPolicyError
from scheduler.fleet import Fleet
from scheduler.policy import BreakerBoard, BreakerState, CircuitBreaker, PathClass, TrafficPolicy
from scheduler.router import DEFAULT_POLICY, POLICIES, Decision, Request, Router

__all__ = ["SLO", "CostModel", "Fleet", "Router", "Request", "Decision", "POLICIES",
           "DEFAULT_POLICY", "TrafficPolicy", "BreakerBoard", "CircuitBreaker",
           "BreakerState", "PathClass", "SchedulerError", "NoInstanceError",
           "UnknownPolicyError", "TraceError"]
