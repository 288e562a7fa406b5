"""Fault-tolerant data parallelism: training goes on with the surviving
replicas when one dies or hangs, and a replacement heals from a live peer.
Opt-in; see docs/FAULT_TOLERANCE.md."""

from ddp_ext.fault_tolerance.link import CoordinatorLost, ReplicaDropped
from ddp_ext.fault_tolerance.formation import StateLost
from ddp_ext.fault_tolerance.replica import Membership, Replica, StepResult

__all__ = ["CoordinatorLost", "Membership", "Replica", "ReplicaDropped", "StateLost", "StepResult"]
