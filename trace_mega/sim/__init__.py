"""Ground-truth tree-rollout simulator and predictors for allocation studies (TRACE-A).

`TreeSimulator` (martingale prefix values with a U-shaped prompt prior),
`OraclePredictor` / `NoisyPredictor` / `LearnedPredictor`, and
`simulate_step` / `run_allocator` / `summarize` to compare allocators at
equal budget.
"""

from trace_mega.sim.predictors import (
    LearnedPredictor,
    NoisyPredictor,
    OraclePredictor,
    Predictor,
    TrainingData,
    build_predictor,
)
from trace_mega.sim.run import StepResult, run_allocator, simulate_step, summarize
from trace_mega.sim.simulator import Prefixes, Prompts, Rollouts, SimConfig, TreeSimulator

__all__ = [
    "SimConfig",
    "TreeSimulator",
    "Prompts",
    "Rollouts",
    "Prefixes",
    "Predictor",
    "OraclePredictor",
    "NoisyPredictor",
    "LearnedPredictor",
    "TrainingData",
    "build_predictor",
    "StepResult",
    "simulate_step",
    "run_allocator",
    "summarize",
]
