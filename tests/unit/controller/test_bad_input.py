"""Bad input is rejected before anything starts: each case exits non-zero from `asyncrl check` and from
`asyncrl run`, with a message naming the field, file or row, and `run` writes nothing (no run folder).

The case list is also the source of docs/bad_input.md (input -> message), so the table stays true:
regenerate it with `python -m tests.unit.controller.test_bad_input > docs/bad_input.md`.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncrl.cli import main
from asyncrl.envs.data import write_verl_parquet

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "bad_input.md"
ROW = {"data_source": "d", "prompt": [{"role": "user", "content": "1+1="}], "reward_model": {"ground_truth": "2"}}


@dataclass(frozen=True)
class Case:
    what: str
    """The bad input, as the docs table says it."""
    args: Callable[[Path], list[str]]
    """CLI arguments (recipe and overrides), given a scratch folder for the files the case needs."""
    expect: str
    """A part of the error message (`{tmp}` stands for the scratch folder)."""


def _overrides(*items: str) -> Callable[[Path], list[str]]:
    return lambda tmp: list(items)


def _parquet(rows: list[dict] | pa.Table) -> Callable[[Path], list[str]]:
    def make(tmp: Path) -> list[str]:
        if isinstance(rows, pa.Table):
            pq.write_table(rows, tmp / "train.parquet")
        else:
            write_verl_parquet(rows, tmp / "train.parquet")
        return ["data.task=parquet", f"data.train_path={tmp / 'train.parquet'}"]

    return make


def _file(name: str, data: bytes, *overrides: str) -> Callable[[Path], list[str]]:
    def make(tmp: Path) -> list[str]:
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_bytes(data)
        return [o.format(tmp=tmp) for o in overrides]

    return make


def _model_folder(*files: str, config: str = "{}") -> Callable[[Path], list[str]]:
    def make(tmp: Path) -> list[str]:
        (tmp / "model").mkdir()
        for name in files:
            (tmp / "model" / name).write_text(config if name == "config.json" else "{}")
        return [f"model.path={tmp / 'model'}"]

    return make


def _checkpoint(
    state: str, config: str | None = None, shards: bool = True, megatron: bool = False
) -> Callable[[Path], list[str]]:
    """`<tmp>/old/checkpoints/step-000002` with marker `state`, optionally the shard files (FSDP2's, or `megatron`'s)
    and the run's config."""

    def make(tmp: Path) -> list[str]:
        folder = tmp / "old" / "checkpoints" / "step-000002"
        (folder / "learner").mkdir(parents=True)
        (folder / "learner_state.json").write_text(state)
        if shards:
            (folder / "learner" / ("megatron_tp0.pt" if megatron else ".metadata")).write_bytes(b"x")
            (folder / "learner" / "rank_0.pt").write_bytes(b"x")
        if config is not None:
            (tmp / "old" / "config.yaml").write_text(config)
        return [f"checkpoint.resume_from={folder}"]

    return make


GOOD_STATE = '{"step": 2, "version": 2, "num_ranks": 1}'
NOT_UTF8 = pa.table({
    "data_source": ["d"],
    "prompt": pa.array([[{"role": "user", "content": b"\xff\xfe1+1="}]], pa.list_(pa.struct([("role", pa.string()), ("content", pa.binary())]))),
    "reward_model": [{"ground_truth": "2"}],
})

CASES = [
    Case("wrong type", _overrides("learner.lr=abc"), "learner.lr: Input should be a valid number"),
    Case("negative learning rate", _overrides("learner.lr=-1"), "learner.lr: Input should be greater than 0"),
    Case("learning-rate decay with no steps after the warm-up", _overrides("learner.lr_decay=cosine", "learner.warmup_steps=300"),
         "learner: Value error, lr_decay = 'cosine' decays over the steps after the warm-up: max_steps (240) must exceed warmup_steps (300)"),
    Case("top_p above 1", _overrides("rollout.top_p=1.5"), "rollout.top_p: Input should be less than or equal to 1"),
    Case("list where a number goes", _overrides("learner.max_steps=[1, 2]"), "learner.max_steps: Input should be a valid integer"),
    Case("unknown key", _overrides("learner.lrr=3"), "unknown key 'learner.lrr' (did you mean 'lr'?)"),
    Case("unknown section", _overrides("foo.bar=1"), "unknown key 'foo'"),
    Case("override without =", _overrides("learner.max_steps"), "config file not found: learner.max_steps"),
    Case("unknown mode", _overrides("mode=fast"), "mode: Input should be 'sync', 'streaming' or 'sao'"),
    Case("unknown preset", _overrides("algorithm.preset=grpoo"), "unknown preset 'grpoo' (did you mean 'grpo'?)"),
    Case("unknown loss", _overrides("algorithm.loss=ppo_clipp"), "unknown loss 'ppo_clipp'"),
    Case("a param the chosen loss does not take", _overrides("algorithm.preset=grpo", "algorithm.params={cispo_eps_max: 2}"),
         "parameter 'cispo_eps_max' is not taken by the chosen advantage 'grpo', loss 'ppo'"),
    Case("a param of the wrong type", _overrides("algorithm.params={eps_low: high}"), "eps_low must be float >= 0 or null (got 'high')"),
    Case("sync mode with staleness", _overrides("mode=sync", "buffer.max_staleness=4"), "buffer.max_staleness must be 0 (got 4)"),
    Case("group advantage with one sample", _overrides("rollout.samples_per_prompt=1"), "set rollout.samples_per_prompt >= 2 (got 1)"),
    Case("mini-batches that do not split the step", _overrides("learner.prompts_per_step=5", "learner.mini_batches=2"),
         "learner.prompts_per_step (5) must split into learner.mini_batches (2)"),
    Case("a LoRA target that is not a projection", _overrides("learner.lora.target_modules=[qkv]"),
         "learner.lora.target_modules ['qkv']: unknown ['qkv']; choose among q_proj"),
    Case("LoRA on the megatron backend", _overrides("learner.training_backend=megatron", "learner.compile=false", "learner.lora={}"),
         "learner.training_backend = megatron does not support learner.lora"),
    Case("delta sync with LoRA", _overrides("learner.lora={}", "weight_sync.delta=true"),
         "weight_sync.delta does not apply with learner.lora"),
    Case("an autoscale minimum below the healthy minimum",
         _overrides("rollout.num_workers=2", "rollout.min_healthy_engines=2", "rollout.autoscale={min: 1, max: 2}"),
         "rollout.autoscale.min = 1 is below rollout.min_healthy_engines = 2"),
    Case("zero rollout workers", _overrides("rollout.num_workers=0"), "rollout.num_workers: Input should be greater than or equal to 1"),
    Case("more GPUs than the machine has", _overrides("rollout.num_workers=1000", "rollout.num_gpus_per_worker=8"),
         "rollout_pool: the pools need 8000 GPU (rollout_pool 8000 + learner_pool 0)"),
    Case("collective weights between a GPU learner and CPU engines", _overrides("weight_sync.transport=collective", "learner.num_gpus_per_rank=1"),
         "learner.num_gpus_per_rank (1) and rollout.num_gpus_per_worker (0) must both be 0 or both be > 0"),
    Case("collective weights from a share of a GPU", _overrides("weight_sync.transport=collective", "learner.num_gpus_per_rank=0.5", "rollout.num_gpus_per_worker=0.5"),
         "needs whole GPUs per learner rank: learner.num_gpus_per_rank is 0.5, so an engine can share rank 0's GPU"),
    Case("delta weights over shared memory", _overrides("weight_sync.delta=true", "weight_sync.transport=shared_memory"),
         "weight_sync.delta sends deltas through the object store: weight_sync.transport = 'shared_memory' cannot carry them"),
    Case("a custom resource no node has", _overrides("rollout.resources={node2: 1}"), "rollout_pool: one unit needs 1 node2; the largest node of this machine has 0"),
    Case("unknown placement strategy", _overrides("learner.placement_strategy=ROUND"), "learner.placement_strategy: Input should be 'PACK'"),
    Case("the dashboard beyond loopback without a token", _overrides("telemetry.bind_host=0.0.0.0"),
         "telemetry.bind_host=0.0.0.0 serves beyond this machine: set telemetry.dashboard_token (or the environment variable ASYNCRL_DASHBOARD_TOKEN)"),
    Case("the OpenAI endpoint beyond loopback without a key", _overrides("rollout.openai_port=-1", "rollout.openai_host=0.0.0.0"),
         "rollout.openai_host=0.0.0.0 serves beyond this machine: set rollout.openai_api_key (or the environment variable ASYNCRL_OPENAI_API_KEY)"),
    Case("unknown run-folder mode", _overrides("storage.mode=public"), "storage.mode: Input should be 'private', 'group' or 'world'"),
    Case("a relative reward mount", _overrides("tools.reward_mounts=[answers]"), "tools.reward_mounts: 'answers' is not an absolute path"),
    Case("a whole system folder as a reward mount", _overrides("tools.reward_mounts=[/home]"), "tools.reward_mounts: '/home' is a whole system folder"),
    Case("a missing reward mount", lambda tmp: [f"tools.reward_mounts=[{tmp / 'nope'}]"], "tools.reward_mounts: '{tmp}/nope' does not exist on this machine"),
    Case("unsupported storage URI", _overrides("storage.uri=hdfs://name/runs"), "storage.uri 'hdfs://name/runs': a path, file://, s3:// or gs:// URI is supported, not hdfs://"),
    Case("credentials in the storage URI", _overrides("storage.uri=s3://KEY:SECRET@bucket/runs"), "storage.uri: no credentials in the URI; set them in the environment"),
    Case("missing model folder", lambda tmp: [f"model.path={tmp / 'nope'}"], "model.path: {tmp}/nope does not exist or is not a directory"),
    Case("model folder without config.json", _model_folder(), "model.path: {tmp}/model has no config.json"),
    Case("model folder without a tokenizer", _model_folder("config.json"), "model.path: {tmp}/model has no tokenizer"),
    Case("a head size vLLM's CPU attention cannot serve", _model_folder("config.json", "tokenizer.json", "chat_template.jinja", config='{"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4}'),
         "model.path: {tmp}/model/config.json: head size 16 (hidden_size 64 / num_attention_heads 4) is not one vLLM's CPU attention serves"),
    Case("an architecture asyncrl does not support", _model_folder("config.json", "tokenizer.json", "chat_template.jinja", config='{"architectures": ["GPT2LMHeadModel"]}'),
         "model.path: {tmp}/model/config.json: architecture GPT2LMHeadModel is not one asyncrl supports"),
    Case("a tokenizer without a chat template", _model_folder("config.json", "tokenizer.json", config='{"architectures": ["LlamaForCausalLM"]}'),
         "model.path: {tmp}/model has a tokenizer without a chat template"),
    Case("a reference policy that is not a model folder", lambda tmp: [f"learner.reference_path={tmp}", "algorithm.params={kl_coef: 0.1}"],
         "learner.reference_path: {tmp} has no readable config.json (not a Hugging Face model folder)"),
    Case("KL in the reward with an advantage the driver builds", _overrides("algorithm.params={kl_in_reward_coef: 0.1}"),
         "parameter 'kl_in_reward_coef' is not taken by the chosen advantage 'batch_norm'"),
    Case("unknown model preset", _overrides("model.preset=huge"), "model.preset: unknown preset 'huge'"),
    Case("unknown family shape key", _overrides("model.family=qwen2", "model.family_shape.hidden=128"), "unknown key 'model.family_shape.hidden' (did you mean 'hidden_size'?)"),
    Case("family shape with an unserved head size", _overrides("model.family=qwen2", "model.family_shape.num_attention_heads=4"), "model.family_shape: head size 16 (head_dim) is not one vLLM's CPU attention serves"),
    Case("family shape whose heads do not divide", _overrides("model.family=qwen2", "model.family_shape.num_key_value_heads=3"), "model.family_shape: num_key_value_heads = 3 does not divide num_attention_heads = 2"),
    Case("family shape without a family", _overrides("model.family_shape.hidden_size=128"), "model.family_shape is set but model.family is not"),
    Case("parquet task without a file", _overrides("data.task=parquet"), "data.task 'parquet' needs data.train_path"),
    Case("missing Parquet file", lambda tmp: ["data.task=parquet", f"data.train_path={tmp / 'train.parquet'}"], "data.train_path: {tmp}/train.parquet does not exist"),
    Case("a file that is not Parquet", _file("train.parquet", b"not parquet", "data.task=parquet", "data.train_path={tmp}/train.parquet"),
         "data.train_path: {tmp}/train.parquet is not a readable Parquet file"),
    Case("Parquet without a verl column", _parquet([{"data_source": "d", "prompt": ROW["prompt"]}]), "lacks the verl columns ['reward_model']"),
    Case("Parquet without rows", _parquet(pa.table({k: pa.array([], pa.string()) for k in ROW})), "data.train_path: {tmp}/train.parquet has no rows"),
    Case("empty prompt", _parquet([ROW, {**ROW, "prompt": [{"role": "user", "content": "  "}]}]), "train.parquet: row 1: the prompt is empty"),
    Case("prompt as a string, not messages", _parquet([{**ROW, "prompt": "1+1="}]), "train.parquet: row 0: 'prompt' must be a non-empty list of {{role, content}} messages"),
    Case("ground truth missing", _parquet([{**ROW, "reward_model": {"style": "rule"}}]), "train.parquet: row 0: reward_model.ground_truth is missing"),
    Case("non-UTF-8 prompt text", _parquet(NOT_UTF8), "train.parquet: row 0: prompt message 0 is not UTF-8 text (invalid start byte at byte 0)"),
    Case("only prompts longer than the context", _parquet([{**ROW, "prompt": [{"role": "user", "content": "1+" * 300}]}] * 2),
         "train.parquet: every one of the first 2 prompts is longer than data.max_prompt_tokens"),
    Case("duplicate prompt ids", _parquet([{**ROW, "extra_info": {"index": 7}}] * 2),
         "data.train_path: {tmp}/train.parquet: duplicate prompt id '7' (extra_info.index) at {tmp}/train.parquet: row 0 (row group 0) and at {tmp}/train.parquet: row 1 (row group 0)"),
    Case("a glob that matches nothing", lambda tmp: ["data.task=parquet", f"data.train_path={tmp}/shards/*.parquet"],
         "data.train_path: no file matches the pattern {tmp}/shards/*.parquet"),
    Case("unknown reward name", _overrides("env.reward=exact_matc"), "env.reward: unknown reward 'exact_matc'"),
    Case("unimportable reward", _overrides("env.reward=no_such_module:score"), "env.reward: cannot import reward 'no_such_module:score'"),
    Case("reward that is not a function", _overrides("env.reward=os:sep"), "env.reward: reward 'os:sep' is not callable"),
    Case("checkpoint folder without its marker", lambda tmp: [f"checkpoint.resume_from={tmp}"], "checkpoint.resume_from: {tmp} is not a complete checkpoint"),
    Case("corrupt checkpoint marker", _checkpoint('{"step": 2, "vers'), "learner_state.json is corrupt (JSONDecodeError"),
    Case("checkpoint without its shards", _checkpoint(GOOD_STATE, shards=False), "step-000002 is corrupt: learner/.metadata, learner/rank_0.pt missing"),
    Case("checkpoint of another config", _checkpoint(GOOD_STATE, config="model:\n  preset: add-3m\n"),
         "was written by a run with model.preset = 'add-3m'; this config has 'add-1m'"),
    Case("checkpoint of the other learner backend", _checkpoint(GOOD_STATE, megatron=True),
         "was written by learner.training_backend = megatron, this config has fsdp2: convert it with `asyncrl convert-checkpoint"),
    Case("tensor parallelism without megatron", _overrides("learner.tensor_parallel=2"), "learner.tensor_parallel = 2 needs learner.training_backend = megatron"),
    Case("tensor parallelism that does not divide the heads", _overrides("learner.training_backend=megatron", "learner.compile=false", "learner.num_ranks=3", "learner.tensor_parallel=3"),
         "learner.tensor_parallel: 3 does not divide the model's num_attention_heads"),
    Case("config file not found", _overrides("nope/recipe.yaml"), "config file not found: nope/recipe.yaml"),
    Case("config file that is not YAML", _file("bad.yaml", b"learner: [1, 2\n", "{tmp}/bad.yaml"), "bad.yaml: not valid YAML"),
    Case("config file that is a list", _file("list.yaml", b"- 1\n- 2\n", "{tmp}/list.yaml"), "list.yaml: the top level must be a mapping of sections"),
]


def _run_cli(command: str, args: list[str], tmp: Path) -> tuple[int, str]:
    err = io.StringIO()
    with redirect_stdout(io.StringIO()), redirect_stderr(err):
        code = main([command, *args, f"output_dir={tmp / 'run'}"])
    return code, err.getvalue()


def test_there_are_at_least_25_cases_with_distinct_inputs():
    assert len(CASES) >= 25 and len({c.what for c in CASES}) == len(CASES)


@pytest.mark.parametrize("command", ["check", "run"])
@pytest.mark.parametrize("case", CASES, ids=[c.what for c in CASES])
def test_bad_input_is_rejected_by_name_and_nothing_is_written(case, command, tmp_path):
    code, err = _run_cli(command, case.args(tmp_path), tmp_path)
    assert code != 0
    assert case.expect.format(tmp=tmp_path) in err
    assert not (tmp_path / "run").exists()


def table() -> str:
    """docs/bad_input.md: every case's input and the message `asyncrl check` gives (scratch paths as <tmp>)."""
    import tempfile

    lines = [
        "# Bad input and what asyncrl says",
        "",
        "Generated from `tests/unit/controller/test_bad_input.py` (`python -m tests.unit.controller.test_bad_input > docs/bad_input.md`).",
        "Each input makes `asyncrl check` and `asyncrl run` exit non-zero with this message, and `run` writes nothing.",
        "",
        "| input | arguments | message |",
        "|---|---|---|",
    ]
    for case in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            args = case.args(Path(tmp))
            _, err = _run_cli("check", args, Path(tmp))
            message = "; ".join(line.strip() for line in err.strip().splitlines())
        args, message = (_portable(text, tmp) for text in (" ".join(args), message))
        lines.append(f"| {case.what} | `{args}` | {message.replace('|', '&#124;')} |")
    return "\n".join(lines) + "\n"


def _portable(text: str, tmp: str) -> str:
    """Scratch and checkout paths differ per machine: `<tmp>`, `<repo>`."""
    return text.replace(tmp, "<tmp>").replace(str(ROOT), "<repo>")


def test_the_docs_table_lists_every_case_with_its_message():
    """Row for row: the case's input and a message holding what the test asserts (the rest of a message may
    differ between machines, e.g. how many GPUs this one has)."""
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("| ") and not line.startswith("| input")]
    assert len(rows) == len(CASES), "regenerate: python -m tests.unit.controller.test_bad_input > docs/bad_input.md"
    for case, row in zip(CASES, rows):
        assert row.startswith(f"| {case.what} | ") and case.expect.format(tmp="<tmp>").replace("|", "&#124;") in row, row


if __name__ == "__main__":
    sys.stdout.write(table())
