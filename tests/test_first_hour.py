"""What a new user hears: settings that cannot work stop before any process starts, rollout
errors come with their text and traceback, and degenerate runs get one warning."""

import asyncio
import logging
from pathlib import Path

import pytest
from fakes import FakeEnvironment, FakeRenderer, ScriptedEnv, always, done

from torchtitan_rl.config import ConfigError, load_config
from torchtitan_rl.config.job import ParallelismConfig
from torchtitan_rl.controller.diagnostics import StepDiagnostics
from torchtitan_rl.controller.loop import Controller
from torchtitan_rl.controller.placement import Placement, plan
from torchtitan_rl.envs.base import EnvConfig
from torchtitan_rl.rollout.records import read_records, write_step_records
from torchtitan_rl.rollout.rollout_config import RolloutConfig
from torchtitan_rl.rollout.rollouter import Rollouter
from torchtitan_rl.types import Rollout, RolloutGroup, RolloutStatus

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "train_configs" / "alphabet_sort_tiny.toml"


def test_group_size_one_is_a_config_error():
    with pytest.raises(ConfigError, match=r"rollout.group_size=1.*>= 2"):
        load_config(TINY, ["--rollout.group_size=1"])


@pytest.mark.usefixtures("package_logger_restored")
def test_more_trainer_processes_than_gpus_stops_before_any_process(tmp_path, monkeypatch, capsys):
    from torchtitan_rl.train import main

    monkeypatch.setenv("CONFIG_FILE", str(TINY))  # trainer_procs = 2, device = "auto"
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    assert load_config(TINY, []).parallelism.trainer_procs == 2  # loading a config is fine
    assert main([f"--job.output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "parallelism.trainer_procs=2 needs one GPU per trainer process" in err
    assert "Traceback" not in err and not any(tmp_path.iterdir())
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)
    assert main([f"--job.output_dir={tmp_path}", "--parallelism.device=cuda"]) == 2
    assert 'device = "cuda", but no CUDA device is visible' in capsys.readouterr().err
    assert plan(ParallelismConfig(trainer_procs=2, device="cpu"), 4) == Placement()  # CPU: any


def test_demonstrations_that_never_fit_a_row_stop_before_any_process(tmp_path):
    config = load_config(TINY, ["--batcher.seq_len=32", f"--job.output_dir={tmp_path}"])
    with pytest.raises(ValueError, match=r"batcher.seq_len=32 fits episodes of up to 33 tokens"):
        Controller(config, use_tqdm=False)
    assert not any(tmp_path.iterdir())  # nothing written, nothing spawned


def test_demonstrations_longer_than_max_tokens_get_one_warning(tmp_path, caplog):
    countdown = ROOT / "train_configs" / "countdown_tiny.toml"
    shown = [
        "--env.args.show_work=true",
        "--validation.max_tokens=40",
        f"--job.output_dir={tmp_path}",
    ]
    with caplog.at_level(logging.WARNING):
        Controller(load_config(countdown, [*shown, "--rollout.max_tokens=24"]), use_tqdm=False)
    assert "warm-start demonstrations have an assistant turn longer than rollout.max_tokens=24" in (
        caplog.text
    )
    assert "validation.max_tokens" not in caplog.text  # 40 fits every demonstration
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        Controller(load_config(countdown, [*shown, "--rollout.max_tokens=40"]), use_tqdm=False)
    assert "longer than" not in caplog.text


def _raising_reward_rollouts():
    def reward(rollout):
        return rollout.turns[0].reward_signals["missing"]  # KeyError on every rollout

    env = FakeEnvironment(lambda s: ScriptedEnv([done()]), reward)
    rollouter = Rollouter(
        env, FakeRenderer(), EnvConfig(), RolloutConfig(group_size=2, prompts_per_step=2), seed=0
    )
    return asyncio.run(rollouter.collect_batch(1, 0, always("hi")))


def test_reward_errors_are_reported_with_their_text_and_traceback(tmp_path, caplog):
    batch = _raising_reward_rollouts()
    # no spread: every group filtered, 2 then the rest of the (1 + 4) * 2 groups' budget
    assert batch.groups == [] and len(batch.filtered) == 10
    diagnostics = StepDiagnostics(tmp_path, EnvConfig(), max_tokens=8)
    with caplog.at_level(logging.WARNING):
        diagnostics.report(1, batch.filtered)
    assert "step 1: 20 of 20 rollouts error_reward, first: KeyError: 'missing'" in caplog.text
    log = (tmp_path / "errors.log").read_text()
    assert "Traceback" in log and 'reward_signals["missing"]' in log


def test_errored_groups_stay_in_the_records(tmp_path):
    batch = _raising_reward_rollouts()
    path = write_step_records(tmp_path, 1, batch.groups, filtered=batch.filtered)
    records = read_records(path)
    assert len(records) == 10 and {r["pick"] for r in records} == {"filtered-error"}
    assert records[0]["status"] == "error_reward" and "KeyError" in records[0]["error"]


def _rollouts(statuses):
    return [
        RolloutGroup(
            group_id=0,
            rollouts=[
                Rollout(group_id=0, rollout_id=i, session_id=str(i), sample={}, status=s)
                for i, s in enumerate(statuses)
            ],
        )
    ]


def test_a_run_mostly_truncated_by_max_turns_warns_once(tmp_path, caplog):
    diagnostics = StepDiagnostics(tmp_path, EnvConfig(max_turns=1), max_tokens=8)
    mostly = [RolloutStatus.TRUNCATED_TURNS] * 3 + [RolloutStatus.COMPLETED]
    with caplog.at_level(logging.WARNING):
        diagnostics.report(1, _rollouts(mostly))
        diagnostics.report(2, _rollouts(mostly))
        diagnostics.report(3, _rollouts([RolloutStatus.TRUNCATED_LENGTH] * 4), training=False)
    assert caplog.text.count("raise env.max_turns") == 1
    assert "step 1: 75% of rollouts ended truncated_turns: env.max_turns=1" in caplog.text
    assert "truncated_length" not in caplog.text  # validation truncates by its own limits


def _run_with_checkpoint(tmp_path, step, *overrides):
    """A run folder holding one complete checkpoint of RL step `step`, saved with the tiny
    config plus `overrides`."""
    from torchtitan_rl.config import to_toml
    from torchtitan_rl.controller.checkpoints import CheckpointStore, ControllerState

    saved = load_config(TINY, [f"--job.output_dir={tmp_path}", *overrides])
    store = CheckpointStore(tmp_path / saved.job.run_name, keep_latest=2)
    state = ControllerState.capture(
        step=step, next_sample=0, last_validation=float("nan"), history={}
    )
    store.commit(store.begin(step), step, state, to_toml(saved))


def test_resume_lists_what_changed_and_refuses_another_model(tmp_path):
    _run_with_checkpoint(tmp_path, 3)
    config = load_config(TINY, [f"--job.output_dir={tmp_path}", "--training.lr=0.0001"])
    controller = Controller(config, use_tqdm=False)
    assert controller.folder.completed_step() == 3
    assert controller.folder.check_resume() == ["training.lr: 0.0004 -> 0.0001"]
    other = load_config(TINY, [f"--job.output_dir={tmp_path}", "--model.flavor=small"])
    with pytest.raises(ValueError, match=r"cannot resume .* changed model.flavor: 'tiny' -> "):
        Controller(other, use_tqdm=False).folder.check_resume()
    assert not (tmp_path / config.job.run_name / "config.toml").exists()  # nothing rewritten
    lora = load_config(TINY, [f"--job.output_dir={tmp_path}", "--lora.rank=8"])
    with pytest.raises(ValueError, match=r"cannot resume .* changed lora.rank: 0 -> 8: the "):
        Controller(lora, use_tqdm=False).folder.check_resume()


@pytest.mark.parametrize(
    "change, refused",
    [
        ("--lora.alpha=16", True),
        ('--lora.target_modules=["q_proj"]', True),
        ("--lora.dropout=0.1", False),
        ("--lora.vllm_sync=adapters", False),
        ("--lora.generator_base=host", False),
    ],
)
def test_a_lora_run_resumes_with_another_delivery_but_not_other_adapters(tmp_path, change, refused):
    """A LoRA checkpoint's adapters have their rank, scale and targets; how generators get
    them (vllm_sync, generator_base) and the training-time dropout shape no weight."""
    _run_with_checkpoint(tmp_path, 3, "--lora.rank=8")
    config = load_config(TINY, [f"--job.output_dir={tmp_path}", "--lora.rank=8", change])
    key = change[2:].split("=")[0]
    if refused:
        with pytest.raises(ValueError, match=rf"cannot resume .* changed {key}: .*: the "):
            Controller(config, use_tqdm=False).folder.check_resume()
    else:
        assert [
            c.split(":")[0] for c in Controller(config, use_tqdm=False).folder.check_resume()
        ] == [key]


@pytest.mark.usefixtures("package_logger_restored")
def test_another_environment_does_not_resume_this_ones_run(tmp_path, monkeypatch, capsys):
    """`--env.name=countdown` where the default job ran would train Countdown on the
    AlphabetSort policy, warm start skipped, in the same curves: refused in one line."""
    from torchtitan_rl.train import main

    _run_with_checkpoint(tmp_path, 3)
    run_dir = tmp_path / load_config(TINY, []).job.run_name
    before = sorted(p.name for p in run_dir.rglob("*"))
    monkeypatch.setenv("CONFIG_FILE", str(TINY))
    assert main([f"--job.output_dir={tmp_path}", "--env.name=countdown"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "changed env.name: 'alphabet_sort' -> 'countdown'" in err[0], err
    assert "use a new job.run_name" in err[0]
    assert sorted(p.name for p in run_dir.rglob("*")) == before  # nothing written


def test_a_finished_run_is_complete_before_anything_starts(tmp_path):
    _run_with_checkpoint(tmp_path, 800)
    controller = Controller(load_config(TINY, [f"--job.output_dir={tmp_path}"]), use_tqdm=False)
    assert controller.folder.completed_step() == controller.config.training.last_step == 800


def test_tensorboard_opens_a_dashboard_of_the_main_curves(tmp_path):
    from tensorboard.backend.event_processing import event_file_loader

    from torchtitan_rl.controller.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path)
    logger.log({"rollout_reward/mean": 0.5}, 1)
    logger.close()
    tags = {
        value.tag: value.metadata.plugin_data.plugin_name
        for path in (tmp_path / "tb").iterdir()
        for event in event_file_loader.EventFileLoader(str(path)).Load()
        for value in event.summary.value
    }
    assert tags["custom_scalars__config__"] == "custom_scalars"
    assert "rollout_reward/mean" in tags


def test_an_interrupt_says_whether_the_same_command_resumes(tmp_path):
    from torchtitan_rl.train import _resume_hint

    config = load_config(TINY, [f"--job.output_dir={tmp_path}"])
    assert "no checkpoint yet (checkpoint.interval=100)" in _resume_hint(
        Controller(config, use_tqdm=False)
    )
    _run_with_checkpoint(tmp_path, 3)
    assert "resumes after RL step 3" in _resume_hint(Controller(config, use_tqdm=False))


@pytest.mark.parametrize(("max_error_steps", "stops_at"), [(2, 4), (3, 5), (0, None)])
def test_max_error_steps_stops_a_run_whose_rollouts_all_error(
    tmp_path, capsys, max_error_steps, stops_at
):
    from torchtitan_rl.controller.diagnostics import RunCannotLearn
    from torchtitan_rl.train import _fail

    overrides = [f"--job.output_dir={tmp_path}", f"--rollout.max_error_steps={max_error_steps}"]
    controller = Controller(load_config(TINY, overrides), use_tqdm=False)
    controller.run_dir.mkdir()
    diagnostics = controller.diagnostics
    error, ok = RolloutStatus.ERROR_REWARD, RolloutStatus.COMPLETED
    steps = {1: [error] * 4, 2: [error, ok], 3: [error] * 4, 4: [error] * 4, 5: [error] * 4}
    stopped = None
    for step, statuses in steps.items():
        try:
            diagnostics.report(step, _rollouts(statuses))
        except RunCannotLearn as e:
            stopped = step
            assert _fail(e, debug=False, code=1) == 1
            break
    assert stopped == stops_at  # step 2 had a valid rollout: the count starts again
    if stops_at:
        line = capsys.readouterr().err
        assert line.count("\n") == 1 and "--debug" not in line
        assert line.startswith(f"error: every rollout errored (error_reward) in {max_error_steps}")
        assert f"(rollout.max_error_steps={max_error_steps})" in line


def test_the_dashboard_charts_validation_rubric_async_and_warm_start_apart():
    import re

    from torchtitan_rl.controller.metrics import DASHBOARD

    charts = {
        f"{category}/{title}": patterns
        for category, chart in DASHBOARD.items()
        for title, (_, patterns) in chart.items()
    }

    def charted(tag):
        return [name for name, pats in charts.items() if any(re.fullmatch(p, tag) for p in pats)]

    assert charted("rollout_reward/mean") == ["learning/reward (sampled rollouts)"]
    assert charted("validation_reward/mean") == ["learning/validation (greedy, held-out)"]
    assert charted("validation_reward/sort_score") == ["learning/validation (greedy, held-out)"]
    assert charted("rollout_reward/sort_score/mean") == [
        "learning/rubric functions (sampled rollouts)"
    ]
    assert charted("rollout_reward/sort_score/std") == []
    # the README's curves to read first are all charted
    assert charted("rollout_reward/zero_std_frac") == ["learning/groups that teach nothing (share)"]
    assert charted("rollout/status/error") == ["rollouts/status"]
    for tag in ("rollout/staleness/mean", "rollout/staleness/max", "perf/trainer_wait_seconds",
                "perf/generator_wait_seconds"):  # fmt: skip
        assert len(charted(tag)) == 1, tag
    # ratios near 1 chart as a flat 1: the off-policy chart shows |log ratio| instead
    log_ratio_tags = ("loss/log_ratio/abs_mean", "loss/log_ratio/abs_max",
                      "correction/log_ratio/abs_mean", "correction/log_ratio/abs_max")  # fmt: skip
    for tag in log_ratio_tags:
        assert charted(tag) == ["off-policy/|log ratio| (0 = same policy)"], tag
    assert charted("loss/ratio_mean") == charted("correction/ratio_max") == []
    # the warm start (steps <= 0) never shares a chart with RL's steps
    warm = [name for name in charts if any(p.startswith("warm_start/") for p in charts[name])]
    assert all(name.startswith("warm start/") for name in warm)
    assert not any(
        p.startswith("warm_start/") for n, ps in charts.items() if n not in warm for p in ps
    )


@pytest.mark.usefixtures("package_logger_restored")
def test_nothing_to_train_on_is_said_once_not_every_step(tmp_path, caplog):
    diagnostics = StepDiagnostics(tmp_path, EnvConfig(), max_tokens=8)
    logging.getLogger("torchtitan_rl").propagate = True
    with caplog.at_level(logging.WARNING, logger="torchtitan_rl"):
        errored = _rollouts([RolloutStatus.ERROR_ENV] * 2)
        diagnostics.report_nothing_to_train(2, errored)  # its error line says why
        for step in (3, 4, 7):
            diagnostics.report_nothing_to_train(step, [])
    assert caplog.text.count("nothing to train on") == 1
    assert "step 3: nothing to train on" in caplog.text


@pytest.mark.usefixtures("package_logger_restored")
def test_a_step_whose_groups_were_all_too_stale_says_so_not_no_spread(tmp_path, caplog):
    diagnostics = StepDiagnostics(tmp_path, EnvConfig(), max_tokens=8, max_staleness=1)
    logging.getLogger("torchtitan_rl").propagate = True
    stale = _rollouts([RolloutStatus.COMPLETED] * 3) + _rollouts([RolloutStatus.COMPLETED] * 3)
    with caplog.at_level(logging.WARNING, logger="torchtitan_rl"):
        diagnostics.report_nothing_to_train(2, stale, stale)
        diagnostics.report_nothing_to_train(3, stale, stale)  # said once
        diagnostics.report_nothing_to_train(4, [])  # another reason: said too
    assert caplog.text.count("too stale") == 1
    assert (
        "step 2: nothing to train on (all 2 groups were too stale: rollout/dropped_stale = 6 "
        "rollouts with a token more than rollout.max_staleness=1 versions old" in caplog.text
    )
    assert caplog.text.count("no group had reward spread") == 1
    assert "step 4: nothing to train on (no group had reward spread)" in caplog.text
