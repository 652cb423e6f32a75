from pathlib import Path

import pytest
import yaml

from trace_mega.config import ConfigError, TrainConfig, load_config, load_yaml, to_dict
from trace_mega.registry import Registry


def test_defaults_round_trip():
    cfg = load_config(TrainConfig, {})
    assert load_config(TrainConfig, to_dict(cfg)) == cfg


def test_unknown_key_names_the_dotted_field():
    with pytest.raises(ConfigError, match=r"^allocation\.budget: unknown key for AllocationConfig"):
        load_config(TrainConfig, {"allocation": {"budget": 3}})
    with pytest.raises(ConfigError, match=r"^stepz: unknown key"):
        load_config(TrainConfig, {"stepz": 3})


@pytest.mark.parametrize(
    "data, pattern",
    [
        ({"steps": "ten"}, r"^steps: expected int"),
        ({"optim": {"lr": "fast"}}, r"^optim\.lr: expected float, got str"),
        ({"steps": True}, r"^steps: expected int, got bool"),
        ({"model": {"params_dtype": "fp8"}}, r"^model\.params_dtype: 'fp8' is not one of"),
        ({"allocation": {"root_rollouts_per_step": 1}}, r"^allocation\.root_rollouts_per_step: 1 is infeasible"),
        ({"allocation": {"group_size": 1}}, r"^allocation\.group_size: must be >= 2"),
        ({"credit": {"epsilon": 0.0}}, r"^credit\.epsilon: must be > 0"),
        ({"rollout": "torch"}, r"^rollout: expected a mapping"),
        ({"env": {"max_tool_calls_per_turn": 0}}, r"^env\.max_tool_calls_per_turn: must be >= 1"),
        ({"loss": {"rollout_reject": "seq_k3"}}, r"^loss\.rollout_reject: 'seq_k3' is not one of"),
        (
            {"loss": {"rollout_reject": "seq_mean_k3", "old_logprobs": "behaviour"}},
            r"^loss\.rollout_reject: weighs the learner",
        ),
        ({"loss": {"rollout_reject_max": 0.0}}, r"^loss\.rollout_reject_max: must be > 0"),
        ({"loss": {"rollout_is_batch_normalize": True}}, r"^loss\.rollout_is_batch_normalize: normalises"),
        (
            {"model": {"moe_replay_probe": True, "moe_routing_replay": "none"}},
            r"^model\.moe_replay_probe: compares replayed with own routing",
        ),
    ],
)
def test_bad_values_fail_at_load_with_the_field(data, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(TrainConfig, data)


def test_int_is_accepted_for_float_fields_and_optional_none():
    cfg = load_config(TrainConfig, {"optim": {"lr": 1}, "allocation": {"continuations_per_prefix_max": None}})
    assert isinstance(cfg.optim.lr, float) and cfg.allocation.continuations_per_prefix_max is None


def test_yaml_with_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"steps": 3, "allocation": {"name": "uniform"}}))
    cfg = load_yaml(TrainConfig, path, ["allocation.name=trace", "optim.lr=1e-2", "env.options.width=4"])
    assert cfg.steps == 3 and cfg.allocation.name == "trace" and cfg.optim.lr == 0.01
    assert cfg.env.options == {"width": 4}
    with pytest.raises(ConfigError, match="expected key=value"):
        load_yaml(TrainConfig, path, ["steps"])


def test_shipped_configs_load():
    from trace_mega.commands.pretrain import PretrainConfig
    from trace_mega.resources import shipped_configs

    on_disk = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))
    assert sorted(p.name for p in shipped_configs().values()) == [p.name for p in on_disk]
    for path in on_disk:  # pretrain_*.yaml are warm-start configs, every other file a training run
        load_yaml(PretrainConfig if path.name.startswith("pretrain_") else TrainConfig, path)
    assert any(p.name.startswith("pretrain_") for p in on_disk)


def test_configs_resolve_by_name_or_path(tmp_path, monkeypatch):
    from trace_mega.resources import resolve_config, shipped_configs

    shipped = shipped_configs()["demo_cpu"]
    monkeypatch.chdir(tmp_path)  # outside the checkout
    assert resolve_config("demo_cpu") == shipped
    assert resolve_config("demo_cpu.yaml") == resolve_config("configs/demo_cpu.yaml") == shipped
    own = tmp_path / "configs" / "demo_cpu.yaml"  # an existing file always wins over the name
    own.parent.mkdir()
    own.write_text("steps: 1\n")
    assert resolve_config("configs/demo_cpu.yaml") == Path("configs/demo_cpu.yaml")
    with pytest.raises(
        FileNotFoundError,
        match="shipped: credit_demo, demo_cpu, demo_headroom_b16_cpu, demo_headroom_cpu, demo_moe_cpu, "
        "pretrain_levels, pretrain_moe, pretrain_search, pretrain_tools, qwen3_14b_multihop, qwen3_30b_a3b_bfcl",
    ):
        resolve_config("demo_gpu")
    with pytest.raises(FileNotFoundError):
        resolve_config("elsewhere/demo_cpu.yaml")


def test_saved_config_loads_back_equal(tmp_path):
    from trace_mega.config import save_yaml

    cfg = load_config(TrainConfig, {"eval": {"ks": [1, 4], "samples_per_task": 4}, "env": {"options": {"width": 3}}})
    assert load_yaml(TrainConfig, save_yaml(cfg, tmp_path / "c.yaml")) == cfg


def test_eval_config_ks():
    assert load_config(TrainConfig, {"eval": {"samples_per_task": 8}}).eval.resolved_ks() == [1, 2, 4, 8]
    assert load_config(TrainConfig, {"eval": {"samples_per_task": 6}}).eval.resolved_ks() == [1, 2, 4, 6]
    assert load_config(TrainConfig, {"eval": {"samples_per_task": 1}}).eval.resolved_ks() == [1]
    with pytest.raises(ConfigError, match=r"^eval\.ks: every k must be in 1\.\.4"):
        load_config(TrainConfig, {"eval": {"samples_per_task": 4, "ks": [1, 8]}})


def test_registry_lists_valid_names_on_error():
    reg: Registry[int] = Registry("widget")
    reg.register("b")(2)
    reg.register("a")(1)
    assert reg.get("a") == 1 and reg.names() == ["a", "b"] and "b" in reg
    with pytest.raises(KeyError, match=r"unknown widget 'c'; valid names: a, b"):
        reg.get("c")
    with pytest.raises(KeyError, match="registered twice"):
        reg.register("a")(3)


@pytest.mark.parametrize(
    "data, pattern",
    [
        (
            {"allocation": {"name": "tracee"}},
            r"^allocation\.name: unknown allocator 'tracee'; valid names: dapo, pcl, trace",
        ),
        ({"loss": {"name": "ppo"}}, r"^loss\.name: unknown loss 'ppo'; valid names: dapo, gspo, ppo_clip_token"),
        (
            {"rollout": {"engine": "sglang"}},
            r"^rollout\.engine: unknown rollout engine 'sglang'; valid names: torch, vllm",
        ),
        ({"env": {"name": "webshop"}}, r"^env\.name: unknown environment 'webshop'; valid names: bfcl_multi_turn"),
        (
            {"env": {"name": "multihop_qa", "options": {"data_path": "x"}}},
            r"^env\.options\.data_path: unknown option of 'multihop_qa'; valid: .*corpus_path",
        ),
    ],
)
def test_registry_names_and_env_options_fail_before_anything_is_built(data, pattern):
    """Names are checked where components are built (config.py imports none of them): the trainer's
    first act, `check_component_names`, names the field and the valid names."""
    from trace_mega.trainer import check_component_names

    cfg = load_config(TrainConfig, data)  # loads: the registries are not config.py's business
    with pytest.raises(ConfigError, match=pattern):
        check_component_names(cfg)


def test_advantage_name_picks_the_outcome_term_at_load():
    with pytest.raises(ConfigError, match=r"^advantage\.name: picks the outcome term"):
        load_config(TrainConfig, {"advantage": {"name": "trace_credit"}})
