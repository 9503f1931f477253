"""The planner: memory, communication and time model of a run, mesh search, compiler cross-check.

Playbook, "Finding the Best Training Configuration". `python -m meshtrain.plan --help`.
"""

from meshtrain.plan.estimate import Estimate, search
from meshtrain.plan.hardware import GPUS, Gpu, get_gpu
from meshtrain.plan.memory import Step, num_params, param_table

__all__ = ["GPUS", "Estimate", "Gpu", "Step", "get_gpu", "num_params", "param_table", "search"]
