"""`asyncrl check` looks outside the schema: model folder, data files and columns, reward import path,
checkpoint, placement. Each rejection names the key and the reason and exits 2."""

from __future__ import annotations

import pytest

from asyncrl.cli import main
from asyncrl.controller.preflight import Resources, preflight
from asyncrl.config import load_config
from asyncrl.envs.data import write_verl_parquet

GOOD_ROW = {"data_source": "d", "prompt": [{"role": "user", "content": "1+1="}], "reward_model": {"ground_truth": "2"}}


def _check(capsys, *overrides: str) -> tuple[int, str]:
    code = main(["check", *overrides])
    return code, capsys.readouterr().err


def test_the_default_recipe_passes(capsys):
    assert _check(capsys) == (0, "")


def test_a_missing_model_folder_is_rejected_naming_model_path(capsys, tmp_path):
    code, err = _check(capsys, f"model.path={tmp_path / 'nope'}")
    assert code == 2 and f"model.path: {tmp_path / 'nope'} does not exist" in err


def test_a_folder_without_config_json_is_not_a_model(capsys, tmp_path):
    code, err = _check(capsys, f"model.path={tmp_path}")
    assert code == 2 and "model.path" in err and "no config.json" in err


def test_a_missing_data_file_is_rejected_naming_the_key(capsys, tmp_path):
    code, err = _check(capsys, "data.task=parquet", f"data.train_path={tmp_path / 'train.parquet'}")
    assert code == 2 and "data.train_path" in err and "does not exist" in err


def test_a_missing_column_is_rejected_naming_the_column(capsys, tmp_path):
    write_verl_parquet([{"data_source": "d", "prompt": GOOD_ROW["prompt"]}], tmp_path / "t.parquet")
    code, err = _check(capsys, "data.task=parquet", f"data.train_path={tmp_path / 't.parquet'}")
    assert code == 2 and "data.train_path" in err and "['reward_model']" in err


def test_a_wrongly_nested_prompt_is_rejected_naming_the_row(capsys, tmp_path):
    rows = [GOOD_ROW, {**GOOD_ROW, "prompt": []}]
    write_verl_parquet(rows, tmp_path / "e.parquet")
    write_verl_parquet([GOOD_ROW], tmp_path / "t.parquet")
    code, err = _check(capsys, "data.task=parquet", f"data.train_path={tmp_path / 't.parquet'}", f"data.eval_path={tmp_path / 'e.parquet'}")
    assert code == 2 and "data.eval_path" in err and "row 1" in err and "data.train_path" not in err


def test_an_unimportable_reward_is_rejected_with_the_import_error(capsys):
    code, err = _check(capsys, "env.reward=no_such_module:score")
    assert code == 2 and "env.reward" in err and "No module named 'no_such_module'" in err


def test_a_checkpoint_folder_without_its_marker_is_rejected(capsys, tmp_path):
    code, err = _check(capsys, f"checkpoint.resume_from={tmp_path}")
    assert code == 2 and "checkpoint.resume_from" in err and "not a complete checkpoint" in err


def test_gpus_this_machine_lacks_are_rejected_naming_the_pool(capsys):
    code, err = _check(capsys, "rollout.num_workers=1000", "rollout.num_gpus_per_worker=8")
    assert code == 2
    assert "rollout_pool: the pools need 8000 GPU (rollout_pool 8000 + learner_pool 0)" in err


def test_local_cpus_may_be_oversubscribed_but_a_cluster_is_strict():
    cfg = load_config(None, ["rollout.num_workers=3", "learner.num_ranks=2", "storage.uri=/shared"])  # 5 CPUs
    assert preflight(cfg, Resources("this machine", [{"CPU": 2.0}], cpus_oversubscribe=True)) == []
    problems = preflight(cfg, Resources("the cluster", [{"CPU": 2.0}, {"CPU": 2.0}]))
    assert [str(p) for p in problems] == ["rollout_pool: the pools need 5 CPU (rollout_pool 3 + learner_pool 2); the cluster has 4"]


@pytest.mark.parametrize(("gpus_per_rank", "expected"), [(4, []), (8, ["learner_pool: one unit needs 8 GPU; the largest node of c has 4"])])
def test_one_unit_must_fit_on_one_node(gpus_per_rank, expected):
    cfg = load_config(None, ["learner.num_ranks=1", f"learner.num_gpus_per_rank={gpus_per_rank}", "storage.uri=/shared"])
    nodes = [{"CPU": 16.0, "GPU": 4.0}, {"CPU": 16.0, "GPU": 4.0}]  # 8 GPUs in all, 4 per node
    assert [str(p) for p in preflight(cfg, Resources("c", nodes))] == expected


def test_a_multi_node_cluster_needs_shared_storage_and_paths_every_node_reads():
    cfg = load_config(None, ["model.path=/models/m"])
    nodes = [{"CPU": 4.0}, {"CPU": 4.0}]
    problems = preflight(cfg, Resources("c", nodes, unreadable={"/models/m": ["ab12cd34"]}))
    assert [p.key for p in problems] == ["model.path", "model.path", "storage.uri"]  # missing here, unreadable there, no storage
    assert str(problems[1]) == "model.path: /models/m is not readable on node(s) ab12cd34 of c"
    assert preflight(cfg.model_copy(update={"storage": cfg.storage.model_copy(update={"uri": "/shared"})}), Resources("c", nodes))[1:] == []


def test_check_wants_the_cluster_address_not_the_dashboard_url(capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    code, err = _check(capsys, "--address", "http://127.0.0.1:8265")
    assert code == 2 and "not the dashboard URL" in err
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")  # set for `submit`: placement is left to the cluster
    code, err = _check(capsys, "rollout.num_gpus_per_worker=8")
    assert code == 0 and "placement not checked" in err


def test_the_agent_recipes_pass(capsys):
    for recipe in ("sao_agent", "grpo_agent", "calc_chat", "calc_agents_sdk"):
        assert main(["check", recipe]) == 0, capsys.readouterr().err


@pytest.mark.parametrize(
    "override, key, reason",
    [
        ("env.name=no_such_module:Env", "env.name", "No module named 'no_such_module'"),
        ("env.name=bogus", "env.name", "unknown environment 'bogus'"),
        ("env.kwargs={bogus: 1}", "env.kwargs", "unexpected keyword argument 'bogus'"),
    ],
)
def test_an_environment_that_cannot_be_built_is_rejected_naming_the_key(capsys, override, key, reason):
    code, err = _check(capsys, "env.name=calc", override) if key == "env.kwargs" else _check(capsys, override)
    assert code == 2 and f"{key}: " in err and reason in err


def _model_dir(tmp_path, config: str):
    (tmp_path / "config.json").write_text(config)
    (tmp_path / "tokenizer.json").write_text("{}")
    return f"model.path={tmp_path}"


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ('{"head_dim": 16, "hidden_size": 64, "num_attention_heads": 2}', "head size 16 (head_dim)"),  # head_dim wins
        ('{"hidden_size": 96, "num_attention_heads": 2}', "head size 48 (hidden_size 96 / num_attention_heads 2)"),
        ('{"text_config": {"head_dim": 8}}', "head size 8 (text_config.head_dim)"),
    ],
)
def test_a_head_size_the_cpu_engine_cannot_serve_is_rejected_naming_the_file_and_key(capsys, tmp_path, config, named):
    code, err = _check(capsys, _model_dir(tmp_path, config))
    assert code == 2 and f"model.path: {tmp_path / 'config.json'}: {named} is not one vLLM's CPU attention serves" in err
    assert "Unsupported CPU attention configuration" in err and "rollout.num_gpus_per_worker" in err


@pytest.mark.parametrize("config", ['{"head_dim": 64}', '{"hidden_size": 896, "num_attention_heads": 14}', "{}"])
def test_a_served_or_undeclared_head_size_passes(tmp_path, config):
    cfg = load_config(None, [_model_dir(tmp_path, config)])
    assert [p for p in preflight(cfg, placement=False) if "head size" in p.reason] == []


def test_an_unreadable_config_json_is_named(tmp_path):
    cfg = load_config(None, [_model_dir(tmp_path, "{not json")])
    assert any(str(p).startswith(f"model.path: {tmp_path / 'config.json'} is not readable JSON") for p in preflight(cfg, placement=False))


def test_bfloat16_is_rejected_only_where_the_cpu_build_has_no_bfloat16(monkeypatch):
    from asyncrl.controller import preflight as module
    from asyncrl.rollout.vllm_compat import limits

    assert limits.cpu_dtypes() == ("float32", "bfloat16", "float16") or limits.sys.platform == "darwin"
    monkeypatch.setattr(limits, "cpu_dtypes", lambda: ("float32", "float16"))  # an Apple CPU without FEAT_BF16
    problems = module.preflight(load_config(None, ["model.dtype=bfloat16"]), placement=False)
    assert [str(p) for p in problems] == ["model.dtype: bfloat16 is not a dtype vLLM's CPU build computes in on this machine"]


def test_a_kl_to_the_starting_weights_passes(capsys):
    assert _check(capsys, "algorithm.params={kl_coef: 0.1}") == (0, "")
    assert _check(capsys, "sao", "algorithm.params={kl_in_reward_coef: 0.05}") == (0, "")  # KL in VAPO's rewards


def test_a_reference_that_is_not_a_model_folder_is_rejected_naming_the_key(capsys, tmp_path):
    code, err = _check(capsys, "algorithm.params={kl_coef: 0.1}", f"learner.reference_path={tmp_path / 'nope'}")
    assert code == 2 and f"learner.reference_path: {tmp_path / 'nope'} does not exist or is not a directory" in err
    code, err = _check(capsys, "algorithm.params={kl_coef: 0.1}", f"learner.reference_path={tmp_path}")
    assert code == 2 and f"learner.reference_path: {tmp_path} has no readable config.json" in err


def test_a_reference_must_share_the_policy_vocabulary(tmp_path):
    policy, reference = tmp_path / "policy", tmp_path / "reference"
    policy.mkdir(), reference.mkdir()
    (reference / "config.json").write_text('{"vocab_size": 32}')
    cfg = load_config(None, [_model_dir(policy, '{"vocab_size": 16}'), f"learner.reference_path={reference}"])
    problems = [str(p) for p in preflight(cfg, placement=False) if p.key == "learner.reference_path"]
    assert problems == [
        f"learner.reference_path: {reference / 'config.json'}: vocab_size 32 is not the policy's (16, model.path); "
        "the KL term compares the two models' log-probs of the same tokens"
    ]
    (reference / "config.json").write_text('{"vocab_size": 16}')
    assert [p for p in preflight(cfg, placement=False) if p.key == "learner.reference_path"] == []


def test_the_rank_memory_budget_counts_the_reference_when_the_recipe_has_a_kl_term(tiny_model_dir):
    # tiny-0.3m on one rank: 3.97 MB of train state, plus 0.99 MB of reference weights with kl_coef > 0.
    overrides = [f"model.path={tiny_model_dir}", "learner.rank_memory_gb=0.0045"]
    plain = preflight(load_config(None, overrides), placement=False)
    kl = preflight(load_config(None, [*overrides, "algorithm.params={kl_coef: 0.1}"]), placement=False)
    assert [p for p in plain if p.key == "learner.rank_memory_gb"] == []
    assert [p.key for p in kl if "0.000991 of the reference policy" in p.reason] == ["learner.rank_memory_gb"]
