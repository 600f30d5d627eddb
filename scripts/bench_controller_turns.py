"""The controller's turn rate: how many turns per second its rollout loop serves when the
generator costs nothing.

    python scripts/bench_controller_turns.py --rollouts 256 768

The real Rollouter, the real AlphabetSort environment and the real renderer and tokenizer of a
job file (default the 0.6B GPU job: 3 turns, groups of 8), with the zero-std filter off so a
step is one round. The generator is a fake that answers on the next loop turn with 128 random
token ids (what a random-weight policy sends back at `rollout.max_tokens = 128`), so the time
is the controller's own per-turn work: rendering and tokenizing prompts, parsing completions,
environment steps and scoring, asyncio scheduling. Not included: the cost of a call to a
generator actor (Monarch's message hand-over), which a real run adds per turn.

Rows: each rollout count, best of `--repeats` batches after a warm-up batch. The floor is the
tokenizer's decode of every completion (the text an environment step needs), which no
controller can skip; encoding the environments' replies comes on top.
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
    p.add_argument("--repeats", type=int, default=3, help="timed batches per row (best kept)")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder of the JSON")
    p.add_argument("--smoke", action="store_true", help="16 rollouts, one timed batch")
    return p.parse_args()


def run_row(config_file: str, rollouts: int, repeats: int) -> dict:
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
        [f"--rollout.prompts_per_step={prompts}", "--rollout.filter_zero_std_groups=false"],
    )
    tokenizer = Tokenizer.from_file(cfg.model.hf_checkpoint or None)
    renderer = Renderer(tokenizer)
    environment = build_environment(cfg.env, cfg.job.seed, cfg.env_args())
    rollouter = Rollouter(environment, renderer, cfg.env, cfg.rollout, cfg.job.seed)
    rng = np.random.default_rng(0)
    vocab = min(tokenizer.vocab_size, 150_000)
    completions: list[list[int]] = []

    async def generate(prompt_ids, *, request_id, session_id=None, sampling=None):
        await asyncio.sleep(0)  # a hand-back: the reply arrives on a later loop turn
        ids = rng.integers(0, vocab, COMPLETION_TOKENS).tolist()
        completions.append(ids)
        return make_completion(ids, request_id=request_id)

    async def batch(step: int) -> tuple[float, int, int]:
        start = time.perf_counter()
        got = await rollouter.collect_batch(step, 0, generate)
        seconds = time.perf_counter() - start
        done = [r for g in got.groups for r in g.rollouts]
        return seconds, len(done), sum(len(r.turns) for r in done)

    try:
        asyncio.run(batch(0))  # warm-up: first-call costs
        timed = [asyncio.run(batch(1 + i)) for i in range(repeats)]
    finally:
        rollouter.close()
    seconds, n_rollouts, turns = min(timed)
    start = time.perf_counter()  # the floor: decoding this row's completions
    for ids in completions[-turns:]:
        tokenizer.decode(ids)
    floor_s = time.perf_counter() - start
    return {
        "rollouts": n_rollouts, "turns": turns, "seconds": seconds,
        "turns_per_s": turns / seconds, "ms_per_turn": 1e3 * seconds / turns,
        "floor_s": floor_s,
    }  # fmt: skip


def main() -> None:
    args = parse_args()
    if args.smoke:
        args.rollouts, args.repeats = [16], 1
    rows = [run_row(args.config, n, args.repeats) for n in args.rollouts]
    print(f"{args.config}; the generator answers at once with {COMPLETION_TOKENS} tokens")
    print("| rollouts | turns | seconds | turns / s | ms / turn | floor (decode) s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['rollouts']} | {r['turns']} | {r['seconds']:.3f} | {r['turns_per_s']:,.0f} "
            f"| {r['ms_per_turn']:.3f} | {r['floor_s']:.3f} |"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_controller_turns.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
