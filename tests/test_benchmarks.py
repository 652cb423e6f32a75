"""benchmarks/: the shared harness, and every benchmark loads through it (`trace-mega bench NAME`)."""

import json
import math

import pytest

from trace_mega.commands.cli import benchmark_names, load_benchmark
from trace_mega.resources import benchmarks_dir

load_benchmark("allocation_kernel")  # puts benchmarks/ on sys.path, as `trace-mega bench` does
import harness  # noqa: E402


def test_timeit_warms_up_then_reduces():
    calls = []
    ticks = iter([0.0, 1.0, 1.0, 4.0, 4.0, 6.0])  # three timed calls: 1 s, 3 s, 2 s
    harness._CLOCKS["fake"] = lambda: next(ticks)
    try:
        assert harness.timeit(lambda: calls.append(1), reps=3, warmup=2, clock="fake", reduce="median") == 2.0
        assert len(calls) == 5  # 2 warm-up + 3 timed
        ticks = iter([0.0, 1.0, 1.0, 4.0])
        harness._CLOCKS["fake"] = lambda: next(ticks)
        assert harness.timeit(lambda: None, reps=2, warmup=0, clock="fake", reduce="min") == 1.0
    finally:
        del harness._CLOCKS["fake"]
    with pytest.raises(ValueError, match="reduce"):
        harness.timeit(lambda: None, reduce="p99")
    out, sec = harness.timed(lambda: 7)
    assert out == 7 and sec >= 0.0


def test_print_table_aligns_and_marks_missing(capsys):
    harness.print_table(
        [{"name": "a", "x": 1.5}, {"name": "long name"}, {"name": "b", "x": None}],
        [("name", "name", "<"), ("x", "x value", ".2f")],
        title="T",
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "T",
        "name       x value",
        "---------  -------",
        "a             1.50",
        "long name        -",
        "b                -",
    ]


def test_write_json_and_its_off_switch(tmp_path):
    path = tmp_path / "sub" / "r.json"
    assert harness.write_json({"a": 1}, path) == path and json.loads(path.read_text()) == {"a": 1}
    assert harness.write_json({"a": 1}, "") is None


@pytest.mark.parametrize("name", benchmark_names())
def test_every_benchmark_loads_and_has_json_flag(name, capsys):
    assert (benchmarks_dir() / f"bench_{name}.py").is_file()
    module = load_benchmark(name)
    with pytest.raises(SystemExit) as exc:
        module.main(["--help"])
    assert exc.value.code == 0
    assert "--json" in capsys.readouterr().out


def test_unknown_benchmark_names_the_valid_ones():
    with pytest.raises(KeyError, match="valid names: allocation"):
        load_benchmark("nope")


def test_grad_noise_fit_recovers_the_signal_and_the_noise():
    """E|g_B|^2 = |G|^2 + S/B: the least-squares fit on 1/B returns |G|^2 and S of exact means, and
    the bootstrap's intervals hold them for samples spread around those means."""
    module = load_benchmark("grad_noise")
    batches, g2, s = [16, 32, 64, 128], 0.01, 1.6
    assert module.fit(batches, [g2 + s / b for b in batches]) == pytest.approx((g2, s))
    samples = [[(g2 + s / b) * f for f in (0.5, 1.0, 1.5)] for b in batches]
    ci = module.bootstrap(batches, samples, reps=200)
    assert ci["G2"][0] <= g2 <= ci["G2"][1] and ci["S"][0] <= s <= ci["S"][1]
    assert ci["B_simple"][0] <= s / g2 <= ci["B_simple"][1]


def test_prompt_selection_ranks_by_what_each_rule_knows(tmp_path):
    """Level 3 is half solved and half unsolved prompts (its mean, 0.5, looks the most contrasted);
    level 2 succeeds 3 times in 4 on every prompt. Only a rule that sees the distance, or that ranks
    by the share of contrasted groups, takes level 2; the run's kept contrast is read back."""
    module = load_benchmark("prompt_selection")
    tasks = [
        dict(task_id=f"levels-0-{d}-3", group="ice3", rewards=[float(d == 1)] * 8) for d in (1, 2) for _ in range(4)
    ]
    tasks += [dict(task_id=f"levels-0-{d}-2", group="ice2", rewards=[1.0, 1.0, 1.0, 0.0] * 2) for d in (1, 2, 3, 4)]
    run = tmp_path / "arm" / "seed0"
    (run / "eval").mkdir(parents=True)
    (run / "eval" / "step_00000010.json").write_text(json.dumps({"tasks": tasks}))
    (run / "metrics.jsonl").write_text("\n".join(json.dumps({"alloc/contrasted_prompts": c}) for c in (1.0, 3.0)))
    out = module.main(["--runs", str(run), "--measured", str(run), "--pool", "12", "--draws", "400", "--json", ""])
    got = {r["rule"]: r["contrasted"] for r in out["rules"]}
    assert got["level"] == 0.0  # picks the half-solved, half-unsolved level
    assert got["level (contrast)"] == got["level+distance"] == got["own group"] == 4.0
    assert got["uniform"] == pytest.approx(4 * 4 / 12, abs=0.15)
    sampled = {r["rule"]: r["sampled"] for r in out["rules"]}  # accepted with the group's contrast chance
    assert sampled["level (contrast)"] == 4.0  # level 2's share is 1, level 3's is 0
    assert sampled["uniform"] == pytest.approx(got["uniform"], abs=0.15)
    assert sampled["level"] < 2.0 < sampled["level+distance"] < got["level+distance"]  # a coin may pass level 2
    assert out["measured"] == [dict(arm=str(run.parent), runs=1, contrasted=2.0)]
    with pytest.raises(ValueError, match="levels-S-G-L"):
        module.features("walk-1-2-0.9")


def test_learning_per_trajectory_compares_arms_run_apart(tmp_path):
    """Two seeds per arm, an eval every 2 steps: the threshold is uniform's seed-mean final, trajectories
    to it come from the seed-mean curve, and `--kept` moves an arm onto the trajectories it trained on."""
    module = load_benchmark("learning_per_trajectory")

    def write(arm, seed, evals, generated, kept):
        run = tmp_path / arm / f"seed{seed}"
        run.mkdir(parents=True)
        rows = []
        for step, y in enumerate(evals):
            r = {"step": step, "alloc/generated_trajectories": generated, "alloc/trajectories": kept}
            r |= {"alloc/contrasted_prompts": 1.0, "eval/test/reward": y} if y is not None else {}
            rows.append(r | {"alloc/contrasted_prompts": 1.0})
        (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))

    for seed, final in enumerate((0.5, 0.7)):  # uniform: threshold 0.6, reached at its last eval (64 trajectories)
        write("uniform", seed, [None, 0.2, None, 0.4, None, final - 0.1, None, final], 8, 8)
    for seed in range(2):  # the other arm: 0.6 after 4 steps, but it generated 4x what it kept
        write("ceiling", seed, [None, 0.3, None, 0.6, None, 0.6, None, 0.6], 32, 8)
    argv = ["--arm", f"uniform={tmp_path}/uniform/seed*", "--arm", f"ceiling={tmp_path}/ceiling/seed*", "--json", ""]
    out = module.main(argv)
    rows = {r["arm"]: r for r in out["rows"]}
    assert out["threshold"] == pytest.approx(0.6)
    assert rows["uniform"]["to"] == 64 and rows["uniform"]["per_seed"] == "never / 48"
    assert rows["ceiling"]["to"] == 128 and rows["ceiling"]["ratio"] == pytest.approx(2.0)
    # A draw of uniform's seed 1 twice (a quarter of them) sets the bar at 0.7, which the ceiling never reaches.
    assert rows["ceiling"]["interval"] == "[2.00, never]"
    out = module.main(argv + ["--kept", "ceiling", "--versus", "uniform/ceiling"])
    rows = {r["arm"]: r for r in out["rows"]}
    assert rows["ceiling (kept)"]["to"] == 32 and rows["ceiling (kept)"]["ratio"] == pytest.approx(0.5)
    assert out["versus"] == [dict(pair="uniform / ceiling", ratio=2.0, interval="[0.00, 2.00]")]
    with pytest.raises(SystemExit, match="not given: dapo"):
        module.main(argv + ["--versus", "dapo/uniform"])


def test_contrast_per_group_counts_a_level_a_step_holds_nowhere_as_zero(tmp_path):
    """Runs without evaluation still give the per-group tables: contrasted prompts a step from `--from-step`
    on, a step without the group counting 0, then the seed mean; and the contrasted share of the prompts the
    steps held in each group, per seed, then the seed mean (a seed that never held a group leaves it out)."""
    module = load_benchmark("learning_per_trajectory")
    for seed, late in enumerate((2.0, 4.0)):
        run = tmp_path / "trace" / f"seed{seed}"
        run.mkdir(parents=True)
        rows = [{"step": 0, "alloc/contrasted_prompts": 9.0, "alloc/group/ice0/contrasted_prompts": 9.0,
                 "alloc/group/ice0/prompts": 9.0}]  # fmt: skip
        rows.append({"step": 1, "alloc/contrasted_prompts": late, "alloc/group/ice9/contrasted_prompts": late,
                     "alloc/group/ice9/prompts": 4.0})  # fmt: skip
        rows.append({"step": 2, "alloc/contrasted_prompts": 1.0, "alloc/group/ice0/contrasted_prompts": 1.0,
                     "alloc/group/ice0/prompts": 2.0 + 2.0 * seed})  # fmt: skip
        (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    old = tmp_path / "trace" / "seed2"  # a run from before the per-group counts: left out, not counted as 0
    old.mkdir(parents=True)
    (old / "metrics.jsonl").write_text(json.dumps({"step": 1, "alloc/contrasted_prompts": 3.0}))
    out = module.main(["--arm", f"trace={tmp_path}/trace/seed*", "--from-step", "1", "--json", ""])
    # seed 0: ice0 (0 + 1) / 2, ice9 2 / 2; seed 1: ice0 0.5, ice9 2; step 0 is before --from-step
    assert out["contrasted_per_group"] == {"trace": {"ice0": 0.5, "ice9": 1.5}}
    # ice0: 1 of 2 prompts (seed 0), 1 of 4 (seed 1); ice9: 2 of 4, 4 of 4
    assert out["contrasted_share_per_group"] == {"trace": {"ice0": pytest.approx(0.375), "ice9": pytest.approx(0.75)}}
    assert out["threshold"] is None and out["rows"][0]["to"] is None


def test_ceiling_is_each_levels_exact_best_success_on_the_split_and_headroom_what_is_left(tmp_path):
    """A two-level walk (dry, ice 5) of 4 cells, 3 turns: the greedy ceiling per level over the test tasks,
    and an arm's headroom = ceiling - its seed-mean last eval of that level."""
    from trace_mega.config import TrainConfig, load_yaml, save_yaml
    from trace_mega.envs.synthetic_levels import SyntheticLevelsEnv

    module = load_benchmark("learning_per_trajectory")
    options = dict(width=4, max_distance=2, levels=[0, 5], test_fraction=0.5, split_seed=0)
    cfg = load_yaml(TrainConfig, "configs/demo_headroom_b16_cpu.yaml", ["rollout.max_turns=3"])
    cfg.env.options = options
    env = SyntheticLevelsEnv(**options)
    want = {}
    for t in env.tasks("test"):
        want.setdefault(t.meta["benchmark"], []).append(SyntheticLevelsEnv.greedy_success(t, 3))
    assert set(want) == {"ice0", "ice5"}
    for seed in range(2):
        run = tmp_path / "uniform" / f"seed{seed}"
        save_yaml(cfg, run / "config.yaml")
        rows = [{"step": 9, "alloc/generated_trajectories": 16, "alloc/contrasted_prompts": 1.0,
                 "eval/test/reward": 0.5, "eval/test/ice0/mean@8": 0.9, "eval/test/ice5/mean@8": 0.1 + 0.2 * seed}]  # fmt: skip
        (run / "metrics.jsonl").write_text(json.dumps(rows[0]))
    out = module.main(["--arm", f"uniform={tmp_path}/uniform/seed*", "--ceiling", "--json", ""])
    assert out["ceiling"] == {g: pytest.approx(sum(v) / len(v)) for g, v in want.items()}
    assert out["ceiling"]["ice0"] == pytest.approx(1.0) and out["ceiling"]["ice5"] < 1.0
    assert out["forgetting"]["uniform"]["ice5"][1] == pytest.approx(0.2)  # the last eval the headroom reads


def test_bootstrap_interval_resamples_the_seeds_of_every_arm_alike():
    """Two seeds: trace's seed 0 reaches uniform's final after 10 trajectories, its seed 1 after 30, uniform
    after 40. A draw of seed 0 twice (a quarter of them) gives 0.25; every other draw 0.75. An arm that
    never gets there is infinitely slow, and any arm against it infinitely fast."""
    module = load_benchmark("learning_per_trajectory")
    xs = (10, 20, 30, 40)
    curves = {
        "uniform": [[[x, y] for x, y in zip(xs, ys)] for ys in ((0.1, 0.2, 0.3, 0.6), (0.1, 0.3, 0.5, 0.6))],
        "trace": [[[x, y] for x, y in zip(xs, ys)] for ys in ((0.6, 0.6, 0.6, 0.6), (0.2, 0.2, 0.6, 0.6))],
        "slow": [[[x, 0.1] for x in xs]] * 2,
    }
    pairs = [("trace", "uniform"), ("slow", "uniform"), ("trace", "slow")]
    out = module.bootstrap_ratios(curves, pairs, None, draws=400)
    assert out[("trace", "uniform")] == (0.25, 0.75)
    assert out[("slow", "uniform")] == (math.inf, math.inf) and out[("trace", "slow")] == (0.0, 0.0)
    assert module._interval(out[("slow", "uniform")]) == "[never, never]"
    fixed = module.bootstrap_ratios(curves, [("trace", "uniform")], 0.6, draws=400)  # the same bar, given
    assert fixed == {("trace", "uniform"): (0.25, 0.75)}


def test_answer_offsets_count_each_turn_at_its_cell_relative_to_the_goal():
    """Start 5, goal 2 (leftwards): a path that answers on the goal, one that answers a cell short, and one
    that passes the goal, comes back and answers on it. A slip ("at" the same cell) stays at its offset."""
    from types import SimpleNamespace

    from trace_mega.rollout.tree import Node, RolloutTree

    module = load_benchmark("answer_decision")

    def turn(kind, obs=""):
        return Node(0, [1], [1], [0.0], kind=kind, observation=obs)

    tree = RolloutTree("levels-5-2-0", [1])
    tree.add_path(0, [turn("tool", "at 4"), turn("tool", "at 3"), turn("tool", "at 2"), turn("final")], 1.0)
    tree.add_path(0, [turn("tool", "at 4"), turn("tool", "at 4"), turn("tool", "at 3"), turn("final")], 0.0)
    tree.add_path(0, [turn("tool", "at 4"), turn("tool", "at 3"), turn("tool", "at 2"), turn("tool", "at 1"),
                      turn("tool", "at 2"), turn("final")], 1.0)  # fmt: skip
    answers, turns = module.answer_offsets([tree], [SimpleNamespace(meta={"start": 5, "goal": 2})])
    assert turns == {-3: 3, -2: 4, -1: 3, 0: 3, 1: 1}
    assert answers == {0: 2, -1: 1}


def test_largest_fall_is_the_deepest_drop_between_consecutive_evals():
    module = load_benchmark("learning_per_trajectory")
    assert module.largest_fall([(8, 0.5), (16, 0.3), (24, 0.6), (32, 0.45)]) == pytest.approx(0.2)
    assert module.largest_fall([(8, 0.1), (16, 0.2)]) == 0.0 and module.largest_fall([]) == 0.0


def test_learning_per_trajectory_reports_forgetting_per_level(tmp_path):
    """Per eval group: the seed-mean drop from a level's best eval to its last, and the last eval itself."""
    module = load_benchmark("learning_per_trajectory")
    levels = {0: [(0.9, 1.0, 0.8), (0.9, 0.9, 0.9)], 1: [(0.2, 0.4, 0.4), (0.1, 0.3, 0.2)]}  # level -> seeds' evals
    for seed in range(2):
        run = tmp_path / "uniform" / f"seed{seed}"
        run.mkdir(parents=True)
        rows = []
        for step in range(3):
            r = {"step": step, "alloc/generated_trajectories": 4, "alloc/contrasted_prompts": 1.0}
            r |= {"eval/test/reward": 0.5, "eval/test/macro/mean@8": 0.5}
            r |= {f"eval/test/ice{k}/mean@8": levels[k][seed][step] for k in levels}
            rows.append(r)
        (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    out = module.main(["--arm", f"uniform={tmp_path}/uniform/seed*", "--json", ""])["forgetting"]["uniform"]
    assert set(out) == {"ice0", "ice1"}  # the macro average is not a level
    assert out["ice0"] == pytest.approx([(0.2 + 0.0) / 2, (0.8 + 0.9) / 2])
    assert out["ice1"] == pytest.approx([(0.0 + 0.1) / 2, (0.4 + 0.2) / 2])
