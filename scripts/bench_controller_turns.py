"""The controller's turn rate: how many turns per second its rollout loop serves when the
generator costs nothing.

    python scripts/bench_controller_turns.py --rollouts 256 768 --env-workers 0 2

The real Rollouter, the real AlphabetSort environment and the real renderer and tokenizer of a
job file (default the 0.6B GPU job: 3 turns, groups of 8), with the zero-std filter off so a
step is one round. The generator is a fake that answers on the next loop turn, so the time
is the controller's own per-turn work: rendering and tokenizing prompts, parsing completions,
environment steps and scoring, asyncio scheduling. Its replies (`--replies`): "random", 128
random token ids (what a random-weight policy sends back at `rollout.max_tokens = 128`; the
environment finds no answer tag in them and scores 0 at once), or "names", the turn's sorted
names in their tag with the first and last swapped in every other rollout (a trained
policy's kind of answer: the environment scores it with difflib, as in a real run). Not
included: Monarch's hand-over of a call to a generator actor, which a real run adds per turn
(`--replica` adds the call's dispatch and message build, below).

`--replica` calls the fake through `ActorGenerateFn` (controller/replica.py) over a fake
actor, so the rows include that dispatch's own cost and Monarch's message build: the call's
arguments pickled and the answer loaded with Monarch's own pickle (the answer's pickling,
the generator's side, is left out of the controller's CPU).

Rows: each `env.workers` value and rollout count, best of `--repeats` batches (by wall time)
after a warm-up batch, all on one event loop (worker processes serve one). "Controller CPU"
is the CPU time of this process (its threads included, the worker processes not): what the
controller's loop spends per turn, which is what limits a host with cores to spare; on a
host with fewer cores than workers + 1 the wall time is bounded by the cores instead.
"Worker CPU" is the worker processes' CPU over the timed batches (read from /proc).
The floor is the tokenizer's decode of every completion (the text an environment step
needs), which a controller doing the turns itself cannot skip; encoding the environments'
replies comes on top.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = "train_configs/alphabet_sort_qwen3_0.6b.toml"
COMPLETION_TOKENS = 128


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=DEFAULT_CONFIG, help="job file")
    p.add_argument("--rollouts", type=int, nargs="+", default=[256, 768], help="per batch")
    p.add_argument(
        "--env-workers", type=int, nargs="+", default=[0], help="env.workers values, rows each"
    )
    p.add_argument("--repeats", type=int, default=3, help="timed batches per row (best kept)")
    p.add_argument("--replies", choices=["random", "names"], default="random")
    p.add_argument(
        "--replica", action="store_true", help="call the fake through ActorGenerateFn's dispatch"
    )
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder of the JSON")
    p.add_argument("--smoke", action="store_true", help="16 rollouts, one timed batch")
    return p.parse_args()


def run_row(args: argparse.Namespace, rollouts: int, workers: int) -> dict:
    config_file, repeats, replies = args.config, args.repeats, args.replies
    sys.path.insert(0, str(ROOT / "tests"))
    from fakes import make_completion  # tests/: a Completion from token ids

    from torchtitan_rl.config.loader import load_config
    from torchtitan_rl.envs import build_environment
    from torchtitan_rl.models.renderer import Renderer
    from torchtitan_rl.models.tokenizer import Tokenizer
    from torchtitan_rl.rollout.rollouter import Rollouter

    probe = load_config(config_file, [])
    prompts = max(1, rollouts // probe.rollout.group_size)
    cfg = load_config(
        config_file,
        [
            f"--rollout.prompts_per_step={prompts}",
            "--rollout.filter_zero_std_groups=false",
            f"--env.workers={workers}",
        ],
    )
    tokenizer = Tokenizer.from_file(cfg.model.hf_checkpoint or None)
    renderer = Renderer(tokenizer)
    environment = build_environment(cfg.env, cfg.job.seed, cfg.env_args())
    rollouter = Rollouter(environment, renderer, cfg.env, cfg.rollout, cfg.job.seed)
    rng = np.random.default_rng(0)
    vocab = min(tokenizer.vocab_size, 150_000)
    completions: list[list[int]] = []
    named: dict[str, list[int]] = {}  # request id -> "names" reply, encoded in the warm-up

    def names_reply(request_id: str) -> list[int]:
        from torchtitan_rl.envs.alphabet_sort import gold_reply

        _, group, rollout, turn = (int(part.split("=")[1]) for part in request_id.split("/"))
        first, *names, last = gold_reply(environment.train_sample(group), turn).split("\n")
        if rollout % 2 and len(names) > 1:
            names[0], names[-1] = names[-1], names[0]
        text = "\n".join([first, *names, last])
        return [*tokenizer.encode(text), tokenizer.im_end_id]

    def reply(request_id: str):
        if replies == "names":
            key = request_id.split("/", 1)[1]  # the same groups every batch
            ids = named.get(key) or named.setdefault(key, names_reply(request_id))
        else:
            ids = rng.integers(0, vocab, COMPLETION_TOKENS).tolist()
        completions.append(ids)
        return make_completion(ids, request_id=request_id)

    async def generate(prompt_ids, *, request_id, session_id=None, sampling=None):
        await asyncio.sleep(0)  # a hand-back: the reply arrives on a later loop turn
        return reply(request_id)

    actor = None
    if args.replica:
        from torchtitan_rl.actors.generate_fn import ActorGenerateFn

        actor = _FakeActor(reply)
        generate = ActorGenerateFn(actor)

    async def batch(step: int) -> tuple[float, float, int, int]:
        start, cpu = time.perf_counter(), time.process_time()
        answered = actor.generator_cpu_s if actor else 0.0
        got = await rollouter.collect_batch(step, 0, generate)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        cpu -= (actor.generator_cpu_s if actor else 0.0) - answered  # the generator's pickling
        done = [r for g in got.groups for r in g.rollouts]
        errors = [r.error for r in done if r.status.is_error()]
        assert not errors, errors[0]
        return seconds, cpu, len(done), sum(len(r.turns) for r in done)

    async def batches() -> tuple[list[tuple[float, float, int, int]], float]:
        await batch(0)  # warm-up: first-call costs, worker processes' start
        workers_cpu = _children_cpu_s()
        timed = [await batch(1 + i) for i in range(repeats)]
        return timed, _children_cpu_s() - workers_cpu

    try:
        timed, workers_cpu_s = asyncio.run(batches())
    finally:
        rollouter.close()
    seconds, cpu_s, n_rollouts, turns = min(timed)
    start = time.perf_counter()  # the floor: decoding this row's completions
    for ids in completions[-turns:]:
        tokenizer.decode(ids)
    floor_s = time.perf_counter() - start
    timed_turns = sum(t[3] for t in timed)
    return {
        "env_workers": workers, "rollouts": n_rollouts, "turns": turns, "seconds": seconds,
        "turns_per_s": turns / seconds, "ms_per_turn": 1e3 * seconds / turns,
        "controller_cpu_s": cpu_s, "cpu_ms_per_turn": 1e3 * cpu_s / turns,
        "workers_cpu_ms_per_turn": 1e3 * workers_cpu_s / timed_turns, "floor_s": floor_s,
    }  # fmt: skip


class _FakeActor:
    """A generator actor whose call is answered on the next loop turn and observed as a
    Monarch call is (`as_asyncio()`, or awaited)."""

    def __init__(self, reply):
        self.reply = reply
        self.generate = self  # actor.generate.call_one(...)
        self.generator_cpu_s = 0.0

    def call_one(self, prompt_ids, request_id, session_id, sampling):
        # Monarch's message both ways, as a real actor call pays it: the arguments pickled
        # here (the controller's side), the answer loaded here
        from monarch._rust_bindings.monarch_hyperactor.pickle import PicklingState, pickle

        pickle(((prompt_ids, request_id, session_id, sampling), {}))
        reply = self.reply(request_id)
        start = time.perf_counter()  # the generator's side: not the controller's CPU (its
        buffer = pickle(reply).buffer()  # wall time: process_time costs ~1.5 us a call here)
        self.generator_cpu_s += time.perf_counter() - start
        answer = PicklingState(buffer).unpickle()
        future = asyncio.get_running_loop().create_future()
        future.get_loop().call_soon(future.set_result, answer)
        from fakes import MonarchLikeCall  # tests/ is on the path (run_row)

        return MonarchLikeCall(future)


def _children_cpu_s() -> float:
    """CPU seconds of this process's live children (the env workers), from /proc."""
    total = 0
    for tasks in Path("/proc/self/task").glob("*/children"):
        for pid in tasks.read_text().split():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:  # exited since
                continue
            utime, stime = stat.rsplit(")", 1)[1].split()[11:13]
            total += int(utime) + int(stime)
    return total / os.sysconf("SC_CLK_TCK")


def main() -> None:
    args = parse_args()
    if args.smoke:
        args.rollouts, args.repeats, args.env_workers = [16], 1, [0, 1]
    rows = [run_row(args, n, workers) for workers in args.env_workers for n in args.rollouts]
    cores = len(os.sched_getaffinity(0))
    what = f"{COMPLETION_TOKENS} random tokens" if args.replies == "random" else "names"
    via = " through ActorGenerateFn" if args.replica else ""
    print(f"{args.config}; the generator answers at once{via} with {what}; {cores} cores")
    print(
        "| env.workers | rollouts | turns | seconds | turns / s | wall ms / turn "
        "| controller CPU ms / turn | worker CPU ms / turn | floor (decode) s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['env_workers']} | {r['rollouts']} | {r['turns']} | {r['seconds']:.3f} "
            f"| {r['turns_per_s']:,.0f} | {r['ms_per_turn']:.3f} | {r['cpu_ms_per_turn']:.3f} "
            f"| {r['workers_cpu_ms_per_turn']:.3f} | {r['floor_s']:.3f} |"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_controller_turns.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
