"""Streamed Parquet datasets (asyncrl.envs.parquet): globbing, per-epoch shuffle, resume position, the prompt-length
filter and duplicate ids, on real Parquet files in tmp_path."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncrl.envs.data import eval_prompts, parquet_stream, train_stream
from asyncrl.models.tokenizer import ASCII_ALPHABET, build_char_tokenizer

TOK = build_char_tokenizer(ASCII_ALPHABET)


def rows(first: int, n: int, text=lambda i: f"{i}+1=") -> list[dict]:
    return [
        {
            "data_source": "d",
            "prompt": [{"role": "user", "content": text(i)}],
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "extra_info": {"index": i},
        }
        for i in range(first, first + n)
    ]


def write(path, table_rows, row_group_size=5):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(table_rows), str(path), row_group_size=row_group_size)


@pytest.fixture
def dataset(tmp_path):
    """60 rows in 3 files of 4 row groups of 5 rows: ids 0..59, file b holds 20..39."""
    for name, first in (("c", 40), ("a", 0), ("b", 20)):
        write(tmp_path / "data" / f"part-{name}.parquet", rows(first, 20))
    return tmp_path / "data"


def draw(stream, n):
    return [int(next(stream).prompt_id) for _ in range(n)]


def test_a_folder_and_a_glob_read_the_same_files_in_path_order(dataset):
    folder = parquet_stream(TOK, str(dataset), seed=0, window=0, max_prompt_tokens=None)
    pattern = parquet_stream(TOK, str(dataset / "part-*.parquet"), seed=0, window=0, max_prompt_tokens=None)
    assert [f.rsplit("/", 1)[1] for f in folder.index.files] == ["part-a.parquet", "part-b.parquet", "part-c.parquet"]
    assert folder.index.files == pattern.index.files and len(folder.index.group_rows) == 12
    assert draw(folder, 61) == [*range(60), 0]  # file order without shuffle, then the next epoch


def test_each_epoch_is_a_seeded_permutation_and_a_different_one_per_epoch_and_seed(dataset):
    one = draw(parquet_stream(TOK, str(dataset), seed=7, window=2, max_prompt_tokens=None), 120)
    again = draw(parquet_stream(TOK, str(dataset), seed=7, window=2, max_prompt_tokens=None), 120)
    other = draw(parquet_stream(TOK, str(dataset), seed=8, window=2, max_prompt_tokens=None), 60)
    assert one == again
    assert sorted(one[:60]) == sorted(one[60:]) == list(range(60))  # every row once per epoch
    assert one[:60] != one[60:] and one[:60] != other and one[:60] != list(range(60))
    # A window of 2 row groups: each run of 10 drawn rows comes from exactly two row groups (ids // 5).
    assert all(len({i // 5 for i in one[at : at + 10]}) == 2 for at in range(0, 120, 10))


def test_a_stream_resumes_at_its_checkpointed_position_across_an_epoch_boundary(dataset):
    stream = parquet_stream(TOK, str(dataset), seed=3, window=2, max_prompt_tokens=None)
    expected = draw(stream, 100)
    first = parquet_stream(TOK, str(dataset), seed=3, window=2, max_prompt_tokens=None)
    draw(first, 47)
    state = first.state_dict()
    assert state == {"epoch": 0, "cursor": 47, "prompts_dropped": 0, "kept_in_epoch": 47, "rows": 60, "files": 3}
    resumed = parquet_stream(TOK, str(dataset), seed=3, window=2, max_prompt_tokens=None)
    resumed.load_state_dict(state)
    assert draw(resumed, 53) == expected[47:]
    assert resumed.epoch == 1 and len(resumed._tables) <= 2  # only the current window's row groups are resident


def test_resuming_on_a_changed_dataset_is_refused(dataset, tmp_path):
    state = parquet_stream(TOK, str(dataset), seed=0, window=2, max_prompt_tokens=None).state_dict()
    write(dataset / "part-d.parquet", rows(60, 5))
    with pytest.raises(ValueError, match="data position is for 60 rows in 3 file.s.; the dataset now has 65 rows in 4"):
        parquet_stream(TOK, str(dataset), seed=0, window=2, max_prompt_tokens=None).load_state_dict(state)


def test_prompts_longer_than_the_limit_are_skipped_and_counted(tmp_path):
    write(tmp_path / "t.parquet", rows(0, 20, text=lambda i: "x" * (4 if i % 4 else 40)))  # ids 0,4,8,12,16 long
    stream = parquet_stream(TOK, str(tmp_path / "t.parquet"), seed=0, window=0, max_prompt_tokens=10)
    assert draw(stream, 15) == [i for i in range(20) if i % 4]
    assert stream.dropped == 5 and stream.state_dict()["prompts_dropped"] == 5
    draw(stream, 1)
    assert stream.dropped == 6  # row 0 of epoch 1 skipped too


def test_a_dataset_of_only_overlong_prompts_is_an_error_not_a_hang(tmp_path):
    write(tmp_path / "t.parquet", rows(0, 3, text=lambda i: "x" * 40))
    stream = parquet_stream(TOK, str(tmp_path / "t.parquet"), seed=0, window=1, max_prompt_tokens=10)
    with pytest.raises(ValueError, match="every one of its 3 prompts is longer than data.max_prompt_tokens .10 tokens"):
        next(stream)


def test_the_default_limit_leaves_rollout_max_tokens_to_answer(tmp_path):
    from asyncrl.config import Config

    write(tmp_path / "t.parquet", rows(0, 4, text=lambda i: "x" * (4 + 10 * i)))  # 4, 14, 24, 34 tokens
    data = {"task": "parquet", "train_path": str(tmp_path / "t.parquet"), "eval_path": str(tmp_path / "t.parquet")}
    cfg = Config.model_validate({"data": {**data, "shuffle_window": 0}, "rollout": {"max_model_len": 40, "max_tokens": 16}})
    assert [p.prompt_id for p in eval_prompts(cfg, TOK)] == ["0", "1", "2"]  # at most 40 - 16 = 24 tokens
    stream = train_stream(cfg, TOK)
    assert draw(stream, 4) == [0, 1, 2, 0] and stream.dropped == 1
    with pytest.raises(ValueError, match=r"data.max_prompt_tokens \(30\) leaves no room .* at most 24"):
        Config.model_validate({"data": {**data, "max_prompt_tokens": 30}, "rollout": {"max_model_len": 40, "max_tokens": 16}})


def test_duplicate_prompt_ids_are_refused_naming_the_id_and_both_rows(dataset):
    write(dataset / "part-d.parquet", rows(0, 3) + rows(50, 2), row_group_size=2)  # ids 0, 1, 2 again; 50, 51 again
    with pytest.raises(ValueError) as error:
        parquet_stream(TOK, str(dataset), seed=0, window=2, max_prompt_tokens=None)
    message = str(error.value)
    assert message.startswith("data.train_path: ") and "5 id(s) repeat" in message
    assert "part-a.parquet: row 0 (row group 0) and at " in message and "part-d.parquet: row 0 (row group 0)" in message


def test_rows_without_an_index_are_numbered_across_the_files(tmp_path):
    for name, first in (("a", 0), ("b", 3)):
        write(tmp_path / f"{name}.parquet", [{k: v for k, v in r.items() if k != "extra_info"} for r in rows(first, 3)])
    stream = parquet_stream(TOK, str(tmp_path / "*.parquet"), seed=0, window=0, max_prompt_tokens=None)
    assert [next(stream).ground_truth for _ in range(6)] == ["1", "2", "3", "4", "5", "6"]
    assert stream.index.where(4) == f"{tmp_path}/b.parquet: row 1 (row group 0)"


@pytest.mark.parametrize(
    ("make", "spec", "error"),
    [
        (lambda d: None, "{d}/nothing-*.parquet", "data.train_path: no file matches the pattern {d}/nothing-*.parquet"),
        (lambda d: d.joinpath("x.txt").write_text("x"), "{d}", "data.train_path: {d} is a folder without *.parquet files"),
        (lambda d: d.joinpath("x.parquet").write_text("x"), "{d}", "data.train_path: {d}/x.parquet is not a readable Parquet file"),
        (lambda d: pq.write_table(pa.table({"prompt": ["q"]}), d / "x.parquet"), "{d}/*",
         "data.train_path: {d}/x.parquet lacks the verl columns ['data_source', 'reward_model']"),
    ],
)
def test_bad_paths_and_files_name_the_pattern_or_file(tmp_path, make, spec, error):
    make(tmp_path)
    with pytest.raises((OSError, ValueError)) as raised:
        parquet_stream(TOK, spec.format(d=tmp_path), seed=0, window=1, max_prompt_tokens=None)
    assert str(raised.value).startswith(error.format(d=tmp_path))


def test_a_bad_row_is_named_by_file_row_and_row_group_when_it_is_drawn(tmp_path):
    bad = rows(0, 8)
    bad[6]["reward_model"] = {"style": "rule"}
    write(tmp_path / "t.parquet", bad, row_group_size=4)
    stream = parquet_stream(TOK, str(tmp_path / "t.parquet"), seed=0, window=0, max_prompt_tokens=None)
    draw(stream, 6)
    with pytest.raises(ValueError, match=r"t.parquet: row 6 \(row group 1\): reward_model.ground_truth is missing"):
        next(stream)


def test_string_ids_are_checked_too_and_an_empty_file_among_several_is_skipped(tmp_path):
    named = [{**r, "extra_info": {"index": f"q{r['extra_info']['index'] % 4}"}} for r in rows(0, 6)]  # q0 q1 q2 q3 q0 q1
    write(tmp_path / "a.parquet", named[:4])
    pq.write_table(pa.Table.from_pylist(named[:1]).slice(0, 0), tmp_path / "b.parquet")  # no rows
    stream = parquet_stream(TOK, str(tmp_path), seed=1, window=1, max_prompt_tokens=None)
    assert sorted(next(stream).prompt_id for _ in range(4)) == ["q0", "q1", "q2", "q3"] and stream.index.num_rows == 4
    write(tmp_path / "c.parquet", named[4:])
    with pytest.raises(ValueError, match=r"duplicate prompt id 'q0' \(extra_info.index\) at .*a.parquet: row 0 .*c.parquet: row 0 .*2 id"):
        parquet_stream(TOK, str(tmp_path), seed=1, window=1, max_prompt_tokens=None)
