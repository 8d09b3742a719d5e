"""Prompt sources: the built-in `add` task and user Parquet files in the verl column layout.

verl layout, one row per prompt:
    data_source: str
    prompt: list[{"role": str, "content": str}]
    reward_model: {"style": str, "ground_truth": str}
    extra_info: {...}            (free-form; `index` is used as the prompt id when present)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl.envs import add, calc
from asyncrl.envs.parquet import ParquetIndex, ParquetPrompts, check_verl_row
from asyncrl.types import Prompt


def encode_messages(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """A conversation's prompt ids: rendered with the tokenizer's chat template and the generation prompt, then
    tokenized without adding special tokens (the template writes them: `<|im_start|>`, `<|begin_of_text|>`...)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def encode_task_text(tokenizer: Any, text: str) -> list[int]:
    """A built-in task's prompt ids: `text` as one user message in the chat format when the tokenizer has a
    chat template (the presets' writes the text as is), else the text itself."""
    if getattr(tokenizer, "chat_template", None):
        return encode_messages(tokenizer, [{"role": "user", "content": text}])
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def add_prompt(tokenizer: Any, a: int, b: int, prompt_id: str) -> Prompt:
    text = add.prompt_text(a, b)
    ids = encode_task_text(tokenizer, text)
    return Prompt(prompt_id=prompt_id, prompt_ids=ids, ground_truth=str(a + b), text=text, data_source="add")


def heldout_add_prompts(tokenizer: Any, n: int = 500, max_operand: int = 999) -> list[Prompt]:
    return [add_prompt(tokenizer, a, b, f"eval-{i}") for i, (a, b) in enumerate(add.heldout_pairs(n, max_operand))]


def add_prompt_stream(tokenizer: Any, seed: int, max_operand: int = 999) -> Iterator[Prompt]:
    for i, (a, b) in enumerate(add.train_pairs(seed, max_operand)):
        yield add_prompt(tokenizer, a, b, f"add-{seed}-{i}")


# ---------------------------------------------------------------------------------------------------
# verl-layout Parquet


def write_verl_parquet(rows: list[dict[str, Any]], path: str | Path) -> None:
    """Write rows with keys data_source, prompt (messages), reward_model, extra_info."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), str(path))


def read_verl_parquet(path: str | Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    table = pq.read_table(str(path))
    missing = {"data_source", "prompt", "reward_model"} - set(table.column_names)
    if missing:
        raise ValueError(f"{path}: missing verl columns {sorted(missing)} (has {table.column_names})")
    rows = table.to_pylist()
    check_verl_rows(rows, path)
    return rows


def check_verl_rows(rows: list[dict[str, Any]], path: str | Path) -> None:
    """Raise naming the file and row unless every row has the nested verl layout."""
    for i, row in enumerate(rows):
        check_verl_row(row, f"{path}: row {i}")


def verl_prompts(tokenizer: Any, path: str | Path) -> list[Prompt]:
    """Every prompt of a dataset (file, folder or glob), in file order: one epoch, nothing filtered."""
    stream = parquet_stream(tokenizer, str(path), seed=0, window=0, max_prompt_tokens=None)
    return [next(stream) for _ in range(stream.index.num_rows)]


def parquet_stream(
    tokenizer: Any, path: str, seed: int, window: int, max_prompt_tokens: int | None, key: str = "data.train_path"
) -> ParquetPrompts:
    """The prompt stream of a Parquet dataset; errors name the config key and the file, row group or row."""
    try:
        index = ParquetIndex.build(path)
    except (OSError, ValueError) as e:
        raise type(e)(f"{key}: {e}") from None
    limit = max_prompt_tokens if max_prompt_tokens is not None else np.iinfo(np.int64).max
    return ParquetPrompts(index, lambda messages: encode_messages(tokenizer, messages), seed, window, int(limit))


def max_prompt_tokens(cfg) -> int:
    """The longest prompt a run keeps: `data.max_prompt_tokens`, by default what leaves `rollout.max_tokens` of
    room to answer in `rollout.max_model_len`."""
    if cfg.data.max_prompt_tokens is not None:
        return int(cfg.data.max_prompt_tokens)
    return int(cfg.rollout.max_model_len - cfg.rollout.max_tokens)


# ---------------------------------------------------------------------------------------------------
# Agent tasks (asyncrl.envs.calc): prompts of the `calc` and `word_problems` environments


def text_prompt(tokenizer: Any, text: str, answer: str, prompt_id: str, task: str) -> Prompt:
    ids = encode_task_text(tokenizer, text)
    return Prompt(prompt_id=prompt_id, prompt_ids=ids, ground_truth=answer, text=text, data_source=task)


def agent_task_stream(tokenizer: Any, task: str, seed: int, operands: int) -> Iterator[Prompt]:
    for i, (text, answer) in enumerate(calc.train_problems(task, seed, operands)):
        yield text_prompt(tokenizer, text, answer, f"{task}-{seed}-{i}", task)


def heldout_agent_prompts(tokenizer: Any, task: str, n: int, operands: int) -> list[Prompt]:
    return [
        text_prompt(tokenizer, t, a, f"eval-{i}", task)
        for i, (t, a) in enumerate(calc.heldout_problems(task, n, operands))
    ]


def train_stream(cfg, tokenizer: Any) -> Iterator[Prompt]:
    """The endless training prompt stream of a config (`data` section). A Parquet dataset repeats epoch after
    epoch (each shuffled, asyncrl.envs.parquet) with the same prompt ids, so per-prompt state (the pass-rate
    curriculum) sees a prompt again."""
    if cfg.data.task == "add":
        return add_prompt_stream(tokenizer, cfg.data.seed, cfg.data.max_operand)
    if cfg.data.task in calc.PROBLEMS:
        return agent_task_stream(tokenizer, cfg.data.task, cfg.data.seed, cfg.data.operands)
    d = cfg.data
    return parquet_stream(tokenizer, d.train_path, d.seed, d.shuffle_window, max_prompt_tokens(cfg))


def eval_prompts(cfg, tokenizer: Any) -> list[Prompt]:
    if cfg.data.task == "add":
        return heldout_add_prompts(tokenizer, cfg.data.eval_prompts, cfg.data.max_operand)
    if cfg.data.task in calc.PROBLEMS:
        return heldout_agent_prompts(tokenizer, cfg.data.task, cfg.data.eval_prompts, cfg.data.operands)
    if not cfg.data.eval_path:
        return []
    stream = parquet_stream(tokenizer, cfg.data.eval_path, 0, 0, max_prompt_tokens(cfg), key="data.eval_path")
    prompts: list[Prompt] = []
    while stream.epoch == 0 and len(prompts) < cfg.data.eval_prompts:
        prompt = next(stream)
        if stream.epoch == 0:  # a prompt after the last long ones dropped comes from the next epoch
            prompts.append(prompt)
    return prompts


def probe_prompt(cfg, tokenizer: Any, stream: Iterator[Prompt]) -> Prompt:
    """The first prompt of a fresh training stream (the parity probe's, when a run has no eval set)."""
    if isinstance(stream, ParquetPrompts):
        return next(stream.fresh())
    return next(train_stream(cfg, tokenizer))
