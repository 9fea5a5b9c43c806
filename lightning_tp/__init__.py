"""lightning-tp: Megatron-class parallelism for unchanged Lightning projects.

    Trainer(strategy=MegaStrategy(tp=2, sp=True))    # or strategy="mega" after `import lightning_tp`
"""

from lightning.pytorch.strategies import StrategyRegistry

from .checkpoints.files import consolidate
from .checkpoints.export import export
from .experts.load import ExpertLoad
from .explain.estimate import explain
from .mesh import ParallelMesh, build_mesh
from .checkpoints.plain import save_consolidated
from .layout_search import plan
from .trainer.timeline import PipelineTimeline
from .plans import STYLES, Plan, register_plan
from .strategy import MegaStrategy

__version__ = "0.1.0"

if "mega" not in StrategyRegistry:
    MegaStrategy.register_strategies(StrategyRegistry)

__all__ = ["MegaStrategy", "Plan", "STYLES", "register_plan", "consolidate", "save_consolidated", "export",
           "explain", "plan", "PipelineTimeline", "ExpertLoad",
           "ParallelMesh", "build_mesh"]
