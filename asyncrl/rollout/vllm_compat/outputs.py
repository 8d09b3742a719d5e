"""Requests into and outputs out of vLLM (checked with vLLM 0.32.0): a prompt of token ids in the form
`AsyncLLM.generate` takes without a thread hop, per-token policy versions, per-token log-probs from vLLM's flat
(or per-position dict) layout, and a parallel-sampling child's internal request id.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def token_input(token_ids: list[int]) -> Any:
    """`token_ids` as vLLM's rendered token input (vLLM 0.32 `vllm.inputs.engine.tokens_input`).

    vLLM 0.32: `AsyncLLM.generate` processes a rendered input inline, but sends a raw `{"prompt_token_ids":
    ...}` prompt through its renderer's thread pool (built for tokenizing text; deprecated for token ids): one
    thread hop per request, the largest per-request cost in a rollout worker's profile after vLLM's own output
    handling. Length validation against `max_model_len` is the same on both paths.
    """
    from vllm.inputs.engine import tokens_input

    return tokens_input(token_ids)


def version_per_token(spans: Any, num_tokens: int, default_version: int) -> np.ndarray:
    """Per-token policy versions (int32 [num_tokens]) from a finished `CompletionOutput.weight_versions`.

    vLLM 0.32 reports `weight_versions` as `[WeightVersionSpan(version: str, start, end)]` over output-token
    indices on the final output of a request. Tokens not covered (no spans, e.g. a request aborted before
    its first token, or the "default" label before any version was set) get `default_version`.
    """
    versions = np.full(num_tokens, default_version, dtype=np.int32)
    for span in spans or ():
        try:
            value = int(span.version)
        except (TypeError, ValueError):
            continue
        versions[max(0, span.start) : min(num_tokens, span.end)] = value
    return versions


def sampled_logprobs(logprobs: Any, token_ids: list[int]) -> list[float]:
    """The log-prob of each sampled token: from vLLM 0.32's `FlatLogprobs` (requests with `flat_logprobs=True`,
    the sampled token first at each position: no dict and `Logprob` per token) or per-position
    `{token_id: Logprob}` dicts."""
    from vllm.logprobs import FlatLogprobs

    if not isinstance(logprobs, FlatLogprobs):
        # strict=False: as in the flat layout, only the positions of `token_ids` are read
        return [float(position[token].logprob) for position, token in zip(logprobs, token_ids, strict=False)]
    starts = logprobs.start_indices[: len(token_ids)]
    if [logprobs.token_ids[i] for i in starts] != list(token_ids):
        raise RuntimeError("vLLM's FlatLogprobs no longer lists the sampled token first at each position (vllm_compat)")
    return [logprobs.logprobs[i] for i in starts]


def top_logprobs(logprobs: Any, k: int) -> list[dict[int, float]]:
    """The `k` most likely tokens of each position, by vLLM's rank (the sampled token is there as well, ranked
    wherever it falls: it is dropped unless it is among the `k`)."""
    from vllm.logprobs import FlatLogprobs

    if not isinstance(logprobs, FlatLogprobs):
        return [
            {int(t): float(lp.logprob) for t, lp in position.items() if lp.rank is not None and lp.rank <= k}
            for position in logprobs
        ]
    ids, values, ranks = logprobs.token_ids, logprobs.logprobs, logprobs.ranks
    return [
        {int(ids[i]): float(values[i]) for i in range(start, end) if (rank := ranks[i]) is not None and rank <= k}
        for start, end in zip(logprobs.start_indices, logprobs.end_indices, strict=True)
    ]


def child_request_id(llm: Any, request_id: str, index: int) -> str | None:
    """vLLM's internal id of completion `index` of the `n>1` request `request_id`, to abort that one sample
    (`llm.abort(id, internal=True)`); None once it finished. vLLM 0.32 fans an `n>1` request out into child
    requests `"{index}_{parent internal id}"`, each listed under the external id in the output processor, and
    `abort(request_id)` would end every child."""
    prefix = f"{index}_"
    for internal in llm.output_processor.external_req_ids.get(request_id, ()):
        if internal.startswith(prefix):
            return internal
    return None
