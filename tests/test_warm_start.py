"""The warm start's length: all `steps`, or until the mean loss of the last steps reaches
`target_loss` (so every seed starts RL from a model as far along)."""

import asyncio
import logging

import pytest
from test_config_keys import _controller, _Endpoint, _no_sync, _Trainer
from test_first_hour import TINY

from torchtitan_rl.config import ConfigError, load_config
from torchtitan_rl.training.trainer_config import TARGET_LOSS_WINDOW, WarmStartConfig


class _Logged:
    def __init__(self):
        self.entries = []

    def log(self, metrics, step):
        self.entries.append((step, dict(metrics)))


def _run_warm_start(tmp_path, losses, *overrides):
    """The controller's warm start against a trainer whose k-th step reports losses[k]."""
    controller = _controller(tmp_path, *overrides)
    trainer, logged = _Trainer(), _Logged()
    trainer.sft_step = _Endpoint()  # `call` records a step before answering it
    calls = trainer.sft_step.calls
    trainer.sft_step.fn = lambda batches, ws: {"warm_start/loss": losses[len(calls) - 1]}
    controller.trainer, controller.metrics, controller.fleet.weight_sync = trainer, logged, _no_sync
    asyncio.run(controller.warm_start())
    return len(calls), logged.entries, trainer.end_warm_start.calls


LOSSES = [2.0 - 0.05 * k for k in range(40)]  # 2.00, 1.95, ... 0.05


def test_reached_target_averages_the_last_window_of_losses():
    ws = WarmStartConfig(steps=100, target_loss=1.0)
    assert TARGET_LOSS_WINDOW == 10
    assert not ws.reached_target([0.5] * 9)  # fewer losses than the window
    assert ws.reached_target([5.0] * 3 + [1.0] * 10)  # only the last 10 count
    assert not ws.reached_target([0.5] * 9 + [5.6])  # mean 1.01
    assert ws.reached_target([0.5] * 9 + [5.5])  # mean 1.0: at or below
    assert not WarmStartConfig(steps=100).reached_target([0.0] * 20)  # 0: no target


@pytest.mark.usefixtures("package_logger_restored")
def test_target_loss_stops_the_warm_start_where_the_mean_loss_reaches_it(tmp_path, caplog):
    # mean of LOSSES[k-10:k] = 2.0 - 0.05 * (k - 5.5): at or below 1.2 from k = 22 on
    logging.getLogger("torchtitan_rl").propagate = True
    with caplog.at_level(logging.WARNING, logger="torchtitan_rl"):
        steps, logged, ended = _run_warm_start(
            tmp_path, LOSSES, "--warm_start.steps=30", "--warm_start.target_loss=1.2"
        )
    assert steps == 22 and len(ended) == 1
    assert [s for s, _ in logged] == [10 - 30, 20 - 30, 22 - 30]
    assert logged[-1][1]["warm_start/steps"] == 22
    assert logged[-1][1]["warm_start/loss"] == pytest.approx(LOSSES[21])
    assert "warm start stopped after 22 of at most 30 steps: mean loss 1.175" in caplog.text


@pytest.mark.usefixtures("package_logger_restored")
def test_without_target_loss_or_out_of_reach_the_warm_start_runs_all_steps(tmp_path, caplog):
    steps, logged, _ = _run_warm_start(
        tmp_path, LOSSES, "--warm_start.steps=30", "--warm_start.target_loss=0"
    )
    assert steps == 30 and logged[-1][0] == 0 and logged[-1][1]["warm_start/steps"] == 30
    logging.getLogger("torchtitan_rl").propagate = True
    with caplog.at_level(logging.WARNING, logger="torchtitan_rl"):
        steps, _, _ = _run_warm_start(
            tmp_path, LOSSES, "--warm_start.steps=30", "--warm_start.target_loss=0.1"
        )
    assert steps == 30
    assert "warm start ran all 30 steps: mean loss 0.775 of the last 10 stayed above" in (
        caplog.text
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--warm_start.target_loss=-1"], "warm_start.target_loss must be finite and >= 0, got -1"),
        (
            ["--warm_start.target_loss=nan"],
            "warm_start.target_loss must be finite and >= 0, got nan",
        ),
    ],
)
def test_target_loss_settings_that_cannot_work_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, overrides)


def test_a_cap_below_the_window_runs_all_steps(tmp_path):
    steps, _, _ = _run_warm_start(
        tmp_path, LOSSES, "--warm_start.steps=5", "--warm_start.target_loss=3"
    )
    assert steps == 5


@pytest.mark.usefixtures("package_logger_restored")
def test_a_random_model_without_a_warm_start_gets_one_warning(tmp_path, caplog):
    logging.getLogger("torchtitan_rl").propagate = True
    with caplog.at_level(logging.WARNING, logger="torchtitan_rl"):
        _run_warm_start(tmp_path, LOSSES, "--warm_start.steps=0")
    assert caplog.text.count("a random-init model starts RL without a warm start") == 1
    assert "env.name='alphabet_sort' has demonstrations" in caplog.text


def test_a_warm_start_over_an_hf_checkpoint_is_said_and_quiet_otherwise():
    from torchtitan_rl.controller.warm_start import warm_start_notice
    from torchtitan_rl.envs import AlphabetSort

    config = load_config(TINY)
    assert warm_start_notice(config, AlphabetSort) is None  # the default job: nothing to say
    config.model.hf_checkpoint = "exported/hf"  # set after loading: no folder check
    assert "model.hf_checkpoint='exported/hf': the warm start still runs (up to " in (
        warm_start_notice(config, AlphabetSort)
    )
    config.lora.rank = 8  # LoRA-SFT by default over a pretrained model
    assert "before RL, training the LoRA adapters only (warm_start.params='auto'); set" in (
        warm_start_notice(config, AlphabetSort)
    )
    config.warm_start.params = "all"
    assert "training every weight (warm_start.params='all')" in (
        warm_start_notice(config, AlphabetSort)
    )
    config.warm_start.steps = 0
    assert warm_start_notice(config, AlphabetSort) is None


def test_a_random_model_and_an_environment_without_demonstrations_is_said():
    """Nothing can warm it up (a verifiers taskset, a plugin without `demonstration`): the
    line names the key that gives RL a model to start from."""
    from hosts_env import EvenTokens

    from torchtitan_rl.controller.warm_start import warm_start_notice

    config = load_config(TINY, ["--warm_start.steps=0", "--env.name=hosts_env:EvenTokens"])
    notice = warm_start_notice(config, EvenTokens)
    assert notice.startswith("a random-init model starts RL without a warm start and will ")
    assert "env.name='hosts_env:EvenTokens' has no demonstrations" in notice
    assert "set model.hf_checkpoint" in notice and "\n" not in notice
    config.model.hf_checkpoint = "exported/hf"  # a model to start from: nothing to say
    assert warm_start_notice(config, EvenTokens) is None


@pytest.mark.parametrize("changed", [True, False])
def test_the_weight_sync_reopens_when_the_warm_start_changed_the_lora_base(tmp_path, changed):
    """`warm_start.params = "all"` with [lora]: the trainer answers end_warm_start with
    True, and the sync reopens (generators get the new base) before the weights go out."""
    controller = _controller(tmp_path, "--warm_start.steps=2")
    trainer, events = _Trainer(), []
    trainer.end_warm_start = _Endpoint(lambda: changed)

    async def reopen():
        events.append("open")

    class _Sync:
        version = None

        async def __call__(self):
            events.append("sync")
            return 0.0

    controller.trainer, controller.metrics, controller.fleet.weight_sync = (
        trainer, _Logged(), _Sync(),
    )  # fmt: skip
    controller.fleet.open_weight_sync = reopen
    asyncio.run(controller.warm_start())
    assert events == (["open", "sync"] if changed else ["sync"])
