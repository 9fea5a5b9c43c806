"""The planner: the layouts MegaStrategy can run for a model on a cluster, with memory and step time
estimated, fastest first. See docs/planner.md."""

from .cluster import Cluster
from .estimate import Candidate
from .search import Ranking, plan

__all__ = ["Cluster", "Candidate", "Ranking", "plan"]
