"""Names of every method in asyncrl.algo, importable without torch.

`asyncrl.config` validates a recipe against these tuples (it must stay cheap to import), and
`asyncrl.algo.recipes` maps each name to its implementation. Keep the two in step: a test checks it.
"""

ADVANTAGES = (
    "reinforce",
    "gae",
    "vapo",
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "batch_norm",
    "maxrl",
)
LOSSES = ("ppo", "cispo", "gspo", "gspo_token", "sapo", "dppo_tv", "dppo_kl", "gvpo", "reinforce")
REDUCTIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm", "prompt_mean")
KL_ESTIMATORS = ("k1", "k2", "k3", "k3_plus")
CORRECTIONS = ("none", "tis", "tis_seq", "mis", "mis_seq", "mis_geo", "icepop", "dis", "decoupled", "bypass", "opsm")

# preset -> its components (advantage, loss, reduction, correction). Numeric defaults live in recipes.py.
PRESET_COMPONENTS = {
    "grpo": dict(advantage="grpo", loss="ppo", reduction="seq_mean_token_mean", correction="none"),
    "dr_grpo": dict(advantage="dr_grpo", loss="ppo", reduction="seq_mean_token_sum_norm", correction="none"),
    "dapo": dict(advantage="grpo", loss="ppo", reduction="token_mean", correction="none"),
    "gspo": dict(advantage="grpo", loss="gspo", reduction="seq_mean_token_mean", correction="none"),
    "sapo": dict(advantage="grpo", loss="sapo", reduction="seq_mean_token_mean", correction="none"),
    "cispo": dict(advantage="batch_norm", loss="cispo", reduction="prompt_mean", correction="none"),
    "scalerl": dict(advantage="batch_norm", loss="cispo", reduction="prompt_mean", correction="none"),
    "dppo": dict(advantage="grpo", loss="dppo_tv", reduction="token_mean", correction="none"),
    "gvpo": dict(advantage="dr_grpo", loss="gvpo", reduction="seq_mean_token_sum", correction="none"),
    "maxrl": dict(advantage="maxrl", loss="ppo", reduction="seq_mean_token_mean", correction="none"),
    "rloo": dict(advantage="rloo", loss="ppo", reduction="seq_mean_token_mean", correction="none"),
    "reinforce_pp": dict(advantage="reinforce_pp", loss="ppo", reduction="token_mean", correction="none"),
    "ppo_gae": dict(advantage="gae", loss="ppo", reduction="token_mean", correction="none"),
    "vapo": dict(advantage="vapo", loss="ppo", reduction="token_mean", correction="none"),
    "sao": dict(advantage="vapo", loss="reinforce", reduction="token_mean", correction="dis"),
}
PRESETS = tuple(PRESET_COMPONENTS)

# preset -> the replay-buffer filters its paper uses, as `buffer.*` field values. `asyncrl.config` makes
# them the defaults of those fields when the preset is chosen; a value the user sets wins.
PRESET_FILTERS = {
    "dapo": {"filter_zero_variance": True},  # dynamic sampling
    "cispo": {"filter_zero_variance": True},
    "scalerl": {"filter_zero_variance": True, "pass_rate_curriculum": True},  # + no-positive-resampling at 0.9
}
