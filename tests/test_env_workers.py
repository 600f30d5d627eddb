"""env.workers: environment turns (with their tokenizing) and scoring in worker processes
(rollout/env_workers.py).

Worker processes give the same rollouts as the event loop (tokens, rewards, error lines),
tokenize each turn themselves, keep the loop serving while a step holds its thread, time out
and kill a stuck step without holding up the others, and leave nothing running after close."""

import asyncio
import json
import logging
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fake_renderer import (
    IM_END,
    STUCK,
    UNCLOSABLE,
    UNDECODABLE,
    BreaksLaterRenderer,
    DiesParsingRenderer,
    FussyRenderer,
    HangsParsingRenderer,
    PickyRenderer,
    StopCheckRaisesRenderer,
    WhereRenderer,
)
from fakes import FakeRenderer, ScriptedGenerate, make_completion
from pool_envs import (
    PLANS,
    BigStateEnvironment,
    PlanEnvironment,
    RelayEnvironment,
    WaitingEnvironment,
)

from torchtitan_rl.envs.alphabet_sort import AlphabetSort, gold_reply
from torchtitan_rl.envs.base import EnvConfig
from torchtitan_rl.models.renderer import Renderer
from torchtitan_rl.models.tokenizer import Tokenizer
from torchtitan_rl.rollout import env_workers
from torchtitan_rl.rollout.rollout_config import RolloutConfig
from torchtitan_rl.rollout.rollouter import Rollouter
from torchtitan_rl.types import FinishReason, RolloutStatus

SAME_EVERYWHERE = [p for p in PLANS if p not in ("step_blocks", "step_exits")]
"""Plans the event loop survives too (a blocking step would hold it, an exit would end it)."""


def rollouter_for(environment, env_config, renderer=None, **rollout):
    config = RolloutConfig(**{"group_size": 2, "filter_zero_std_groups": False, **rollout})
    return Rollouter(environment, renderer or FakeRenderer(), env_config, config, seed=3)


def collect(rollouter, generate, prompts):
    async def go():
        try:
            return await rollouter.collect_batch(0, 0, generate, draw=lambda n: prompts)
        finally:
            rollouter.close()

    return asyncio.run(go()).sampled()


def alphabet_reply(environment):
    """Gold, the names reversed, or no answer, by the request's seed: rewards spread over [0, 1]."""

    def respond(call):
        group = int(call.session_id.split("/group=")[1].split("/")[0])
        turn = int(call.request_id.rsplit("=", 1)[1])
        gold = gold_reply(environment.train_sample(group), turn)
        first, *names, last = gold.split("\n")
        kind = call.sampling.seed % 3
        return gold if kind == 0 else "\n".join([first, *names[::-1], last]) if kind else "?"

    return ScriptedGenerate(respond)


@pytest.mark.parametrize("workers", [1, 2])
def test_workers_leave_seeded_rollouts_unchanged(workers):
    def run(workers):
        env_config = EnvConfig(max_turns=3, max_rollout_tokens=4000, workers=workers)
        environment = AlphabetSort(env_config, seed=5)
        generate = alphabet_reply(environment)
        rollouter = rollouter_for(environment, env_config, group_size=3, prompts_per_step=4)
        groups = collect(rollouter, generate, list(range(4)))
        return [r for g in groups for r in g.rollouts], [c.prompt_ids for c in generate.calls]

    (reference, ref_prompts), (rollouts, prompts) = run(0), run(workers)
    assert len(rollouts) == 12 and len({r.reward for r in rollouts}) > 3
    for a, b in zip(reference, rollouts, strict=True):
        assert (a.session_id, a.status, a.reward, a.reward_breakdown) == (
            b.session_id, b.status, b.reward, b.reward_breakdown,
        )  # fmt: skip
        assert a.messages == b.messages and len(a.turns) == len(b.turns) == 3
        for s, t in zip(a.turns, b.turns, strict=True):
            assert np.array_equal(s.prompt_ids, t.prompt_ids)
            assert np.array_equal(s.completion.token_ids_N, t.completion.token_ids_N)
            assert s.reward_signals == t.reward_signals
    assert sorted(map(bytes, ref_prompts)) == sorted(map(bytes, prompts))


def test_turns_in_workers_give_the_loops_tokens_with_the_real_tokenizer():
    """Replies closed by <|im_end|>, ended without it (a stop text), cut by max_tokens or not
    answering; a token budget that ends some rollouts at their next prompt."""
    renderer = Renderer(Tokenizer.from_file(None))
    tokenizer = renderer.tokenizer

    def run(workers):
        env_config = EnvConfig(max_turns=3, max_rollout_tokens=150, workers=workers)
        environment = AlphabetSort(env_config, seed=5)

        def respond(call):
            group = int(call.session_id.split("/group=")[1].split("/")[0])
            turn = int(call.request_id.rsplit("=", 1)[1])
            ids = tokenizer.encode(gold_reply(environment.train_sample(group), turn))
            ids, finish = {
                0: ([*ids, tokenizer.im_end_id], FinishReason.STOP),
                1: (ids, FinishReason.STOP),
                2: (ids[: len(ids) // 2], FinishReason.LENGTH),
                3: ([*tokenizer.encode("?"), tokenizer.im_end_id], FinishReason.STOP),
            }[call.sampling.seed % 4]
            return make_completion(ids, request_id=call.request_id, finish_reason=finish)

        generate = ScriptedGenerate(respond)
        rollouter = rollouter_for(
            environment, env_config, renderer, group_size=4, prompts_per_step=6, max_tokens=400
        )
        groups = collect(rollouter, generate, list(range(6)))
        calls = {c.request_id: c.prompt_ids for c in generate.calls}
        return [r for g in groups for r in g.rollouts], calls

    (reference, ref_calls), (rollouts, calls) = run(0), run(2)
    assert {r.status for r in rollouts} == {
        RolloutStatus.COMPLETED, RolloutStatus.TRUNCATED_LENGTH, RolloutStatus.TRUNCATED_PROMPT
    }  # fmt: skip
    assert len({r.reward for r in rollouts}) > 3
    for a, b in zip(reference, rollouts, strict=True):
        assert (a.session_id, a.status, a.error, a.reward, a.reward_breakdown) == (
            b.session_id, b.status, b.error, b.reward, b.reward_breakdown,
        )  # fmt: skip
        assert a.messages == b.messages and len(a.turns) == len(b.turns)
        for s, t in zip(a.turns, b.turns, strict=True):
            assert s.prompt_ids.dtype == t.prompt_ids.dtype == np.int32
            assert np.array_equal(s.prompt_ids, t.prompt_ids)
            assert (s.assistant_text, s.env_messages) == (t.assistant_text, t.env_messages)
            assert s.reward_signals == t.reward_signals
    assert ref_calls.keys() == calls.keys()
    assert all(np.array_equal(ref_calls[k], calls[k]) for k in calls)


def test_workers_tokenize_the_turns_and_the_loop_does_not(tmp_path):
    def pids(workers):
        folder = tmp_path / str(workers)
        folder.mkdir()
        env_config = EnvConfig(max_turns=4, max_rollout_tokens=1000, workers=workers)
        renderer = WhereRenderer(str(folder))
        environment = PlanEnvironment(env_config, seed=0)
        rollouter = rollouter_for(environment, env_config, renderer, prompts_per_step=2)
        groups = collect(rollouter, ScriptedGenerate(lambda call: "ok"), [0, 0])
        assert all(r.status is RolloutStatus.COMPLETED for g in groups for r in g.rollouts)
        return renderer.pids()

    methods = {"render_prompt", "parse_completion", "render_continuation"}
    on_loop, in_workers = pids(0), pids(2)
    assert on_loop == {m: {os.getpid()} for m in methods}
    assert in_workers.keys() == methods
    assert all(os.getpid() not in p for p in in_workers.values())


def test_an_unparsable_completion_and_the_turn_limit_end_rollouts_alike_in_workers():
    def outcomes(workers):
        env_config = EnvConfig(max_turns=2, max_rollout_tokens=1000, workers=workers)
        environment = PlanEnvironment(env_config, seed=0)
        rollouter = rollouter_for(environment, env_config, PickyRenderer(), prompts_per_step=1)

        def respond(call):  # the second turn of rollout 1 cannot be parsed
            bad = call.request_id.endswith("rollout=1/turn=1")
            return make_completion([111, 107, 300 if bad else 257], request_id=call.request_id)

        rollouts = collect(rollouter, ScriptedGenerate(respond), [0])[0].rollouts
        return [(r.status, r.error, r.messages, len(r.turns), r.reward) for r in rollouts]

    on_loop, in_workers = outcomes(0), outcomes(1)
    assert in_workers == on_loop
    assert [row[0] for row in in_workers] == [
        RolloutStatus.TRUNCATED_TURNS, RolloutStatus.ERROR_PARSE,
    ]  # fmt: skip
    assert in_workers[1][1] == "ValueError: token 300 is not in the vocabulary"
    assert [m["role"] for m in in_workers[1][2]] == ["user", "assistant", "user"]


def _outcomes(workers, plans):
    env_config = EnvConfig(
        max_turns=4, max_rollout_tokens=1000, step_timeout_s=2.0, workers=workers
    )
    prompts = [PLANS.index(p) for p in plans]
    environment = PlanEnvironment(env_config, seed=0)
    renderer = FussyRenderer()
    rollouter = rollouter_for(environment, env_config, renderer, prompts_per_step=len(prompts))
    groups = collect(rollouter, ScriptedGenerate(_ok_or_undecodable), prompts)
    return {
        PLANS[g.sample_index]: [
            (r.status, r.error, (r.error_details or "").strip().split("\n")[-1], r.reward,
             r.reward_breakdown, r.scorer_error, len(r.turns), r.messages)
            for r in g.rollouts
        ]
        for g in groups
    }  # fmt: skip


def _ok_or_undecodable(call):
    """A completion FussyRenderer cannot decode on plan completion_undecodable's
    second turn, else "ok"."""
    prompt = bytes(int(t) for t in call.prompt_ids if t < 256)
    if b"plan completion_undecodable" in prompt and call.request_id.endswith("/turn=1"):
        return make_completion([111, UNDECODABLE, IM_END], request_id=call.request_id)
    return "ok"


@pytest.fixture
def patient_kills(monkeypatch):
    """A worker's own step timeout answers well within the kill's grace, however loaded
    the machine: these tests compare the worker's answer, not a kill."""
    monkeypatch.setattr(env_workers, "KILL_GRACE_S", 30.0)


@pytest.mark.usefixtures("patient_kills")
def test_failures_become_the_same_error_rollouts_in_workers():
    on_loop, in_workers = _outcomes(0, SAME_EVERYWHERE), _outcomes(2, SAME_EVERYWHERE)
    assert in_workers == on_loop
    status = {plan: rows[0][0] for plan, rows in in_workers.items()}
    assert status == {
        "ok": RolloutStatus.COMPLETED,
        "init_raises": RolloutStatus.ERROR_ENV,
        "step_raises": RolloutStatus.ERROR_ENV,
        "step_hangs": RolloutStatus.ERROR_TIMEOUT,
        "not_a_step_result": RolloutStatus.ERROR_ENV,
        "reward_raises": RolloutStatus.ERROR_REWARD,
        "reward_wrong_answer": RolloutStatus.COMPLETED,
        "reward_nan": RolloutStatus.ERROR_REWARD,
        "step_raises_timeout": RolloutStatus.ERROR_ENV,
        "step_hangs_holding_a_task": RolloutStatus.ERROR_TIMEOUT,
        "prompt_unencodable": RolloutStatus.ERROR_ENV,
        "reply_unencodable": RolloutStatus.ERROR_ENV,
        "completion_undecodable": RolloutStatus.ERROR_PARSE,
        "signals_not_a_dict": RolloutStatus.ERROR_ENV,
    }
    assert in_workers["ok"][0][3] == pytest.approx(0.3)
    assert in_workers["step_raises"][0][1] == "ValueError: cannot parse 'ok'"
    assert in_workers["step_raises"][0][2] == "ValueError: cannot parse 'ok'"  # the traceback
    assert in_workers["reward_raises"][0][1] == "ZeroDivisionError: a bug in the reward"
    assert in_workers["reward_wrong_answer"][0][5].startswith("reward: ValueError")
    assert in_workers["step_hangs"][0][1] == "env.step exceeded env.step_timeout_s=2.0"
    # the env's own TimeoutError is its failure; a timed-out step's env is not sent back
    assert (
        in_workers["step_raises_timeout"][0][1:3]
        == ("TimeoutError: the sandbox's own deadline",) * 2
    )
    assert (
        in_workers["step_hangs_holding_a_task"][0][1] == "env.step exceeded env.step_timeout_s=2.0"
    )


RENDERER_FAILURES = {
    "prompt_unencodable": (
        "FussyRenderer.render_prompt raised RuntimeError: "
        "cannot encode 'plan prompt_unencodable<unencodable>'",
        0,
        [],
    ),
    "reply_unencodable": (  # the text and the env's reply kept
        "FussyRenderer.render_continuation (turn 1) raised RuntimeError: "
        "cannot encode 'turn 2 of ok<unencodable>'",
        2,
        ["user", "assistant", "user", "assistant", "user"],
    ),
    "completion_undecodable": (  # no text: the completion did not decode
        "FussyRenderer.parse_completion (turn 1) raised KeyError: 301",
        2,
        ["user", "assistant", "user"],
    ),
    "signals_not_a_dict": (
        "PlanEnv.step (turn 1) gave reward_signals None; expected a dict of floats",
        2,
        ["user", "assistant", "user", "assistant"],
    ),
}
"""Plan: (error line, turns kept, message roles), on the loop as in a worker."""


def test_a_renderer_that_raises_errors_one_rollout_and_keeps_its_worker(caplog):
    """A tokenizer raising something other than ValueError (decoding a completion, encoding
    a prompt or a reply), or an env's malformed reward_signals, errors that rollout with a
    line naming the exception; the others finish, on the loop as in one worker, which lives
    on (no worker died and was replaced)."""
    plans = [*RENDERER_FAILURES, "ok"]
    with caplog.at_level(logging.WARNING, logger="torchtitan_rl.rollout.env_workers"):
        on_loop, in_worker = _outcomes(0, plans), _outcomes(1, plans)
    assert in_worker == on_loop
    assert [r.getMessage() for r in caplog.records] == []
    for plan, (error, turns, roles) in RENDERER_FAILURES.items():
        for row in in_worker[plan]:
            assert row[1] == error and row[3] == 0.0
            assert (row[6], [m["role"] for m in row[7]]) == (turns, roles)
    assert in_worker["completion_undecodable"][0][2] == "KeyError: 301"  # the traceback's end
    assert in_worker["reply_unencodable"][0][2].startswith("RuntimeError: cannot encode")
    assert [row[0] for row in in_worker["ok"]] == [RolloutStatus.COMPLETED] * 2


def test_a_stop_token_check_that_raises_errors_one_rollout_on_the_loop_as_with_workers():
    """`closed_by_stop_token` runs on the loop before the turn goes where the env runs: its
    failure errors that rollout with a line naming it, and the others finish."""

    def respond(call):  # rollout 0's second completion holds UNCLOSABLE
        if call.request_id.endswith("/rollout=0/turn=1"):
            return make_completion([111, UNCLOSABLE, IM_END], request_id=call.request_id)
        return "ok"

    def outcome(workers):
        env_config = EnvConfig(max_turns=4, max_rollout_tokens=1000, workers=workers)
        environment = PlanEnvironment(env_config, seed=0)
        renderer = StopCheckRaisesRenderer()
        rollouter = rollouter_for(environment, env_config, renderer, prompts_per_step=1)
        rollouts = collect(rollouter, ScriptedGenerate(respond), [PLANS.index("ok")])[0].rollouts
        return [
            (r.status, r.error, (r.error_details or "").strip().split("\n")[-1], len(r.turns),
             [m["role"] for m in r.messages])
            for r in rollouts
        ]  # fmt: skip

    on_loop, in_worker = outcome(0), outcome(1)
    assert in_worker == on_loop
    raised = "IndexError: token 302 is past the vocabulary"
    error = f"StopCheckRaisesRenderer.closed_by_stop_token (turn 1) raised {raised}"
    assert on_loop[0][:3] == (RolloutStatus.ERROR_ENV, error, raised)  # with its traceback
    assert on_loop[0][4] == ["user", "assistant", "user"]  # the turn before it kept
    assert on_loop[1][:2] == (RolloutStatus.COMPLETED, None)


@pytest.mark.parametrize("workers", [1, 2])  # 1: calls sent behind a stuck one run after it
def test_a_blocking_step_times_out_and_a_dying_one_errors_while_others_finish(workers):
    outcomes = _outcomes(workers, ["step_blocks", "ok", "step_exits", "ok"])
    killed = (
        "the turn (decoding the completion, env.step, encoding its reply) ran past "
        "env.step_timeout_s=2.0 (+ 1 s grace) in an env worker process, which was killed"
    )
    assert [row[:2] for row in outcomes["step_blocks"]] == [
        (RolloutStatus.ERROR_TIMEOUT, killed)
    ] * 2
    for status, error, *_ in outcomes["step_exits"]:
        assert status is RolloutStatus.ERROR_ENV
        assert "died, exit code 3 during this call" in error
    assert [row[0] for row in outcomes["ok"]] == [RolloutStatus.COMPLETED] * 2
    assert multiprocessing.active_children() == []


@pytest.mark.usefixtures("patient_kills")
def test_an_awaiting_step_times_out_in_its_worker_as_on_the_loop_and_keeps_the_worker(caplog):
    """env.step awaits past env.step_timeout_s: the worker ends it as the loop does and
    answers with the turn's text (the same rollouts as the loop's, compared above); no
    worker is killed for it."""
    with caplog.at_level(logging.WARNING, logger="torchtitan_rl.rollout.env_workers"):
        outcomes = _outcomes(1, ["step_hangs", "ok"])
    assert [row[:2] for row in outcomes["step_hangs"]] == [
        (RolloutStatus.ERROR_TIMEOUT, "env.step exceeded env.step_timeout_s=2.0")
    ] * 2
    roles = [m["role"] for m in outcomes["step_hangs"][0][7]]
    assert roles == ["user", "assistant", "user", "assistant"]  # the timed-out turn's text
    assert outcomes["step_hangs"][0][7][-1]["content"] == "ok"
    assert [r.getMessage() for r in caplog.records] == []


def play_a_turn_stuck_parsing():
    """Rollout 1's first completion never finishes parsing, wherever it is parsed."""
    env_config = EnvConfig(max_turns=2, max_rollout_tokens=1000, step_timeout_s=1.0, workers=1)
    environment = PlanEnvironment(env_config, seed=0)
    renderer = HangsParsingRenderer()
    rollouter = rollouter_for(environment, env_config, renderer, prompts_per_step=1)

    def respond(call):
        stuck = call.request_id.endswith("rollout=1/turn=0")
        return make_completion([111, STUCK if stuck else 107, 257], request_id=call.request_id)

    rollouts = collect(rollouter, ScriptedGenerate(respond), [0])[0].rollouts
    rows = [[r.status.value, r.error, r.messages, len(r.turns)] for r in rollouts]
    print(json.dumps([rows, [p.pid for p in multiprocessing.active_children()]]))


def test_a_turn_stuck_parsing_in_a_worker_times_out_and_the_loop_never_parses_it():
    """The worker is killed at the timeout; its completion is not parsed again on the event
    loop (where it would hold the loop for good): the rollout records the timeout of the
    whole turn, without its text, and the batch returns. Played in a child process, which a
    stuck loop cannot take with it."""
    run = _run_in_child("play_a_turn_stuck_parsing")
    (ok, stuck), children = json.loads(run.stdout)
    assert ok[0] == RolloutStatus.TRUNCATED_TURNS.value and ok[3] == 2
    assert stuck == [
        RolloutStatus.ERROR_TIMEOUT.value,
        "the turn (decoding the completion, env.step, encoding its reply) ran past "
        "env.step_timeout_s=1.0 (+ 1 s grace) in an env worker process, which was killed",
        [{"role": "user", "content": "plan ok"}],  # no assistant text: it was never parsed
        1,  # the completion's tokens are kept
    ]
    assert children == []


@pytest.mark.parametrize(
    "workers, wait_s, saw_flag",
    # On the loop the flag can only be written after the step returns, whatever wait_s; in
    # a worker it is written while the step waits, and wait_s only bounds a failure.
    [(0, 0.3, 0.0), (1, 120.0, 1.0)],
)
def test_a_step_that_holds_its_thread_leaves_the_loop_serving_with_workers(
    tmp_path, workers, wait_s, saw_flag
):
    env_config = EnvConfig(step_timeout_s=300.0, workers=workers)
    rollouter = rollouter_for(WaitingEnvironment(env_config), env_config)
    sample = {"folder": str(tmp_path), "wait_s": wait_s}
    sampling = RolloutConfig().sampling_params(seed=0, max_tokens=8, stop_token_ids=())

    async def write_flag_once_the_step_waits():
        while not (tmp_path / "started").exists():
            await asyncio.sleep(0.001)
        (tmp_path / "flag").touch()

    async def go():
        try:
            return await asyncio.gather(
                rollouter.run_single_rollout(
                    sample,
                    ScriptedGenerate(lambda c: "ok"),
                    group_id=0,
                    rollout_id=0,
                    sampling=sampling,
                ),  # fmt: skip
                write_flag_once_the_step_waits(),
            )
        finally:
            rollouter.close()

    rollout, _ = asyncio.run(go())
    assert rollout.status is RolloutStatus.COMPLETED
    assert rollout.reward == saw_flag


def test_close_stops_busy_and_idle_workers(tmp_path):
    env_config = EnvConfig(step_timeout_s=300.0, workers=2)
    rollouter = rollouter_for(WaitingEnvironment(env_config), env_config)
    sample = {"folder": str(tmp_path), "wait_s": 600.0}  # waits for a flag never written
    sampling = RolloutConfig().sampling_params(seed=0, max_tokens=8, stop_token_ids=())

    async def go():
        rollout = asyncio.ensure_future(
            rollouter.run_single_rollout(
                sample,
                ScriptedGenerate(lambda c: "ok"),
                group_id=0,
                rollout_id=0,
                sampling=sampling,
            )  # fmt: skip
        )
        while not (tmp_path / "started").exists():
            await asyncio.sleep(0.01)
        pids = [p.pid for p in multiprocessing.active_children()]  # the workers
        rollouter.close()
        with pytest.raises(asyncio.CancelledError):
            await rollout
        return pids

    pids = asyncio.run(go())
    assert len(pids) == 2
    for pid in pids:  # reaped: the process is gone, not a zombie
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert multiprocessing.active_children() == []


def play_envs_bigger_than_the_pipe():
    """Two rollouts on one worker, each env 1 MB: more than the pipe holds, either way."""
    env_config = EnvConfig(workers=1)
    rollouter = rollouter_for(BigStateEnvironment(env_config, seed=0), env_config)
    groups = collect(rollouter, ScriptedGenerate(lambda c: "ok"), [0])
    print(*(r.status.value for r in groups[0].rollouts))


def _run_in_child(play: str) -> subprocess.CompletedProcess:
    """Run this module's function `play` in a child process; fail if it has not returned
    within 120 s (it hangs)."""
    tests = Path(__file__).parent
    code = f"import sys; sys.path.insert(0, sys.argv[1]); import test_env_workers as t; t.{play}()"
    env = {**os.environ, "PYTHONPATH": str(tests.parent)}
    try:
        run = subprocess.run(
            [sys.executable, "-c", code, str(tests)],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"{play} hung: the event loop never got back")
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def test_calls_bigger_than_the_pipe_wait_for_an_idle_worker_instead_of_deadlocking():
    """A call sent behind a running one is read after it: one that does not fit in the pipe
    would hold the event loop in its send while the worker's answer (as big) waits to be
    read, forever (the event loop and the env worker each wait for the other to read).
    Played in a child process, which a deadlock cannot take with it."""
    run = _run_in_child("play_envs_bigger_than_the_pipe")
    assert run.stdout.split() == ["completed", "completed"]


def test_a_worker_that_dies_parsing_errors_its_rollout_and_the_loop_never_parses_it():
    """The worker dies (as a native tokenizer crashing) parsing a completion: the rollout
    ends ERROR_ENV with the death's line and without the turn's text, as a killed turn does;
    the completion is not parsed again on the event loop (where it could crash, raise or
    hang the controller: DiesParsingRenderer raises there), and the batch goes on."""
    env_config = EnvConfig(max_turns=2, max_rollout_tokens=1000, workers=1)
    environment = PlanEnvironment(env_config, seed=0)
    rollouter = rollouter_for(environment, env_config, DiesParsingRenderer(), prompts_per_step=1)

    def respond(call):
        bad = call.request_id.endswith("rollout=1/turn=0")
        return make_completion([111, 300 if bad else 107, 257], request_id=call.request_id)

    ok, died = collect(rollouter, ScriptedGenerate(respond), [0])[0].rollouts
    assert (ok.status, ok.error, len(ok.turns)) == (RolloutStatus.TRUNCATED_TURNS, None, 2)
    assert died.status is RolloutStatus.ERROR_ENV and died.reward == 0.0
    assert died.error.startswith("an env worker process (pid ")
    assert died.error.endswith(") died, exit code 3 during this call")
    assert died.messages == [{"role": "user", "content": "plan ok"}]  # no assistant text
    assert len(died.turns) == 1 and died.turns[0].assistant_text == ""  # its tokens kept
    assert multiprocessing.active_children() == []


def test_a_replacement_that_cannot_start_fails_the_running_calls_with_its_line(tmp_path):
    """One worker's step ends its process while another's runs; its replacement cannot load
    the renderer: every call, the running one included, fails with that line (not a bare
    CancelledError), and nothing is left running."""
    env_config = EnvConfig(step_timeout_s=300.0, workers=2)
    environment = RelayEnvironment(env_config)
    folder = str(tmp_path)
    samples = {0: {"folder": folder, "wait_s": 600.0}, 1: {"folder": folder, "breaks": True}}
    environment.train_sample = samples.__getitem__
    renderer = BreaksLaterRenderer(folder)
    rollouter = rollouter_for(environment, env_config, renderer, group_size=1)
    with pytest.raises(RuntimeError) as e:
        collect(rollouter, ScriptedGenerate(lambda c: "ok"), [0, 1])
    assert str(e.value) == (
        "env.workers=2: a worker process cannot load the renderer: RuntimeError: its files are gone"
    )
    assert multiprocessing.active_children() == []
