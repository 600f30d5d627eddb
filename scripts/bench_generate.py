"""Output tokens/s of the native engine vs vLLM vs Hugging Face `generate` vs the bandwidth bound.

    python -m scripts.bench_generate [--out DIR]   # H200: Qwen3-0.6B shape, bf16, 256 x (512 + 512)
    python -m scripts.bench_generate --smoke       # tiny model on CPU, seconds
    python -m scripts.bench_generate --cpu-default # the default CPU run's generation, below

Both generators run the same random weights (torchtitan Qwen3 converted with
`Qwen3StateDictAdapter.to_hf`), sample at temperature 1 and produce exactly `--output-len`
tokens per request (no stop tokens). Throughput = all output tokens / wall time from
submitting the requests to the last completion (prefill included).

The bound: every decode step reads all weights once and each sequence's keys/values
(at the average context, prompt + output / 2); bytes over the measured device-to-device
copy bandwidth (bytes read + written) give the fastest possible step.
Writes `bench_generate.json` to `--out` (default: $OUT, else the current directory).

`--cpu-default` mimics one RL step of `train_configs/alphabet_sort_tiny.toml`: the tiny
model (fp32, one torch thread, as the generator process gets on a 2-core machine), 16
AlphabetSort prompts x 4 samples, 48 tokens each (no stop tokens, so every step has the same
work), temperature 0.6, prefix cache on, a weight pull before every round. It prints the
median round's output tok/s and ms per engine step, and a digest of the sampled tokens and
log-probs (equal digests: identical results). Measured 2026-11-21 on a 2-core x86_64 VM
(torch 2.13.0+cpu; its speed drifts by up to 30% between runs, so old and new engines ran
alternately, 8 runs x 9 rounds each): median round 947 ms before the host-overhead pass
(packed prefill, rope/mask hoisting, block gathers, leaner sampling), 716 ms after (best
744 -> 559 ms), i.e. ~3,250 -> ~4,300 output tok/s, with the same digest.

Measured 2026-11-24, one NVIDIA H200, torch 2.11.0+cu130, vLLM 0.26.0, `--skip-hf --vllm llm`
(the vLLM rows need vllm installed: README), output tok/s:

| implementation                  | 256 x (512 + 512) | 64 x (128 + 128) |
|---------------------------------|-------------------|------------------|
| native engine (look-ahead)      |            29,871 |           25,616 |
| native engine, no look-ahead    |            25,940 |           21,898 |
| vLLM `LLM` (plain vLLM)         |            28,104 |           20,142 |
| memory-bandwidth bound          |            44,969 |          100,506 |

vLLM's rows move by a few percent between runs (README). The vllm-backend row needs the GPU
memory that the plain vLLM row keeps after it is deleted (vLLM 0.26 does not give it back
in-process): run `--vllm backend` in a process of its own for that row.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch
from torchtitan.models.qwen3 import Qwen3Model, Qwen3ModelArgs, qwen3_args
from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

from torchtitan_rl.generation.engine import Engine
from torchtitan_rl.generation.interface import EngineConfig
from torchtitan_rl.generation.model_runner import SeqInput
from torchtitan_rl.types import SamplingParams

try:  # python -m scripts.bench_generate, or the repository root on the path
    from scripts.generate_vllm_rows import export_folder, run_vllm, run_vllm_llm
except ModuleNotFoundError:  # python scripts/bench_generate.py
    from generate_vllm_rows import export_folder, run_vllm, run_vllm_llm

SMOKE_ARGS = dict(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128, vocab_size=256
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny CPU run")
    p.add_argument(
        "--cpu-default", action="store_true", help="the default CPU run's generation step"
    )
    p.add_argument("--rounds", type=int, default=7, help="--cpu-default: timed rounds")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for the JSON")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--hf-output-len", type=int, default=0, help="0: same as --output-len")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument(
        "--vllm",
        default="llm,backend",
        help="vLLM rows, comma-separated: llm (plain vllm.LLM), backend (generator.backend = "
        "vllm); empty: none",
    )
    p.add_argument(
        "--attention",
        default="",
        help='engine variants, comma-separated: the decode attention ("gather", "triton"), '
        'with "-no-look-ahead" to step one step at a time; default on CUDA: '
        '"triton,triton-no-look-ahead"',
    )
    args = p.parse_args()
    if set(args.vllm.split(",")) - {"llm", "backend", ""}:
        p.error(f"--vllm takes llm and/or backend, comma-separated; got {args.vllm!r}")
    if args.smoke:
        args.num_requests, args.prompt_len, args.output_len = 8, 16, 16
    args.hf_output_len = args.hf_output_len or args.output_len
    gpu = torch.cuda.is_available() and not args.smoke
    args.attention = (args.attention or ("triton,triton-no-look-ahead" if gpu else "gather")).split(
        ","
    )
    return args


def build_model(model_args: Qwen3ModelArgs, device: torch.device, dtype: torch.dtype):
    torch.manual_seed(0)
    with torch.device(device), torch.no_grad():
        model = Qwen3Model(model_args)
        model.init_weights(buffer_device=device)
    return model.to(dtype)


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy, bytes read + written per second (median of 10)."""
    n = (1 << 30) if device.type == "cuda" else (1 << 26)
    src = torch.randn(n // 4, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * n / float(np.median(times[2:]))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_engine(model, args, prompts: np.ndarray, device, dtype_name: str, variant: str):
    """`variant`: the decode attention, with "-no-look-ahead" to step one at a time."""
    attention = variant.removesuffix("-no-look-ahead")
    config = EngineConfig(
        decode_attention=attention,
        max_num_seqs=args.num_requests,
        max_seq_len=args.prompt_len + args.output_len,
        dtype=dtype_name,
        block_size=16,
        enable_prefix_cache=False,  # random prompts share nothing; keep hashing off the clock
    )
    t0 = time.perf_counter()
    engine = Engine(model, config, device, look_ahead=None if attention == variant else False)
    setup_s = time.perf_counter() - t0
    graph_vs_padded = decode_path_difference(engine.runner, prompts[:4].tolist())
    phases = time_phases(engine)

    async def generate(max_tokens: int):
        return await asyncio.gather(
            *(
                engine.generate(
                    p,
                    request_id=str(i),
                    sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=i),
                )
                for i, p in enumerate(prompts)
            )
        )

    async def main():
        await generate(4)  # warm-up at the full prefill shape
        sync(device)
        phases.clear()
        t0 = time.perf_counter()
        outs = await generate(args.output_len)
        sync(device)
        wall = time.perf_counter() - t0
        await engine.close()
        return outs, wall

    outs, wall = asyncio.run(main())
    replay = time_graph_replays(engine.runner)
    tokens = sum(c.num_tokens for c in outs)
    ttft = max(c.metrics["generator/time_to_first_token_ms"] for c in outs) / 1e3
    return {
        "output_tokens": tokens,
        "wall_s": wall,
        "tok_per_s": tokens / wall,
        "setup_s_incl_graph_capture": setup_s,
        "max_time_to_first_token_s": ttft,
        "decode_vs_padded_max_abs_logit_diff": graph_vs_padded,
        "decode_tok_per_s": (tokens - len(outs)) / max(wall - ttft, 1e-9),
        "host_wall_s_by_phase": dict(phases),
        "graph_replay_ms": replay,
    }


def time_phases(engine: Engine) -> dict[str, float]:
    """Wraps the engine's step phases to add up their host wall time (no extra syncs:
    `_record` is where the host waits for a step's tokens)."""
    totals: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                totals[name] = totals.get(name, 0.0) + time.perf_counter() - t0

        return wrapper

    engine._sched.prepare_step = timed("prepare_step", engine._sched.prepare_step)
    engine._runner.forward = timed("forward_launch", engine._runner.forward)
    engine._runner.forward_decode = timed("look_ahead_launch", engine._runner.forward_decode)
    engine._launch_sample = timed("sample_launch", engine._launch_sample)
    engine._record = timed("record_and_wait", engine._record)
    return totals


def time_graph_replays(runner) -> dict[str, float]:
    """Device time of one captured decode step at the largest batch, per block bucket."""
    graphs = runner.decode_graphs
    if graphs is None:
        return {}
    out = {}
    b, bs = graphs.batches[-1], runner.block_size
    # Valid inputs for every bucket: each row attends a full table of distinct blocks.
    ids = torch.arange(graphs._table_BN.numel(), device=runner.device) % runner.scratch_block
    graphs._table_BN.copy_(ids.view_as(graphs._table_BN))
    for n in graphs.blocks:
        graphs._pos_B.fill_(n * bs - 1)
        graph, _ = graphs._graphs[(b, n)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        out[f"B{b}_ctx{n * runner.block_size}"] = start.elapsed_time(end) / 10
    return out


def decode_path_difference(runner, prompts: list[list[int]]) -> float:
    """Max |logit| difference between the decode step (CUDA graph on GPU) and the padded
    SDPA path on the same cache state: a guard that the fast path computes the same thing.
    Uses the first blocks directly, before the engine has handed any out."""
    per_seq = runner.max_blocks_per_seq
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    batch = [SeqInput(token_ids=p, start=0, block_table=t) for p, t in zip(prompts, tables)]
    first = runner.forward(batch).argmax(-1).tolist()
    n = len(prompts[0])
    step = [SeqInput(token_ids=[f], start=n, block_table=t) for f, t in zip(first, tables)]
    fast = runner.forward(step).clone()
    padded = runner._forward_padded(step)
    return float((fast - padded).abs().max().detach())


def run_hf(state: dict, model_args: Qwen3ModelArgs, args, prompts, device, dtype) -> dict:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    a = model_args
    config = Qwen3Config(
        vocab_size=a.vocab_size,
        hidden_size=a.dim,
        intermediate_size=a.hidden_dim,
        num_hidden_layers=a.n_layers,
        num_attention_heads=a.n_heads,
        num_key_value_heads=a.n_kv_heads,
        head_dim=a.head_dim,
        rms_norm_eps=a.norm_eps,
        rope_theta=a.rope_theta,
        max_position_embeddings=args.prompt_len + args.hf_output_len,
        tie_word_embeddings=a.enable_weight_tying,
    )
    with torch.device(device):
        hf = Qwen3ForCausalLM(config).to(dtype).eval()
    hf_state = Qwen3StateDictAdapter(a, None).to_hf(state)
    missing, unexpected = hf.load_state_dict(hf_state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    input_ids = torch.from_numpy(prompts).long().to(device)
    n = args.hf_output_len

    def generate(new_tokens: int):
        return hf.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )

    with torch.inference_mode():
        generate(2)
        sync(device)
        t0 = time.perf_counter()
        out = generate(n)
        sync(device)
        wall = time.perf_counter() - t0
    tokens = (out.shape[1] - input_ids.shape[1]) * out.shape[0]
    return {"output_tokens": tokens, "wall_s": wall, "tok_per_s": tokens / wall}


def bandwidth_bound(model, model_args, args, bandwidth: float, elem_bytes: int) -> dict:
    a = model_args
    weight_bytes = sum(p.numel() for p in model.parameters()) * elem_bytes
    kv_per_token = 2 * a.n_layers * a.n_kv_heads * a.head_dim * elem_bytes
    avg_context = args.prompt_len + args.output_len / 2
    step_bytes = weight_bytes + args.num_requests * avg_context * kv_per_token
    return {
        "weight_bytes": weight_bytes,
        "kv_bytes_per_step": args.num_requests * avg_context * kv_per_token,
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "tok_per_s": args.num_requests / (step_bytes / bandwidth),
    }


def cpu_default_prompts(num_prompts: int) -> list[np.ndarray]:
    """The first training prompts of the default config (seed 0), rendered for the model."""
    from torchtitan_rl.envs.alphabet_sort import AlphabetSort, AlphabetSortConfig
    from torchtitan_rl.envs.base import EnvConfig
    from torchtitan_rl.models.renderer import Renderer
    from torchtitan_rl.models.tokenizer import Tokenizer

    env = AlphabetSort(EnvConfig(max_turns=1), 0, AlphabetSortConfig(sort_by="random"))
    renderer = Renderer(Tokenizer.from_file(None))

    async def render(i: int) -> np.ndarray:
        return renderer.render_prompt(await env.make_env(env.train_sample(i)).init())

    return [asyncio.run(render(i)) for i in range(num_prompts)]


def count_steps(engine) -> list[int]:
    """Counts engine steps (forwards) into the returned one-element list."""
    steps = [0]
    native = isinstance(engine, Engine)
    owner = engine.runner if native else engine._llm
    name = "forward" if native else "step"
    inner = getattr(owner, name)

    def counted(*a, **k):
        steps[0] += 1
        return inner(*a, **k)

    setattr(owner, name, counted)
    return steps


def cpu_default_rounds(engine, state, prompts, num_rounds: int) -> dict:
    """Timed rounds of one RL step's generation on `engine` (either backend)."""
    import hashlib

    steps = count_steps(engine)

    async def one_round(version: int):
        engine.load_weights(state, version)
        sampling = [
            SamplingParams(temperature=0.6, max_tokens=48, seed=1000 * version + i)
            for i in range(4 * len(prompts))
        ]
        return await asyncio.gather(
            *(
                engine.generate(prompts[i // 4], request_id=str(i), sampling=s)
                for i, s in enumerate(sampling)
            )
        )

    async def main():
        rounds, digest = [], hashlib.sha256()
        for version in range(num_rounds + 1):  # round 0 warms up
            steps[0] = 0
            t0 = time.perf_counter()
            outs = await one_round(version)
            wall = time.perf_counter() - t0
            for c in outs:
                digest.update(c.token_ids_N.tobytes() + c.logprobs_N.tobytes())
            rounds.append((wall, sum(c.num_tokens for c in outs), steps[0]))
        await engine.close()
        return rounds[1:], digest.hexdigest()[:16]

    rounds, digest = asyncio.run(main())
    walls = sorted(r[0] for r in rounds)
    _, tokens, num_steps = rounds[0]
    return {
        "rounds": len(rounds),
        "output_tokens_per_round": tokens,
        "engine_steps_per_round": num_steps,
        "median_round_ms": 1e3 * walls[len(walls) // 2],
        "best_round_ms": 1e3 * walls[0],
        "median_tok_per_s": tokens / walls[len(walls) // 2],
        "median_ms_per_engine_step": 1e3 * walls[len(walls) // 2] / num_steps,
        "digest": digest,
    }


def run_cpu_default(args) -> None:
    """Engine rounds shaped like one generation phase of the default CPU run (module doc),
    on the native engine and, when vLLM is installed, on the vllm backend."""
    import tempfile

    from torchtitan_rl.models.qwen3 import ModelConfig, build_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    prompts = cpu_default_prompts(16)
    model_config = ModelConfig(flavor="tiny", max_seq_len=512)
    model = build_model(model_config, 896, torch.device("cpu"))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    result = {"machine": platform.machine(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        folder = export_folder(model, Path(tmp) / "hf")
        engines = {
            "native": lambda: Engine(model, EngineConfig(max_num_seqs=128, max_seq_len=512), "cpu")
        }
        if importlib.util.find_spec("vllm") is None:
            print("vLLM: skipped (vllm is not installed)", flush=True)
        else:
            from torchtitan_rl.actors.generator import build_engine

            config = EngineConfig(backend="vllm", max_num_seqs=128, max_seq_len=512, block_size=32)
            engines["vllm"] = lambda: build_engine(
                model_config, config, 896, torch.device("cpu"), folder
            )
        for name, make in engines.items():
            result[name] = cpu_default_rounds(make(), state, prompts, args.rounds)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_generate_cpu_default.json").write_text(json.dumps(result, indent=2))
    for name in ("native", "vllm"):
        if name not in result:
            continue
        r = result[name]
        print(
            f"cpu-default {name} ({result['machine']}, torch {result['torch']}, 1 thread), "
            f"{r['rounds']} rounds of {r['output_tokens_per_round']} tokens in "
            f"{r['engine_steps_per_round']} engine steps: median {r['median_round_ms']:.0f} "
            f"ms/round (best {r['best_round_ms']:.0f}), {r['median_tok_per_s']:,.0f} output "
            f"tok/s, {r['median_ms_per_engine_step']:.2f} ms/engine step; digest {r['digest']}"
        )


def main() -> None:
    args = parse_args()
    if args.cpu_default:
        run_cpu_default(args)
        return
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype_name = "bfloat16" if device.type == "cuda" else "float32"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.smoke:
        model_args = Qwen3ModelArgs(**SMOKE_ARGS, max_seq_len=args.prompt_len + args.output_len)
    else:
        model_args = qwen3_args["0.6B"]
    model = build_model(model_args, device, dtype)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, model_args.vocab_size, (args.num_requests, args.prompt_len))
    prompts = prompts.astype(np.int32)

    results: dict = {
        "machine": torch.cuda.get_device_name() if device.type == "cuda" else platform.machine(),
        "torch": torch.__version__,
        "shape": "smoke" if args.smoke else "Qwen3-0.6B (random weights)",
        "dtype": dtype_name,
        "num_requests": args.num_requests,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        (out_dir / "bench_generate.json").write_text(json.dumps(results, indent=2))

    bandwidth = copy_bandwidth(device)
    results["bound"] = bandwidth_bound(model, model_args, args, bandwidth, dtype.itemsize)
    for attention in args.attention:
        key = f"engine_{attention}"
        try:
            results[key] = run_engine(model, args, prompts, device, dtype_name, attention)
        except Exception as exc:  # a failed variant is reported, the others still run
            if args.smoke:  # a smoke checks that the script works: fail loudly
                raise
            results[key] = {"error": f"{type(exc).__name__}: {exc}"}
        gc.collect()  # the engine's cycles (graphs, loop) hold its KV cache until collected
        torch.cuda.empty_cache() if device.type == "cuda" else None
        save()
        print(f"{key}: {results[key]}", flush=True)
    if importlib.util.find_spec("vllm") is None:
        print("vLLM: skipped (vllm is not installed)", flush=True)
    elif device.type == "cuda":  # on CPU: --cpu-default has the vLLM row
        rows = {
            "llm": ("vllm_llm", lambda: run_vllm_llm(model, args, prompts, dtype_name)),
            "backend": ("vllm", lambda: run_vllm(model, args, prompts, device, dtype_name)),
        }
        for key, run in (rows[name] for name in args.vllm.split(",") if name):
            try:
                results[key] = run()
            except Exception as exc:  # reported, the other rows still run
                results[key] = {"error": f"{type(exc).__name__}: {exc}"}
            save()
            print(f"{key}: {results[key]}", flush=True)
    if not args.skip_hf and importlib.util.find_spec("transformers") is None:
        print("HF transformers generate: skipped (transformers is not installed)", flush=True)
    elif not args.skip_hf:
        del model
        torch.cuda.empty_cache() if device.type == "cuda" else None
        results["hf"] = run_hf(state, model_args, args, prompts, device, dtype)
        results["hf"]["output_len"] = args.hf_output_len
        save()
    print_table(results)


def print_table(results: dict) -> None:
    rows = [
        (f"native engine, decode attention {k[7:]}", results[k].get("tok_per_s", float("nan")))
        for k in results
        if k.startswith("engine_")
    ]
    if "vllm_llm" in results:
        rows.append(("vLLM LLM (plain vLLM)", results["vllm_llm"].get("tok_per_s", float("nan"))))
    if "vllm" in results:
        rows.append(
            ("vLLM (generator.backend = vllm)", results["vllm"].get("tok_per_s", float("nan")))
        )
    if "hf" in results:
        rows.append(
            (
                f"HF transformers generate ({results['hf']['output_len']} new)",
                results["hf"]["tok_per_s"],
            )
        )
    rows.append(("memory-bandwidth bound", results["bound"]["tok_per_s"]))
    print(
        f"\n{results['shape']}, {results['dtype']}, {results['num_requests']} requests x "
        f"({results['prompt_len']} prompt + {results['output_len']} output), {results['machine']}"
    )
    print(f"| {'implementation':<44} | {'output tok/s':>12} |")
    print(f"|{'-' * 46}|{'-' * 14}|")
    for name, value in rows:
        print(f"| {name:<44} | {value:>12,.0f} |")


if __name__ == "__main__":
    main()
