"""The learned success predictor Ṽψ of TRACE-A, its training targets and calibration."""

from trace_mega.predictor.calibration import Calibration, calibration, plot_reliability
from trace_mega.predictor.guard import SkillGuard
from trace_mega.predictor.memory import PromptMemory
from trace_mega.predictor.model import PREDICTORS, Predictor, PredictorFit, build_predictor
from trace_mega.predictor.targets import PredictorSamples, predictor_samples

__all__ = [
    "SkillGuard",
    "PromptMemory",
    "Calibration",
    "calibration",
    "plot_reliability",
    "PREDICTORS",
    "Predictor",
    "PredictorFit",
    "build_predictor",
    "PredictorSamples",
    "predictor_samples",
]
