"""MoE engine <-> learner parity, with and without routing replay (R3), on a tiny random-init Qwen3-MoE (#46 point 6).

vLLM's CPU build cannot return routed experts through its own API (`enable_return_routed_experts` needs Model
Runner V2, which needs Triton with a CPU backend: docs in the module `asyncrl.rollout.vllm_compat.routes`), so
this script records them itself: one in-process vLLM engine (fp32, `VLLM_ENABLE_V1_MULTIPROCESSING=0`) with a
capture callback on every MoE router (`BaseRouter.set_capture_fn`, the hook vLLM's own capturer uses), and
requests run one at a time so that a step's rows are one request's tokens (the prompt in one prefill step, then
one generated token per step; the last generated token is never forwarded, so it has no route).

The learner side is asyncrl's `PolicyModel` over a transformers `Qwen3MoeForCausalLM` loaded from the same folder,
scoring the same tokens (temperature 1, no top-k/top-p, so vLLM's processed log-probs are the plain ones), once
routing as it likes and once replaying vLLM's routes (`asyncrl.learner.routing.replaying`). Reported per mode:
the project's mismatch metrics (`asyncrl.algo.metrics.mismatch_metrics`: |Δlogp| max and mean, k3 KL), and for
the run without replay the route agreement per MoE layer, the fraction of tokens with a flipped route, the max
|Δlogp| on tokens with no flip at or before them against tokens at or after one, and the learner's router
probability gap between its k-th and (k+1)-th expert on the flipped tokens (a near-tie has a tiny gap).

    python benchmarks/moe_routing_replay.py            # fp32 and bf16 x 2 router scales x 128 prompts x 32 tokens
    python benchmarks/moe_routing_replay.py --quick    # smoke size
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import common  # benchmarks/common.py: a script's own folder is on sys.path

PROMPT_LEN = 24
VOCAB_FIRST = 4  # the character tokenizer's specials come first


def build_moe(out_dir: Path, router_std: float, seed: int = 0) -> Path:
    """A 2-layer Qwen3-MoE (hidden 64, head_dim 32, 8 experts, top-2), random init with the router's weights drawn
    at `router_std` (transformers' own init is 0.02), beside the ASCII character tokenizer."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from asyncrl.models.tokenizer import ASCII_ALPHABET, build_char_tokenizer

    tokenizer = build_char_tokenizer(ASCII_ALPHABET)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, router_std)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def rollouts(model_dir: Path, prompts: list[list[int]], tokens: int, seed: int, dtype: str) -> list[dict]:
    """Each prompt generated alone by an in-process vLLM engine: its sampled ids, log-probs and the routes vLLM
    took for every forwarded token ([P + T - 1, layers, top_k])."""
    import numpy as np
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(model_dir), dtype=dtype, enforce_eager=True, enable_prefix_caching=False, max_model_len=256,
        max_num_seqs=4, seed=seed, logprobs_mode="processed_logprobs", disable_log_stats=True,
    )  # fmt: skip
    captured: dict[int, list[np.ndarray]] = {}

    def bind(model):
        from vllm.model_executor.layers.fused_moe.layer import MoERunner

        runners = [m for m in model.modules() if isinstance(m, MoERunner)]
        for layer, runner in enumerate(runners):
            runner.router.set_capture_fn(
                lambda ids, layer=layer: captured.setdefault(layer, []).append(ids.numpy().copy())
            )
        return len(runners)

    (num_layers,) = llm.apply_model(bind)
    out = []
    for i, prompt in enumerate(prompts):
        captured.clear()
        params = SamplingParams(max_tokens=tokens, temperature=1.0, logprobs=0, seed=seed + i, ignore_eos=True)
        completion = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        ids = list(completion.token_ids)
        logprobs = [lp[t].logprob for lp, t in zip(completion.logprobs, ids, strict=True)]
        routes = np.stack([np.concatenate(captured[layer]) for layer in range(num_layers)], axis=1)
        assert routes.shape[0] == len(prompt) + len(ids) - 1, (routes.shape, len(prompt), len(ids))
        out.append({"prompt": prompt, "response": ids, "logprobs": logprobs, "routes": routes})
    del llm
    return out


def learner_pass(model_dir: Path, samples: list[dict], dtype: str) -> dict:
    """Learner log-probs without and with replay, the learner's own routes and router gaps, in batch layout. In
    bfloat16 the learner is what one rank runs for `model.dtype: bfloat16`: fp32 masters, decoder layers cast to
    bf16 (`policy.cast_layers`), fp32 head."""
    import torch

    from asyncrl.algo.sampling import SamplingDistribution
    from asyncrl.learner.policy import PolicyModel, cast_layers, load_causal_lm
    from asyncrl.learner.routing import RouteRecorder, moe_routers, replaying

    policy = PolicyModel(load_causal_lm(str(model_dir))).eval()
    if dtype != "float32":
        policy.transformer.set_attn_implementation("eager")
        cast_layers(policy, getattr(torch, dtype))
    sequences = [s["prompt"] + s["response"] for s in samples]
    width = max(map(len, sequences))
    batch, layers, top_k = len(samples), samples[0]["routes"].shape[1], samples[0]["routes"].shape[2]
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.bool)
    rollout = torch.zeros(batch, width)
    engine_routes = torch.full((batch, width, layers, top_k), -1, dtype=torch.int16)
    for b, (s, seq) in enumerate(zip(samples, sequences, strict=True)):
        p, n = len(s["prompt"]), len(seq)
        ids[b, :n] = torch.tensor(seq)
        mask[b, p - 1 : n - 1] = True
        rollout[b, p - 1 : n - 1] = torch.tensor(s["logprobs"])
        engine_routes[b, : n - 1] = torch.from_numpy(s["routes"].astype("int16"))
    attention = (torch.arange(width) < torch.tensor(list(map(len, sequences)))[:, None]).long()
    positions = torch.arange(width).expand(batch, width).contiguous()
    sampling = SamplingDistribution()
    gaps: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda _m, args, _o: gaps.append(_gap(args[0], _m))) for r in moe_routers(policy)]
    recorder = RouteRecorder(policy)
    with torch.no_grad():
        own = policy(ids, attention, positions, sampling)
        own_routes = recorder.routes(batch, width)
        for h in hooks:
            h.remove()
        recorder.close()
        with replaying(policy, engine_routes):
            replayed = policy(ids, attention, positions, sampling)
    return {
        "mask": mask, "rollout": rollout, "own": own, "replayed": replayed, "own_routes": own_routes,
        "engine_routes": engine_routes.long(), "gaps": torch.stack(gaps, dim=1).reshape(batch, width, layers),
        "attention": attention,
    }  # fmt: skip


def _gap(hidden, router):
    """The learner's router probability of its k-th expert minus its (k+1)-th, per token."""
    import torch

    logits = torch.nn.functional.linear(hidden.reshape(-1, router.hidden_dim), router.weight)
    probs = torch.softmax(logits, -1, dtype=torch.float)
    top = probs.topk(router.top_k + 1, dim=-1).values
    return top[:, -2] - top[:, -1]


def figures(p: dict) -> dict:
    """The mismatch metrics without and with replay, and the route-flip analysis of the run without replay."""
    from asyncrl.algo.metrics import mismatch_metrics

    mask, rollout = p["mask"], p["rollout"]
    routed = p["engine_routes"][..., 0] >= 0  # [B, L, layers]: the tokens vLLM forwarded
    same = (p["own_routes"].sort(-1).values == p["engine_routes"].sort(-1).values).all(-1) | ~routed
    flipped_token = ~same.all(-1)  # [B, L]
    after_flip = flipped_token.long().cummax(dim=1).values.bool()  # at or after a flip in the same row
    diff = (p["own"] - rollout).abs()
    keep = ["logprob_abs_diff_max", "logprob_abs_diff_mean", "k3_kl"]
    out = {
        "tokens_scored": int(mask.sum()),
        "tokens_routed": int(routed[..., 0].sum()),
        "without_replay": {k: mismatch_metrics(p["own"], rollout, mask)[k] for k in keep},
        "with_replay": {k: mismatch_metrics(p["replayed"], rollout, mask)[k] for k in keep},
        "route_agreement_per_layer": [
            float(same[..., i][routed[..., i]].float().mean()) for i in range(routed.shape[-1])
        ],
        "flipped_token_fraction": float(flipped_token[routed[..., 0]].float().mean()),
        "scored_tokens_after_a_flip_fraction": float(after_flip[mask].float().mean()),
        "abs_diff_max_no_flip_before": float(diff[mask & ~after_flip].max()) if (mask & ~after_flip).any() else None,
        "abs_diff_max_after_a_flip": float(diff[mask & after_flip].max()) if (mask & after_flip).any() else None,
    }
    flips = ~same & routed
    if flips.any():
        out["router_gap_at_flips_max"] = float(p["gaps"][flips].max())
        out["router_gap_at_flips_median"] = float(p["gaps"][flips].median())
    out["router_gap_all_tokens_median"] = float(p["gaps"][routed].median())
    return out


def table(rows: list[dict]) -> str:
    lines = [
        "| dtype | router std | flipped tokens | agreement L0 / L1 | max abs dlogp no flip / after flip"
        " | max abs dlogp without / with replay | mean abs dlogp without / with | k3 without / with |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        f, w, rp = r["figures"], r["figures"]["without_replay"], r["figures"]["with_replay"]
        agree = " / ".join(f"{a:.4f}" for a in f["route_agreement_per_layer"])
        lines.append(
            f"| {r['dtype']} | {r['router_std']} | {f['flipped_token_fraction']:.4f} | {agree}"
            f" | {_e(f['abs_diff_max_no_flip_before'])} / {_e(f['abs_diff_max_after_a_flip'])}"
            f" | {_e(w['logprob_abs_diff_max'])} / {_e(rp['logprob_abs_diff_max'])}"
            f" | {_e(w['logprob_abs_diff_mean'])} / {_e(rp['logprob_abs_diff_mean'])}"
            f" | {_e(w['k3_kl'])} / {_e(rp['k3_kl'])} |"
        )
    return "\n".join(lines)


def _e(value) -> str:
    return "-" if value is None else f"{value:.1e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_output_options(parser, "moe_routing_replay", "4 prompts x 8 tokens, one router scale")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--router-std", type=float, nargs="+", default=[0.02, 0.2])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    common.set_runtime_env()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the capture callbacks run in this process
    import numpy as np

    if args.quick:
        args.prompts, args.tokens, args.router_std, args.dtypes = 4, 8, args.router_std[:1], args.dtypes[-1:]
    load_start = common.load_average()
    rng = np.random.default_rng(0)
    prompts = [[1, *rng.integers(VOCAB_FIRST, 100, PROMPT_LEN - 1).tolist()] for _ in range(args.prompts)]
    rows = []
    for dtype in args.dtypes:
        for std in args.router_std:
            began = time.perf_counter()
            model_dir = build_moe(Path(tempfile.mkdtemp(prefix="moe-r3-")), std)
            samples = rollouts(model_dir, prompts, args.tokens, seed=0, dtype=dtype)
            rows.append({"dtype": dtype, "router_std": std, "figures": figures(learner_pass(model_dir, samples, dtype)),
                         "seconds": time.perf_counter() - began})  # fmt: skip
            print(table(rows[-1:]), flush=True)
    result = {
        "benchmark": "moe_routing_replay",
        "model": "qwen3-moe 2 layers, hidden 64, head_dim 32, 8 experts top-2, norm_topk_prob, random init",
        "prompts": args.prompts, "prompt_len": PROMPT_LEN, "tokens": args.tokens,
        "machine": common.machine(load_start), "rows": rows, "table": table(rows),
    }  # fmt: skip
    path = common.output_path("moe_routing_replay", args)
    common.write_json(path, result)
    print(result["table"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
