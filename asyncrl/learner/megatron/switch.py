"""A learner checkpoint converted between the backends, so a run resumes on the other one with the same step, policy
version and counters: `to_fsdp2` turns a megatron checkpoint (`state.save_megatron_state`: one piece per TP rank) into
the FSDP2 backend's (`asyncrl.learner.checkpoint`: DCP shards), `to_megatron` the other way, at any
`tensor_parallel`.

What converts: the policy's fp32 weights and AdamW's state (`step`, `exp_avg`, `exp_avg_sq`: elementwise, so they
take the weights' layout change tensor for tensor, `convert.py`), exactly (no arithmetic, only re-layout). What is
copied: every rank's RNG and schedule file (`learner/rank_<r>.pt`, the same record in both backends), `extra.json`
(the controller's counters and queue state) and, last, `learner_state.json` (step, version, ranks). Neither backend
checkpoints a critic under megatron, so there is none to convert.

Both run in one process on the CPU with the whole model in memory (weights and two moments: 12 bytes per parameter,
twice while converting); they need a torch.distributed group and make a one-rank gloo group when there is none.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from asyncrl.learner.checkpoint import EXTRA_FILE, STATE_FILE

__all__ = ["backend_of", "convert", "to_fsdp2", "to_megatron"]

_LEARNER = "learner"
_MOMENTS = ("exp_avg", "exp_avg_sq")


def backend_of(folder: str | Path) -> str:
    """Which backend wrote the checkpoint in `folder`: `megatron` (its TP pieces) or `fsdp2` (DCP shards)."""
    return "megatron" if (Path(folder) / _LEARNER / "megatron_tp0.pt").is_file() else "fsdp2"


def convert(src: str, dst: str, model_dir: str, to: str, tensor_parallel: int = 1) -> int:
    """The checkpoint `src` for `to` (`fsdp2`, or `megatron` at `tensor_parallel`) in the new folder `dst`, from
    either backend (megatron to megatron at another `tensor_parallel` goes through an FSDP2 copy); -> its step."""
    import tempfile

    if to not in ("fsdp2", "megatron"):
        raise ValueError(f"convert to {to!r}: fsdp2 or megatron")
    source = backend_of(src)
    if to == "fsdp2":
        if source == "fsdp2":
            raise ValueError(f"{src} is already an FSDP2 checkpoint")
        return to_fsdp2(src, dst, model_dir)
    if source == "fsdp2":
        return to_megatron(src, dst, model_dir, tensor_parallel)
    with tempfile.TemporaryDirectory(dir=Path(dst).parent if Path(dst).parent.exists() else None) as hop:
        to_fsdp2(src, hop, model_dir)
        return to_megatron(hop, dst, model_dir, tensor_parallel)


def to_fsdp2(src: str, dst: str, model_dir: str) -> int:
    """The megatron checkpoint `src` as an FSDP2 checkpoint in `dst` (a new folder), for the model of `model_dir`
    (its Hugging Face config and shapes: the run's `model.path` or built preset); -> the checkpoint's step."""
    from asyncrl.learner.checkpoint import save_train_state

    src_dir, out = _complete(src), _fresh(dst)
    pieces = _megatron_pieces(src_dir)
    with _one_process_group():
        skeleton = _megatron_skeleton(model_dir)
        names = [n for n, _ in skeleton.gpt.named_parameters()]
        dims = {n: _dim(p) for n, p in skeleton.gpt.named_parameters()}
        optims = [p["optim"] for p in pieces]
        full = {n: _joined(skeleton, n, dims[n], [p["model"][f"gpt.{n}"] for p in pieces]) for n in names}
        moments = {
            m: {n: _joined(skeleton, n, dims[n], [o["state"][i][m] for o in optims]) for i, n in enumerate(names)}
            for m in _MOMENTS
        }
        converter = skeleton.converter
        hf = {m: converter.to_hf(t, skeleton.hf_config) for m, t in (("param", full), *moments.items())}
        state, local = _fsdp2_state(model_dir), torch.load(src_dir / _LEARNER / "rank_0.pt", weights_only=True)
        _set_fsdp2(state, hf, _adam_step(optims[0]), optims[0]["param_groups"])
        state.scheduler.load_state_dict(local["scheduler"])
        save_train_state(out, state, rank=0, step=int(local["step"]))
    _copy_rank_files(src_dir, out)  # every rank's own RNG, in place of this process's
    _copy_rest(src_dir, out)
    return int(local["step"])


def to_megatron(src: str, dst: str, model_dir: str, tensor_parallel: int) -> int:
    """The FSDP2 checkpoint `src` (no critic) as a megatron checkpoint of `tensor_parallel` pieces in `dst` (a new
    folder), for the model of `model_dir`; -> the checkpoint's step."""
    from asyncrl.learner.checkpoint import _rng_state, _set_rng_state, load_train_state
    from asyncrl.learner.megatron.convert import shard

    if tensor_parallel < 1:
        raise ValueError(f"tensor_parallel = {tensor_parallel}: at least 1")
    src_dir = _complete(src)
    if _has_critic(src_dir):
        raise ValueError(f"{src} holds a critic: the megatron backend trains none, so it cannot take this checkpoint")
    out, rng = _fresh(dst), _rng_state()
    with _one_process_group():
        state = _fsdp2_state(model_dir)
        step = load_train_state(src_dir, state, rank=0)
        _set_rng_state(rng)  # loading restored rank 0's RNG into this process
        params = {n.removeprefix("causal_lm."): p for n, p in state.policy.named_parameters()}
        per_param = {
            "param": {n: p.detach() for n, p in params.items()},
            **{m: {n: state.optimizer.state[p][m] for n, p in params.items()} for m in _MOMENTS},
        }
        skeleton = _megatron_skeleton(model_dir)
        converter, config = skeleton.converter, skeleton.hf_config
        mc = {m: converter.to_megatron(t, config) for m, t in per_param.items()}
        mc_step = _adam_step({"state": dict(enumerate(state.optimizer.state.values()))})
        groups = [dict(g, params=[]) for g in state.optimizer.state_dict()["param_groups"]]
        named = list(skeleton.gpt.named_parameters())
        groups[0]["params"] = list(range(len(named)))
        skeleton_state = skeleton.state_dict()
        (out / _LEARNER).mkdir(parents=True)
        for rank in range(tensor_parallel):

            def piece(kind: str, name: str, param: torch.Tensor, rank: int = rank) -> torch.Tensor:
                whole = skeleton._padded(name, mc[kind][name], tensor_parallel)
                return shard(name, whole, _dim(param), rank, tensor_parallel)

            model = {**skeleton_state, **{f"gpt.{n}": piece("param", n, p) for n, p in named}}
            optim = {
                "state": {
                    i: {"step": mc_step.clone(), **{m: piece(m, n, p) for m in _MOMENTS}}
                    for i, (n, p) in enumerate(named)
                },
                "param_groups": groups,
            }
            torch.save(
                {"model": model, "optim": optim, "tensor_parallel": tensor_parallel},
                out / _LEARNER / f"megatron_tp{rank}.pt",
            )
    _copy_rank_files(src_dir, out)
    _copy_rest(src_dir, out)
    return step


# ---------------------------------------------------------------------- pieces


def _complete(src: str) -> Path:
    folder = Path(src)
    if not (folder / STATE_FILE).is_file():
        raise FileNotFoundError(f"{folder} is not a complete learner checkpoint (no {STATE_FILE})")
    return folder


def _has_critic(folder: Path) -> bool:
    """Whether the FSDP2 checkpoint in `folder` saved a critic (its DCP metadata names `critic` keys)."""
    from torch.distributed.checkpoint import FileSystemReader

    from asyncrl.learner.checkpoint import _DCP_DIR

    keys = FileSystemReader(str(folder / _DCP_DIR)).read_metadata().state_dict_metadata
    return any(key.startswith("critic") for key in keys)


def _fresh(dst: str) -> Path:
    folder = Path(dst)
    if folder.exists() and any(folder.iterdir()):
        raise FileExistsError(f"{folder} exists and is not empty: convert into a new folder")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _megatron_pieces(folder: Path) -> list[dict]:
    first = folder / _LEARNER / "megatron_tp0.pt"
    if not first.is_file():
        raise FileNotFoundError(f"{folder}: no {_LEARNER}/{first.name}, not a megatron checkpoint")
    pieces = [torch.load(first, weights_only=True)]  # nothing unpickled from a user path
    for rank in range(1, int(pieces[0]["tensor_parallel"])):
        pieces.append(torch.load(folder / _LEARNER / f"megatron_tp{rank}.pt", weights_only=True))
    return pieces


@contextmanager
def _one_process_group() -> Iterator[None]:
    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        raise RuntimeError("checkpoint conversion runs in one process: a torch.distributed group of one or none")
    try:
        yield
    finally:
        if owned:
            from megatron.core import parallel_state as ps

            ps.destroy_model_parallel()
            dist.destroy_process_group()


def _megatron_skeleton(model_dir: str):
    """The policy at TP = 1 (uninitialized weights): its parameters' names, order (AdamW's indices), split dims and
    vocabulary padding."""
    from transformers import AutoConfig

    from asyncrl.learner.megatron.model import MegatronPolicy, build_gpt, init_parallel

    init_parallel(1)
    config = AutoConfig.from_pretrained(model_dir)
    return MegatronPolicy(build_gpt(config, 1), config)


def _dim(param: torch.Tensor) -> int | None:
    from asyncrl.learner.megatron.model import partition_dim

    return partition_dim(param)


def _joined(skeleton, name: str, dim: int | None, pieces: list[torch.Tensor]) -> torch.Tensor:
    from asyncrl.learner.megatron.convert import unshard

    return skeleton._unpadded(name, unshard(name, pieces, dim))


def _fsdp2_state(model_dir: str):
    """The FSDP2 backend's train state as one plain rank holds it (DCP reshards it for any number of ranks)."""
    from asyncrl.config import LearnerConfig
    from asyncrl.learner.state import build_train_state

    return build_train_state(LearnerConfig(), model_dir, torch.device("cpu"))


def _adam_step(optim: dict) -> torch.Tensor:
    """AdamW's `step`, the same for every parameter (each is stepped together; a ValueError otherwise)."""
    steps = {float(entry["step"]) for entry in optim["state"].values()}
    if len(steps) != 1:
        raise ValueError(f"checkpoint conversion: AdamW's parameters were stepped {sorted(steps)} times, not alike")
    return next(iter(optim["state"].values()))["step"]


def _set_fsdp2(state, hf: dict[str, dict[str, torch.Tensor]], step: torch.Tensor, groups) -> None:
    """Weights and AdamW state by Hugging Face name into the FSDP2 policy (tied weights once); strict."""
    params = {n.removeprefix("causal_lm."): p for n, p in state.policy.named_parameters()}
    if set(params) != set(hf["param"]):
        raise KeyError(
            f"checkpoint conversion: the model has {sorted(set(params) - set(hf['param']))} more and "
            f"{sorted(set(hf['param']) - set(params))} fewer tensors than the megatron checkpoint"
        )
    optim = {
        "state": {i: {"step": step.clone(), **{m: hf[m][n] for m in _MOMENTS}} for i, n in enumerate(params)},
        "param_groups": [dict(g, params=list(range(len(params)))) for g in groups],
    }
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(hf["param"][name])
    state.optimizer.load_state_dict(optim)


def _copy_rank_files(src: Path, out: Path) -> None:
    """Every rank's RNG and schedule (`learner/rank_<r>.pt`), the same record in both backends."""
    for file in sorted((src / _LEARNER).glob("rank_*.pt")):
        shutil.copy2(file, out / _LEARNER / file.name)


def _copy_rest(src: Path, out: Path) -> None:
    """The controller's extra state, then the completion marker (last: its presence marks a complete folder)."""
    if (src / EXTRA_FILE).is_file():
        shutil.copy2(src / EXTRA_FILE, out / EXTRA_FILE)
    shutil.copy2(src / STATE_FILE, out / STATE_FILE)
