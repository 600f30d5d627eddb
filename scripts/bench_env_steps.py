"""Environment steps and scoring on the controller's event loop vs in `env.workers` processes.

    python scripts/bench_env_steps.py --groups 64 --group-size 8 --turns 4 --workers 0 1 2 \\
        --threads 2

The environment is `Burn2ms`, synthetic: each `MessageEnv.step` and each rubric score burns
about 2 ms of pure-Python CPU (a fixed loop calibrated at start; a reasoning-gym scorer or a
countdown solver is this kind of code: it holds the GIL). The generator is a fake that answers
at once, so the env is the only work. Each row runs one `Rollouter.collect_batch` of
groups x group_size rollouts x turns turns after a warm-up batch (worker start-up is not
timed). "Controller CPU" is the CPU time of the controller's process (its threads
included, the worker processes not): what the loop's process spends; "worker CPU" the
worker processes' (warm-up included). While it runs, a 1 ms asyncio timer measures how late the loop serves it ("lag"): the
delay every other coroutine of the controller sees, the generators' hand-backs among them.
Rows: the event loop (workers 0), worker processes, and the alternative not taken, a pool of
threads (`threads N`: each call runs on an executor thread). The floor is the CPU work
itself, serial, divided by the cores it can use.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import resource
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from torchtitan_rl.envs.base import EnvConfig, Environment, MessageEnv, Rubric, StepResult
from torchtitan_rl.rollout.env_calls import LocalCalls, run_call
from torchtitan_rl.rollout.rollout_config import RolloutConfig
from torchtitan_rl.rollout.rollouter import Rollouter
from torchtitan_rl.types import Message, Rollout

ROOT = Path(__file__).resolve().parents[1]
COST_MS = 2.0
"""CPU per step and per score."""


def burn(iterations: int) -> int:
    return sum(i * i % 7 for i in range(iterations))


def calibrate(cost_ms: float) -> int:
    """Loop iterations that take `cost_ms` of CPU here (best of 5 trials)."""
    n = 20_000
    best = min(_cpu_s(n) for _ in range(5))
    return max(1, round(n * cost_ms / 1e3 / best))


def _cpu_s(n: int) -> float:
    start = time.process_time()
    burn(n)
    return time.process_time() - start


class BurnEnv(MessageEnv):
    def __init__(self, iterations: int, turns: int):
        self.iterations, self.turns, self.turn = iterations, turns, 0

    async def init(self) -> list[Message]:
        return [{"role": "user", "content": "go"}]

    async def step(self, assistant_message: str) -> StepResult:
        burn(self.iterations)
        self.turn += 1
        done = self.turn == self.turns
        reply = [] if done else [{"role": "user", "content": f"turn {self.turn}"}]
        return StepResult(messages=reply, done=done)


def burn_score(rollout: Rollout) -> float:
    return float(burn(rollout.sample["iterations"]) % 2)


class Burn2ms(Environment):
    """Samples are {"index", "iterations"}; every rollout plays `max_turns` turns."""

    def __init__(self, config: EnvConfig, iterations: int):
        super().__init__(config, seed=0)
        self.iterations = iterations

    def train_sample(self, index: int) -> dict[str, Any]:
        return {"index": index, "iterations": self.iterations}

    def validation_samples(self, n: int) -> list[dict[str, Any]]:
        return [self.train_sample(-1 - i) for i in range(n)]

    def make_env(self, sample: dict[str, Any]) -> MessageEnv:
        return BurnEnv(sample["iterations"], self.config.max_turns)

    def rubric(self) -> Rubric:
        return Rubric([("burn", burn_score, 1.0)])


class ThreadCalls:
    """The alternative: each env call on one of `n` threads (its own event loop there)."""

    def __init__(self, n: int, rubric: Rubric, renderer: Any, timeout_s: float):
        self._pool = concurrent.futures.ThreadPoolExecutor(n)
        self._calls = LocalCalls(timeout_s, rubric, renderer)

        self._local = threading.local()

    def _call_here(self, call: tuple) -> Any:
        if not hasattr(self._local, "loop"):  # one event loop per thread, kept
            self._local.loop = asyncio.new_event_loop()
        return self._local.loop.run_until_complete(run_call(call, self._calls))

    async def _run(self, call: tuple) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._call_here, call)

    async def open(self, env):
        return await self._run(("open", env))

    async def turn(self, env, turn):
        return await self._run(("turn", env, turn))

    async def score(self, rollout):
        return await self._run(("score", rollout))

    def close(self) -> None:
        self._pool.shutdown()


async def lag_monitor(stop: asyncio.Event, lags: list[float], period_s: float = 1e-3) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        await asyncio.sleep(period_s)
        lags.append(time.perf_counter() - start - period_s)


def run_row(kind: str, n: int, args: argparse.Namespace, iterations: int) -> dict[str, Any]:
    from fakes import FakeRenderer, encode, make_completion  # tests/: parent process only

    env_config = EnvConfig(
        max_turns=args.turns, max_rollout_tokens=100_000, workers=n if kind == "workers" else 0
    )
    rollout = RolloutConfig(
        group_size=args.group_size, prompts_per_step=args.groups, filter_zero_std_groups=False
    )
    renderer = FakeRenderer()
    rollouter = Rollouter(Burn2ms(env_config, iterations), renderer, env_config, rollout, 0)
    if kind == "threads":
        timeout_s = env_config.step_timeout_s
        rollouter._calls = ThreadCalls(n, rollouter._rubric, renderer, timeout_s)
    ids = [*encode("ok"), 257]

    async def generate(prompt_ids, *, request_id, session_id=None, sampling=None):
        await asyncio.sleep(0)  # a hand-back: the reply arrives on a later loop turn
        return make_completion(ids, request_id=request_id)

    async def go() -> dict[str, Any]:
        warm = time.perf_counter()  # workers start on the first call
        await rollouter.run_group_rollouts(
            {"index": -1, "iterations": 1}, generate, group_id=0, step=0
        )
        warm_s = time.perf_counter() - warm
        stop, lags = asyncio.Event(), []
        monitor = asyncio.ensure_future(lag_monitor(stop, lags))
        start, cpu = time.perf_counter(), time.process_time()
        batch = await rollouter.collect_batch(1, 0, generate)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        stop.set()
        await monitor
        rollouts = [r for g in batch.groups for r in g.rollouts]
        turns = sum(len(r.turns) for r in rollouts)
        assert all(not r.status.is_error() for r in rollouts), rollouts[0].error
        return {
            "row": "event loop" if n == 0 else f"{kind} {n}",
            "kind": kind, "n": n, "rollouts": len(rollouts), "turns": turns,
            "seconds": seconds, "turns_per_s": turns / seconds, "controller_cpu_s": cpu,
            "lag_max_ms": 1e3 * max(lags), "lag_p99_ms": 1e3 * _quantile(lags, 0.99),
            "lag_median_ms": 1e3 * statistics.median(lags), "warmup_s": warm_s,
        }  # fmt: skip

    children = _children_cpu_s()
    try:
        row = asyncio.run(go())
    finally:
        rollouter.close()
    row["workers_cpu_s"] = _children_cpu_s() - children  # reaped by close: counted now
    return row


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--threads", type=int, nargs="*", default=[2])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    if args.smoke:
        args.groups, args.group_size, args.turns, args.workers, args.threads = 2, 2, 2, [0, 1], [1]
    sys.path.insert(0, str(ROOT / "tests"))
    iterations = calibrate(COST_MS)
    cost_s = min(_cpu_s(iterations) for _ in range(5))
    plan = [("workers", n) for n in args.workers] + [("threads", n) for n in args.threads]
    rows = [run_row(kind, n, args, iterations) for kind, n in plan]
    cores = len(os.sched_getaffinity(0))
    work_s = cost_s * (rows[0]["turns"] + rows[0]["rollouts"])  # a step per turn, a score each
    base = next((r["seconds"] for r in rows if r["n"] == 0), rows[0]["seconds"])
    print(
        f"{rows[0]['rollouts']} rollouts x {args.turns} turns = {rows[0]['turns']} steps + "
        f"{rows[0]['rollouts']} scores of {1e3 * cost_s:.2f} ms CPU each (Burn2ms); "
        f"{cores} cores; floor: {work_s:.2f} s serial, {work_s / cores:.2f} s on {cores} cores"
    )
    print(
        "| row | seconds | turns/s | vs event loop | controller CPU s | worker CPU s | "
        "loop lag max ms | p99 ms | median ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['row']} | {r['seconds']:.2f} | {r['turns_per_s']:,.0f} | "
            f"{base / r['seconds']:.2f}x | {r['controller_cpu_s']:.2f} | "
            f"{r['workers_cpu_s']:.2f} | {r['lag_max_ms']:.1f} | "
            f"{r['lag_p99_ms']:.1f} | {r['lag_median_ms']:.2f} |"
        )
    result = {"cost_ms": 1e3 * cost_s, "cores": cores, "floor_serial_s": work_s, "rows": rows}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench_env_steps.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
