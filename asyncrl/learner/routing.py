"""MoE routing replay (R3, "Rollout Routing Replay"): the learner's MoE layers route each token to the experts the
rollout engine chose for it, instead of their own top-k, so that a near-tie in the router logits that falls the
other way on the learner (float rounding differs between vLLM's fused MoE and a transformers forward) does not
score a token with a different sub-network from the one that sampled it.

The gate weights stay differentiable: for a replayed token the learner's own router logits are soft-maxed (in fp32,
as the Hugging Face router does) and gathered at the replayed experts, then renormalised over them when the family
does (`norm_topk_prob`; Mixtral always), so gradients still reach the router. With the routes the learner would
have chosen itself, the replayed forward equals the normal one exactly.

Routes: int [B, L, num_moe_layers, top_k] expert ids in the learner batch's layout (row b, sequence position t;
`TrainBatch.routed_experts`), MoE layers numbered in the order of `model.layers`; a row of -1 means "no route
recorded" and takes the learner's own top-k (padding, the last token of a sequence, which vLLM never forwards,
or trajectories without routes).

Supported routers (transformers 5.x): `Qwen3MoeTopKRouter` and `MixtralTopKRouter`, whose forward maps flattened
hidden states [B*L, H] to (router logits, top-k weights, top-k indices).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ROUTER_CLASSES",
    "RouteRecorder",
    "moe_routers",
    "replaying",
    "route_shape",
]

ROUTER_CLASSES = ("Qwen3MoeTopKRouter", "MixtralTopKRouter")
"""Router classes whose top-k the replay replaces (by class name: the modules come from transformers)."""
_CASTS_SCORES = {"Qwen3MoeTopKRouter": True, "MixtralTopKRouter": False}
"""Whether the family's router casts its top-k weights back to the logits' dtype (Mixtral keeps them fp32)."""


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The supported MoE routers of `model`, in module order (= decoder layer order)."""
    return [m for m in model.modules() if type(m).__name__ in ROUTER_CLASSES]


def route_shape(model: nn.Module) -> tuple[int, int]:
    """(MoE layers, experts per token) of `model`; ValueError naming the model's class when it has no
    supported MoE router."""
    routers = moe_routers(model)
    if not routers:
        raise ValueError(
            f"routing replay: {type(model).__name__} has no MoE router of a supported family"
            f" ({', '.join(ROUTER_CLASSES)})"
        )
    first: Any = routers[0]  # a transformers router (`ROUTER_CLASSES`)
    return len(routers), int(first.top_k)


@contextlib.contextmanager
def replaying(model: nn.Module, routes: torch.Tensor | None) -> Iterator[None]:
    """Within the block, `model`'s forward routes each token as `routes` says ([B, L, layers, top_k], -1 = own
    choice); `routes` None leaves the model as it is. The routers' forwards are wrapped on first use."""
    if routes is None:
        yield
        return
    routers = moe_routers(model)
    if routes.dim() != 4 or routes.shape[2] != len(routers) or (routers and routes.shape[3] != routers[0].top_k):
        raise ValueError(
            f"routing replay: routes of shape {tuple(routes.shape)} do not fit {type(model).__name__}"
            f" ([B, L, {len(routers)} MoE layers, top_k {routers[0].top_k if routers else '?'}] expected)"
        )
    flat = routes.reshape(-1, routes.shape[2], routes.shape[3]).long()
    for layer, router in enumerate(routers):
        _install(router)
        router.__dict__["_asyncrl_routes"] = flat[:, layer]
    try:
        yield
    finally:
        for router in routers:
            router.__dict__.pop("_asyncrl_routes", None)


class RouteRecorder:
    """Records the experts each MoE router of `model` chooses (tests, benchmarks): `routes()` gives them as
    int64 [B, L, layers, top_k] for the last forward of a [B, L] batch."""

    def __init__(self, model: nn.Module) -> None:
        self._routers = moe_routers(model)
        self._seen: dict[int, torch.Tensor] = {}
        self._handles = [r.register_forward_hook(functools.partial(self._hook, i)) for i, r in enumerate(self._routers)]

    def _hook(self, layer: int, _module: nn.Module, _args, output) -> None:
        self._seen[layer] = output[2].detach().clone()

    def routes(self, batch: int, length: int) -> torch.Tensor:
        per_layer = [self._seen[i].reshape(batch, length, -1) for i in range(len(self._routers))]
        return torch.stack(per_layer, dim=2)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def _install(router: nn.Module) -> None:
    if "_asyncrl_own_forward" in router.__dict__:
        return
    router.__dict__["_asyncrl_own_forward"] = router.forward
    router.forward = functools.partial(_routed_forward, router)


def _routed_forward(router: Any, hidden_states: torch.Tensor):
    """The router's forward with the replayed experts where a route is set (see the module docstring)."""
    routes = router.__dict__.get("_asyncrl_routes")
    if routes is None:
        return router.__dict__["_asyncrl_own_forward"](hidden_states)
    hidden_states = hidden_states.reshape(-1, router.hidden_dim)
    if routes.shape[0] != hidden_states.shape[0]:
        raise ValueError(f"routing replay: {routes.shape[0]} routed tokens for a batch of {hidden_states.shape[0]}")
    logits = F.linear(hidden_states, router.weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    own = torch.topk(probs, router.top_k, dim=-1).indices
    replayed = routes.to(own.device)
    indices = torch.where(replayed[:, :1] >= 0, replayed, own)
    weights = probs.gather(-1, indices)
    if getattr(router, "norm_topk_prob", True):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if _CASTS_SCORES[type(router).__name__]:
        weights = weights.to(logits.dtype)
    return logits, weights, indices
