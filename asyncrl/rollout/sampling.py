"""How a request is sampled (`SamplingSpec`), what an evaluation returns (`EvalResult`), and their translation
to and from vLLM's sampling parameters and finish reasons: the engine's vocabulary, shared by the rollout worker,
the episode runner and the OpenAI endpoint; and the engine's records of the samples it is generating.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncrl.types import FinishReason, Request

__all__ = [
    "GREEDY_BELOW",
    "EvalResult",
    "Member",
    "SamplingSpec",
    "Stream",
    "finish_reason",
    "shared_spec",
    "vllm_sampling_params",
]

GREEDY_BELOW = 1e-5
"""vLLM samples greedily below this temperature (and then refuses `n > 1`)."""


@dataclass(frozen=True)
class SamplingSpec:
    """How one request is sampled. `temperature`/`top_p`/`top_k` define the distribution the rollout
    log-probs refer to (the learner must divide logits by the same `temperature`)."""

    max_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 = no top-k."""
    timeout_s: float | None = None
    """Abort the request after this many seconds; its trajectory comes back `failure="timeout: ..."`."""
    ignore_eos: bool = False
    """Keep generating past end-of-sequence (benchmarks and tests that need long requests)."""
    seed: int | None = None
    stream_interval: int = 16
    """A running request reports its new tokens every this many tokens, and always its first and last ones
    (vLLM `SamplingParams.stream_interval`): fewer wake-ups of the worker per request. The first token's
    report is what `Engine.abort_stale` needs; `Engine.progress` advances in these steps."""
    stop: tuple[str, ...] = ()
    """Strings that end the generation (a tool call's close marker, the OpenAI endpoint's `stop`). The tokens
    sampled up to and including the one that completed the string stay in the trajectory exactly as sampled
    (`include_stop_str_in_output`); vLLM detokenizes only requests that have stop strings."""
    top_logprobs: int = 0
    """Alternatives reported per position (`generate(..., top_logprobs=...)`); 0 = only the sampled token."""

    @classmethod
    def from_rollout_config(cls, rollout: Any) -> SamplingSpec:
        return cls(
            max_tokens=rollout.max_tokens,
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            timeout_s=rollout.request_timeout_s,
        )


@dataclass(frozen=True)
class EvalResult:
    """One held-out prompt's completions and every policy version its requests ran under: the engine's
    version when each was submitted and the per-token versions vLLM reports. More than one version means
    the evaluation straddled a weight update; the caller must not credit it to a single version."""

    texts: tuple[str, ...]
    finish_reasons: tuple[str, ...]
    """One per completion, aligned with `texts`."""
    versions: frozenset[int]


@dataclass(eq=False)
class Member:
    """One sample being generated (`engine.Engine.generate`): completion `index` of a vLLM request (`Stream`) of one or
    more samples, and what came back for it."""

    request: Request
    top: list[dict[int, float]] | None = None
    top_k: int = 0
    index: int = 0
    stream: Stream | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    spans: Any = None
    routes: Any = None
    """The experts vLLM routed the sample's tokens to (`vllm_compat.routed_experts`), from its final output."""
    finish_reason: FinishReason = "abort"
    error: str | None = None
    first_version: int | None = None
    """The engine's version when the first token came back."""
    left: bool = False
    """The caller was cancelled."""
    on_tokens: Callable[[list[int], list[float]], None] | None = None
    """Told each batch of newly sampled tokens and their log-probs as vLLM hands it over (a streamed response)."""
    done: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    @property
    def oldest_version(self) -> int | None:
        """The oldest policy version the sample's trajectory will carry: the first token's, or, for a later call
        of a multi-turn episode, the episode's oldest model token (`Request.context_min_version`) when older.
        None while neither is known."""
        known = [v for v in (self.first_version, self.request.context_min_version) if v is not None]
        return min(known) if known else None


@dataclass(eq=False)
class Stream:
    """One vLLM request and the members it samples (completion index i -> `members[i]`)."""

    vllm_id: str
    members: list[Member]
    task: asyncio.Task | None = None


def vllm_sampling_params(
    spec: SamplingSpec,
    *,
    logprobs: int | None = 0,
    prompt_logprobs: int | None = None,
    logprob_token_ids: list[int] | None = None,
    flat: bool = False,
    n: int = 1,
) -> Any:
    """Fresh `SamplingParams` for exactly one request of `n` samples (vLLM keeps the object: never pass it
    twice). `flat`: log-probs in vLLM's flat lists (`vllm_compat.sampled_logprobs` reads them) instead of a
    dict and a `Logprob` object per token."""
    # From the submodule: `from vllm import ...` runs vLLM's lazy module `__getattr__` (an import) per call.
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    return SamplingParams(
        n=n,
        max_tokens=spec.max_tokens,
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k,
        ignore_eos=spec.ignore_eos,
        seed=spec.seed,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        stop=list(spec.stop) or None,
        include_stop_str_in_output=True,
        logprob_token_ids=logprob_token_ids,
        detokenize=bool(spec.stop),  # vLLM matches stop strings on detokenized text only
        skip_special_tokens=True,
        output_kind=RequestOutputKind.DELTA,
        stream_interval=spec.stream_interval,
        # Every call site builds its params for one request and never reuses them, so vLLM may keep this
        # object instead of deep-copying it per request (vLLM 0.32 `skip_clone`: ~80 us of the worker's
        # CPU per request on this loaded 2-core machine).
        skip_clone=True,
        flat_logprobs=flat,
    )


@functools.lru_cache(maxsize=64)
def shared_spec(sampling: SamplingSpec) -> SamplingSpec:
    """The sampling a group's shared request runs with: the members' own without its timeout (each member keeps
    its own). Cached: a run has a handful of specs, and `dataclasses.replace` per sample showed in profiles."""
    return sampling if sampling.timeout_s is None else dataclasses.replace(sampling, timeout_s=None)


_VLLM_FINISH_REASONS: dict[str | None, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


def finish_reason(reason: str | None) -> FinishReason:
    """vLLM reports stop (EOS or stop string), length or abort; anything else is an error."""
    return _VLLM_FINISH_REASONS.get(reason, "error")
