"""Rollout records: best and worst rollout of each group as JSON lines, pretty-printed."""

import importlib.util
from pathlib import Path

from fakes import make_completion

from torchtitan_rl.rollout.records import best_and_worst, read_records, write_step_records
from torchtitan_rl.types import Rollout, RolloutGroup, RolloutStatus, RolloutTurn

ROOT = Path(__file__).resolve().parents[1]


def _rollout(rid, reward, status=RolloutStatus.COMPLETED, version=3):
    turn = RolloutTurn(
        prompt_ids=make_completion([1, 2]).token_ids_N,
        completion=make_completion([5, 6, 7], policy_version=version),
        assistant_text=f"<answer>\nAnn Lee {rid}\n</answer>",
        env_messages=[{"role": "user", "content": "next"}],
        reward_signals={"turn_score": reward},
    )
    return Rollout(
        group_id=0,
        rollout_id=rid,
        session_id=f"step=4/group=0/rollout={rid}",
        sample={"names_per_turn": [["Ann Lee"]]},
        messages=[
            {"role": "user", "content": "Sort these names: Ann Lee"},
            {"role": "assistant", "content": turn.assistant_text},
        ],
        turns=[turn],
        status=status,
        error="ValueError: boom" if status.is_error() else None,
        reward=reward,
        reward_breakdown={} if status.is_error() else {"sort_score": reward},
    )


def _groups():
    g0 = RolloutGroup(group_id=0, rollouts=[_rollout(0, 0.2), _rollout(1, 0.9), _rollout(2, 0.5)])
    error = _rollout(1, 0.0, RolloutStatus.ERROR_ENV)
    g1 = RolloutGroup(group_id=1, rollouts=[_rollout(0, 0.1), error])
    g2 = RolloutGroup(group_id=2, rollouts=[_rollout(0, 0.7)])
    return [g0, g1, g2]


def test_best_is_highest_reward_and_worst_prefers_an_error():
    g0, g1, g2 = _groups()
    assert [(p, r.rollout_id) for p, r in best_and_worst(g0)] == [("best", 1), ("worst", 0)]
    assert [(p, r.status) for p, r in best_and_worst(g1)][1] == ("worst", RolloutStatus.ERROR_ENV)
    assert [p for p, _ in best_and_worst(g2)] == ["best+worst"]


def test_step_records_round_trip_with_messages_versions_and_rewards(tmp_path):
    path = write_step_records(tmp_path / "rollouts", 4, _groups())
    assert path.name == "step_4.jsonl"
    records = read_records(path)
    assert len(records) == 5
    best = records[0]
    assert best["step"] == 4 and best["pick"] == "best" and best["reward"] == 0.9
    assert best["policy_version_min"] == best["policy_version_max"] == 3
    assert best["messages"][1]["role"] == "assistant"
    assert best["turns"][0]["finish_reason"] == "stop" and best["turns"][0]["num_tokens"] == 3
    assert best["reward_breakdown"] == {"sort_score": 0.9}
    assert records[3]["status"] == "error_env" and records[3]["error"] == "ValueError: boom"


def test_show_rollouts_prints_the_latest_step(tmp_path, capsys):
    write_step_records(tmp_path / "rollouts", 3, _groups()[:1])
    write_step_records(tmp_path / "rollouts", 4, _groups())
    spec = importlib.util.spec_from_file_location("show", ROOT / "scripts" / "show_rollouts.py")
    show = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(show)
    assert show.main([str(tmp_path), "--pick", "worst"]) == 0
    out = capsys.readouterr().out
    assert "step_4.jsonl: 3 rollouts" in out
    assert "status error_env" in out and "error: ValueError: boom" in out
    assert "[assistant]" in out and "Ann Lee" in out
    # each turn's numbers sit right under its assistant message
    assert out.index("[assistant]") < out.index("-> turn 0:")


def test_show_rollouts_piped_into_head_exits_quietly(tmp_path):
    import subprocess
    import sys

    write_step_records(tmp_path / "rollouts", 4, _groups() * 50)
    cmd = f"'{sys.executable}' '{ROOT / 'scripts' / 'show_rollouts.py'}' '{tmp_path}' | head -2"
    result = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=60)
    assert "Traceback" not in result.stderr and len(result.stdout.splitlines()) == 2


def test_pass_at_k_counts_each_group_once_per_step(tmp_path):
    import json

    folder = tmp_path / "rollouts"
    folder.mkdir()
    steps = {1: [(0, [1.0, 0.0, 0.0, 0.0]), (0, [1.0, 0.0, 0.0, 0.0]), (1, [0.0] * 4)],
             2: [(0, [1.0, 1.0, 0.5, 0.0])]}  # fmt: skip
    for step, records in steps.items():  # best and worst of group 0 share its rewards
        lines = [json.dumps({"group_id": g, "group_rewards": r}) for g, r in records]
        (folder / f"step_{step}.jsonl").write_text("\n".join(lines) + "\n")
    spec = importlib.util.spec_from_file_location("pk", ROOT / "scripts" / "pass_at_k.py")
    pk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pk)
    assert pk.pass_rates(tmp_path, 1, 1.0) == [(1, 2, 0.125, 0.5), (2, 1, 0.5, 1.0)]
    assert pk.pass_rates(tmp_path, 2, 1.0) == [(1, 3, 0.25, 2 / 3)]
    assert pk.pass_rates(tmp_path, 2, 0.5)[0][2] == (0.25 + 0 + 0.75) / 3  # a lower bar
