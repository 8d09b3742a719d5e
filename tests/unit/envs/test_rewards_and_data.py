import pytest

from asyncrl.envs import add
from asyncrl.envs.data import heldout_add_prompts, read_verl_parquet, verl_prompts, write_verl_parquet
from asyncrl.envs.rewards import exact_match, resolve_reward
from asyncrl.models.tokenizer import ASCII_ALPHABET, build_char_tokenizer


def test_exact_match_needs_the_exact_sum_and_end_of_sequence():
    assert exact_match("579", "579", finish_reason="stop") == 1.0
    assert exact_match("579", "579", finish_reason="length") == 0.0  # no EOS: not an answer
    assert exact_match("578", "579", finish_reason="stop") == 0.0
    assert exact_match("5790", "579", finish_reason="stop") == 0.0


def test_heldout_set_is_fixed_500_pairs_disjoint_from_training():
    held = add.heldout_pairs(500)
    assert len(set(held)) == 500 and held == add.heldout_pairs(500)
    stream = add.train_pairs(seed=0)
    train = {next(stream) for _ in range(20_000)}
    assert not train & set(held)


def test_heldout_prompts_carry_the_sum_as_ground_truth():
    tok = build_char_tokenizer()
    prompts = heldout_add_prompts(tok, 500)
    a, b = add.heldout_pairs(500)[0]
    assert prompts[0].text == f"{a}+{b}=" and prompts[0].ground_truth == str(a + b)
    assert tok.decode(prompts[0].prompt_ids) == prompts[0].text


def test_reward_import_path_resolves_and_bad_names_are_explained():
    assert resolve_reward("asyncrl.envs.rewards:exact_match") is exact_match
    with pytest.raises(ValueError, match="unknown reward 'exact'"):
        resolve_reward("exact")
    with pytest.raises(ValueError, match="cannot import reward 'nope.mod:f'"):
        resolve_reward("nope.mod:f")


def test_verl_parquet_round_trips(tmp_path):
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{i}+1="}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "extra_info": {"index": i, "split": "train"},
        }
        for i in range(5)
    ]
    path = tmp_path / "train.parquet"
    write_verl_parquet(rows, path)
    assert read_verl_parquet(path) == rows
    tok = build_char_tokenizer(ASCII_ALPHABET)
    prompts = verl_prompts(tok, path)
    assert [p.ground_truth for p in prompts] == ["1", "2", "3", "4", "5"]
    assert tok.decode(prompts[2].prompt_ids) == "Be brief.2+1="
    assert prompts[2].prompt_id == "2" and prompts[2].data_source == "openai/gsm8k"


def test_an_unshuffled_parquet_stream_repeats_epochs_in_file_order_with_stable_prompt_ids(tmp_path):
    from asyncrl.config import Config
    from asyncrl.envs.data import train_stream

    rows = [{"data_source": "d", "prompt": [{"role": "user", "content": f"{i}+1="}], "reward_model": {"ground_truth": str(i + 1)}} for i in range(3)]
    write_verl_parquet(rows, tmp_path / "train.parquet")
    cfg = Config.model_validate({"data": {"task": "parquet", "train_path": str(tmp_path / "train.parquet"), "shuffle_window": 0}})
    stream = train_stream(cfg, build_char_tokenizer(ASCII_ALPHABET))
    ids = [next(stream).prompt_id for _ in range(7)]
    assert ids == ["0", "1", "2", "0", "1", "2", "0"]  # 3 rows, epoch 2 and 3 start with the same ids


def test_parquet_without_ground_truth_is_rejected_naming_the_row(tmp_path):
    path = tmp_path / "bad.parquet"
    write_verl_parquet([{"data_source": "x", "prompt": [{"role": "user", "content": "q"}], "reward_model": {"style": "rule"}}], path)
    with pytest.raises(ValueError, match="row 0: reward_model.ground_truth is missing"):
        read_verl_parquet(path)
