import torch

from trace_mega.predictor.calibration import calibration, plot_reliability


def test_perfect_and_constant_predictors():
    t = torch.tensor([0.0, 1.0, 1.0, 0.0, 0.5])
    perfect = calibration(t.clone(), t)
    assert perfect.brier == 0 and perfect.ece == 0 and perfect.skill == 1.0
    const = calibration(torch.full_like(t, t.mean().item()), t)
    assert abs(const.brier - const.brier_constant) < 1e-12 and abs(const.skill) < 1e-9


def test_ece_by_hand():
    # Bin [0.2,0.3): preds 0.2, 0.2 targets 0, 1 -> |0.2-0.5|*2; bin [0.9,1]: pred 1.0 target 1 -> 0.
    pred = torch.tensor([0.2, 0.2, 1.0])
    target = torch.tensor([0.0, 1.0, 1.0])
    cal = calibration(pred, target, num_bins=10)
    assert abs(cal.ece - (0.3 * 2) / 3) < 1e-6
    assert cal.bin_count == [2, 1] and abs(cal.bin_accuracy[0] - 0.5) < 1e-12
    assert abs(cal.brier - (0.04 + 0.64 + 0.0) / 3) < 1e-6


def test_reliability_png(tmp_path):
    g = torch.Generator().manual_seed(0)
    p = torch.rand(200, generator=g)
    y = (torch.rand(200, generator=g) < p).float()
    out = plot_reliability(calibration(p, y), tmp_path / "rel.png")
    assert out.stat().st_size > 1000
