"""The fallback guard pools Brier scores over a window: one noisy step does not flip it."""

import math

import pytest

from trace_mega.predictor import SkillGuard


def _fit(brier, const):
    return {"predictor/brier": brier, "predictor/brier_constant": const, "predictor/skill": 1.0 - brier / const}


def test_one_noisy_step_does_not_flip_a_smoothed_guard_but_does_flip_an_unsmoothed_one():
    smooth, raw = SkillGuard(decay=0.8), SkillGuard(decay=0.0)
    for _ in range(5):  # clearly better than the constant
        for g in (smooth, raw):
            g.update(_fit(0.10, 0.20))
    assert not smooth.fallback and not raw.fallback
    # A step whose targets are nearly all equal: the constant's Brier is tiny, one-step skill is -4.
    for g in (smooth, raw):
        g.update(_fit(0.010, 0.002))
    assert raw.fallback and not smooth.fallback
    assert smooth.skill == pytest.approx(1 - (0.8 * 0.10 + 0.2 * 0.010) / (0.8 * 0.20 + 0.2 * 0.002))


def test_unmeasured_or_persistently_worse_predictor_falls_back_and_recovers():
    g = SkillGuard(decay=0.5)
    assert g.fallback and math.isnan(g.skill)  # not measured yet: not trusted yet
    g.update({"predictor/brier": 0.3, "predictor/brier_constant": 0.1, "predictor/skill": float("nan")})
    assert math.isnan(g.skill) and g.fallback  # the first fit has no held-out constant: skipped
    g.update(_fit(0.3, 0.2))
    assert g.fallback  # the first measurement initialises the window
    steps = 0
    while g.fallback:
        g.update(_fit(0.1, 0.2))
        steps += 1
    assert steps == 1 and g.skill == pytest.approx(0.0)  # pooled Brier 0.5*0.3 + 0.5*0.1 = 0.2: no longer worse
    g2 = SkillGuard(decay=0.5, enabled=False)
    g2.update(_fit(0.3, 0.2))
    assert not g2.fallback


def test_guard_state_round_trips():
    g = SkillGuard(decay=0.8)
    g.update(_fit(0.1, 0.2))
    h = SkillGuard(decay=0.8)
    h.load_state_dict(g.state_dict())
    assert h.skill == g.skill and h.fallback == g.fallback
