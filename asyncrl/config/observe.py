"""Sections of watching a run: held-out evaluation (`eval`) and telemetry, alarms included (`telemetry`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from asyncrl.cluster.http_guard import DASHBOARD_TOKEN_ENV, beyond_loopback_error, is_loopback, secret
from asyncrl.config.base import Section


class EvalConfig(Section):
    every_steps: int = Field(10, ge=0)
    """Held-out evaluation period in optimizer steps (0 = only at start and end)."""
    temperature: float = Field(0.0, ge=0)
    """Sampling temperature of evaluation (0 = greedy). No top-k / top-p: evaluation samples the policy's
    own distribution."""
    samples: int = Field(1, ge=1, le=1024)
    """Completions per held-out prompt. With k > 1 (needs `temperature` > 0) an evaluation reports mean@k
    (its `accuracy`) and pass@1..k (the unbiased estimator of Chen et al. 2021); a completion passes when
    its reward is >= 1."""
    blocking: bool = False
    """Whether the loop waits for each evaluation. `false`: an evaluation runs on the engines beside the
    rollouts (sharing their slots) while the learner trains on; the weight publications due meanwhile wait
    until it is in, so every request of it runs under the version it started with (the learner's version
    advances all the same: the engines lag as under a slow sync, at most `buffer.max_staleness` versions, and
    the learner waits for the evaluation only when no batch comes without a publication). Its record lands
    steps later, labelled with the step and version it started at. The evaluation before the first
    step (the learner has no batch yet) and the run's last are waited for (a stop drops an evaluation in flight,
    with a note). `true`: the loop waits for each one, and no new rollout group starts meanwhile (those started
    finish): the engines serve the evaluation alone (it ends sooner), and the time the run's clock without
    evaluations (`wall_s_excl_eval`) leaves out starts no rollout for training. The run's last evaluation starts
    no new group either way."""

    @model_validator(mode="after")
    def _samples_need_sampling(self) -> EvalConfig:
        if self.samples > 1 and self.temperature == 0:
            raise ValueError(
                f"eval.samples = {self.samples} needs eval.temperature > 0: "
                "greedy decoding gives the same completion every time"
            )
        return self


class WandbConfig(Section):
    project: str
    """W&B project name."""
    mode: Literal["offline", "online"] = "offline"
    """`offline` writes the run under `<output_dir>/wandb` (upload later with `wandb sync`); `online` streams it."""


AlarmName = Literal["ess_fraction_below", "k3_above", "parity_above", "stale_drops_above", "learner_idle_above"]


class AlarmRule(Section):
    threshold: float
    """The figure's limit."""
    stop: bool = False
    """Crossing it also stops the run cleanly (checkpoint and summary; `stopped_early` names the alarm)."""


class TelemetryConfig(Section):
    log_every_steps: int = Field(1, ge=1)
    """Progress line period in optimizer steps."""
    prometheus_port: int = Field(0, ge=0, le=65535)
    """Serve Prometheus metrics on this port (0 = off)."""
    progress: bool = True
    """Print the progress line to the console."""
    pool_every_s: float = Field(5.0, gt=0)
    """Period of the live queue/engine/throughput snapshot sent to the telemetry sinks (seconds)."""
    dashboard_port: int = Field(8470, ge=0, le=65535)
    """Serve the run's dashboard page on this port (0 = off); when it is taken, a free port is used. The
    address is printed at start; `asyncrl dash RUN_DIR` opens the same page on a finished run."""
    bind_host: str = "127.0.0.1"
    """Address the dashboard and the Prometheus endpoint listen on; 127.0.0.1 keeps them on this machine,
    `0.0.0.0` exposes them to the network (a cluster scraper; the dashboard then needs `dashboard_token`)."""
    dashboard_token: str = ""
    """Secret the dashboard asks of every call (docs/security.md); "" = the environment variable
    ASYNCRL_DASHBOARD_TOKEN, else a fresh random token per run. The address printed at start carries it. Needed
    when `bind_host` is beyond loopback. Prefer the environment variable: a config value is a file's content."""
    tensorboard: bool = False
    """Also write the run's scalars as TensorBoard events under `<output_dir>/tensorboard` (extra `tensorboard`)."""
    wandb: WandbConfig | None = None
    """Also log the run's scalars to Weights & Biases (extra `wandb`): `{project: NAME, mode: offline | online}`;
    offline (the default mode) writes the run under `<output_dir>/wandb`, to upload later with `wandb sync`."""
    rate_window_s: float = Field(30.0, gt=0)
    """Live rates (tokens/s, busy and idle fractions, stale drops) are measured over the snapshots of this
    many recent seconds."""
    alarms: dict[AlarmName, AlarmRule] = Field(default_factory=dict)
    """Alarms, each `{threshold: x, stop: false}` (e.g. `telemetry.alarms.k3_above.threshold=0.01`), checked on
    every step, weight sync and pool snapshot: `ess_fraction_below` (normalised ESS of the step's IS weights
    pi_train / mu), `k3_above` (the step's k3 KL between learner and rollout log-probs), `parity_above` (max
    |engine - learner| log-prob of a probed sync), `stale_drops_above` (fraction of the samples finished in the
    last `rate_window_s` that were dropped as stale), `learner_idle_above` (fraction of the last `rate_window_s`
    the learner waited for data). A crossing logs a warning with the figure and the threshold, sets
    `asyncrl_alarm{name}` to 1 (0 once back within) and, with `stop: true`, ends the run with a checkpoint."""

    @model_validator(mode="after")
    def _exposed_dashboard_needs_a_token(self) -> TelemetryConfig:
        if self.dashboard_port and not is_loopback(self.bind_host) and not self.resolved_dashboard_token():
            key, host = "telemetry.dashboard_token", "telemetry.bind_host"
            raise ValueError(beyond_loopback_error(key, DASHBOARD_TOKEN_ENV, host, self.bind_host))
        return self

    def resolved_dashboard_token(self) -> str:
        """`dashboard_token`, else ASYNCRL_DASHBOARD_TOKEN ("" = the dashboard makes a fresh one)."""
        return secret(self.dashboard_token, DASHBOARD_TOKEN_ENV)
