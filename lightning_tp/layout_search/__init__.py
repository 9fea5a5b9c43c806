"""The planner: the layouts MegaStrategy can run for a model on a cluster, with memory and step time
estimated, fastest first. See docs/planner.md."""

from .cluster import Cluster
from .estimate import Candidate
from .search import Ranking, plan


def trace_png(trace, path) -> None:
    """Draw a measured trace (a PipelineTimeline's JSON) to ``path`` as a PNG, a row per rank."""
    from .picture import draw, trace_rows

    draw(trace_rows(trace), path)


__all__ = ["Cluster", "Candidate", "Ranking", "plan", "trace_png"]
