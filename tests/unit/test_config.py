from pathlib import Path

import pytest
import yaml

from asyncrl.config import DEFAULT_CONFIG, RECIPES, ConfigError, load_config

BAD = Path(__file__).parent.parent / "assets" / "bad_configs"


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    cfg = load_config(path)
    assert cfg.mode in ("sync", "streaming", "sao")


def test_default_config_is_streaming_add_with_one_engine_and_one_rank():
    cfg = load_config()
    assert (cfg.mode, cfg.data.task, cfg.rollout.num_workers, cfg.learner.num_ranks) == ("streaming", "add", 1, 1)
    assert cfg.algorithm.resolved_names() == {"advantage": "batch_norm", "loss": "cispo", "reduction": "prompt_mean", "correction": "tis"}


@pytest.mark.parametrize(
    "name, expected",
    [
        ("typo_section.yaml", ["unknown key 'lerner'", "did you mean 'learner'", "typo_section.yaml"]),
        ("typo_key.yaml", ["unknown key 'rollout.samples_per_promt'", "did you mean 'samples_per_prompt'", "typo_key.yaml"]),
        ("out_of_range.yaml", ["rollout.temperature", "greater than 0", "out_of_range.yaml"]),
        ("group_size_one.yaml", ["advantage 'grpo' needs a group", "samples_per_prompt >= 2"]),
        ("unknown_loss.yaml", ["unknown loss 'cipso'", "did you mean 'cispo'", "valid: ppo, cispo"]),
        ("sync_with_staleness.yaml", ["max_staleness must be 0", "got 3"]),
        ("bad_mode.yaml", ["mode", "'sync', 'streaming' or 'sao'"]),
    ],
)
def test_bad_configs_fail_with_the_key_the_file_and_a_hint(name, expected):
    with pytest.raises(ConfigError) as err:
        load_config(BAD / name)
    for text in expected:
        assert text in str(err.value)


def test_overrides_apply_with_yaml_typed_values():
    cfg = load_config(None, ["learner.lr=3e-4", "rollout.samples_per_prompt=4", "buffer.filter_zero_variance=false", "algorithm.params.cispo_eps_max=4"])
    assert cfg.learner.lr == pytest.approx(3e-4)
    assert cfg.rollout.samples_per_prompt == 4
    assert cfg.buffer.filter_zero_variance is False
    assert cfg.algorithm.params == {"cispo_eps_max": 4}


def test_unknown_override_names_the_override_and_the_closest_key():
    with pytest.raises(ConfigError, match=r"override 'buffer.max_stalenes=2': unknown key 'buffer.max_stalenes' \(did you mean 'max_staleness'\?\)"):
        load_config(None, ["buffer.max_stalenes=2"])


def test_missing_file_is_named():
    with pytest.raises(ConfigError, match="config file not found: /nonexistent.yaml"):
        load_config("/nonexistent.yaml")


def test_resolved_config_round_trips_through_the_saved_yaml(tmp_path):
    cfg = load_config(None, ["learner.max_steps=7"])
    saved = cfg.save(tmp_path)
    again = load_config(saved)
    assert again == cfg
    assert yaml.safe_load(saved.read_text())["learner"]["max_steps"] == 7


def test_every_field_has_a_docstring():
    from pydantic import BaseModel

    from asyncrl.config import Config

    def walk(model: type[BaseModel], prefix=""):
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                yield from walk(ann, f"{prefix}{name}.")
            else:
                yield f"{prefix}{name}", field.description

    missing = [name for name, doc in walk(Config) if not doc]
    assert missing == []
    assert DEFAULT_CONFIG.exists()


def test_check_rejects_a_param_the_chosen_components_do_not_take(capsys):
    from asyncrl.cli import main

    assert main(["check", str(RECIPES / "scalerl.yaml"), "algorithm.params.foo=1"]) == 2
    err = capsys.readouterr().err
    assert "scalerl.yaml" in err
    assert "parameter 'foo' is not taken by the chosen advantage 'batch_norm', loss 'cispo', reduction 'prompt_mean', correction 'none'" in err
    assert "valid params: batch_norm_eps, cispo_eps_max, eps_low, eps_high, kl_coef" in err


def test_params_of_an_overridden_component_follow_the_override():
    with pytest.raises(ConfigError, match="parameter 'dual_clip_c' is not taken"):
        load_config(None, ["algorithm.params.dual_clip_c=3"])  # default: cispo
    assert load_config(None, ["algorithm.loss=ppo", "algorithm.params.dual_clip_c=3"]).algorithm.params == {"dual_clip_c": 3}
    with pytest.raises(ConfigError, match="tis_cap must be > 0"):
        load_config(None, ["algorithm.params.tis_cap=0"])


def test_cispo_band_needs_its_cap_switched_off_explicitly():
    with pytest.raises(ConfigError, match="caps its IS weight at cispo_eps_max"):
        load_config(None, ["algorithm.params.eps_high=0.3"])
    cfg = load_config(None, ["algorithm.params.eps_high=0.3", "algorithm.params.cispo_eps_max=null"])
    assert cfg.algorithm.params == {"eps_high": 0.3, "cispo_eps_max": None}


def test_preset_filters_are_buffer_defaults_that_explicit_values_override():
    scalerl = ["algorithm.preset=scalerl", "algorithm.correction=null"]
    assert load_config(None, scalerl).buffer.pass_rate_curriculum is True
    assert load_config(None, [*scalerl, "buffer.pass_rate_curriculum=false"]).buffer.pass_rate_curriculum is False
    assert load_config(None, ["algorithm.preset=grpo"]).buffer.pass_rate_curriculum is False
    assert load_config(None, ["algorithm.preset=dapo", "buffer.filter_zero_variance=false"]).buffer.filter_zero_variance is False


def test_preset_filter_fields_document_the_presets_that_set_them():
    from asyncrl.algo.registry import PRESET_FILTERS
    from asyncrl.config import BufferConfig

    for preset, filters in PRESET_FILTERS.items():
        for key in filters:
            assert f"`{preset}`" in BufferConfig.model_fields[key].description, (preset, key)


def test_mini_batches_must_split_the_prompt_groups_evenly():
    cfg = load_config(None, ["learner.prompts_per_step=8", "learner.mini_batches=4", "learner.epochs=2", "learner.kl_stop=0.05"])
    assert (cfg.learner.mini_batches, cfg.learner.epochs, cfg.learner.kl_stop) == (4, 2, 0.05)
    assert (load_config().learner.mini_batches, load_config().learner.epochs, load_config().learner.kl_stop) == (1, 1, None)
    with pytest.raises(ConfigError, match=r"learner.prompts_per_step \(8\) must split into learner.mini_batches \(3\)"):
        load_config(None, ["learner.prompts_per_step=8", "learner.mini_batches=3"])
    with pytest.raises(ConfigError, match="learner.kl_stop"):
        load_config(None, ["learner.kl_stop=0"])


def test_engines_abort_stale_requests_only_under_the_drop_policy():
    assert load_config(None, ["buffer.max_staleness=3"]).buffer.abort_after_lag is None  # default `wait` aborts nothing
    assert load_config(None, ["buffer.max_staleness=3", "buffer.stale_policy=drop"]).buffer.abort_after_lag == 3
    off = ["buffer.max_staleness=3", "buffer.stale_policy=drop", "buffer.abort_stale_in_flight=false"]
    assert load_config(None, off).buffer.abort_after_lag is None
    with pytest.raises(ConfigError):
        load_config(None, ["buffer.stale_policy=late"])
