"""TrainerCore in one process: steps change weights, bad numbers never reach the weights."""

import numpy as np
import pytest
import torch
import torch.distributed as dist
from fakes import tiny_core

from torchtitan_rl.rollout.batcher import BatcherConfig, pack_batch
from torchtitan_rl.training.parallelize import apply_compile
from torchtitan_rl.training.trainer_config import WarmStartConfig
from torchtitan_rl.types import Episode
from torchtitan_rl.weight_sync.packing import pack_weights, unpack_weights

VOCAB = 96


def _core(device="cpu", **training):
    return tiny_core(device=device, **training)


def _episodes(rng, n=6, advantage=1.0, logprob=-3.0):
    out = []
    for i in range(n):
        length = int(rng.integers(6, 20))
        mask = np.zeros(length, bool)
        mask[length // 2 :] = True
        out.append(
            Episode(
                token_ids_L=rng.integers(0, VOCAB, length).astype(np.int32),
                loss_mask_L=mask,
                logprobs_L=np.where(mask, logprob, 0).astype(np.float32),
                advantages_L=np.where(mask, advantage * (1 if i % 2 else -1), 0).astype(np.float32),
                rollout_id=i,
            )
        )
    return out


def _batch(episodes):
    batches, _ = pack_batch(
        episodes, config=BatcherConfig(seq_len=64, rows_per_microbatch=2), num_ranks=1, pad_id=0
    )
    return batches[0]


def _weights(core):
    return {k: v.clone() for k, v in core.full_state_dict().items()}


def test_rl_step_changes_weights_and_advances_version():
    core = _core()
    before = _weights(core)
    out = core.train_step([_batch(_episodes(np.random.default_rng(0)))], temperature=1.0)
    after = _weights(core)
    assert core.policy_version == 1 and out["trainer/policy_version"] == 1
    assert any(not torch.equal(before[k], after[k]) for k in before)
    for tag in ("loss/mean", "trainer/grad_norm", "trainer/lr", "trainer/logprob_diff/max"):
        assert np.isfinite(out[tag])


def test_nan_generator_logprobs_leave_step_finite():
    core = _core()
    episodes = _episodes(np.random.default_rng(1))
    episodes[0].logprobs_L[episodes[0].loss_mask_L.nonzero()[0][0]] = np.nan
    episodes[1].logprobs_L[episodes[1].loss_mask_L.nonzero()[0][0]] = -np.inf
    out = core.train_step([_batch(episodes)], temperature=1.0)
    assert np.isfinite(out["loss/mean"]) and np.isfinite(out["trainer/grad_norm"])
    assert out["trainer/skipped_steps"] == 0
    assert all(torch.isfinite(v).all() for v in _weights(core).values())


def test_non_finite_gradient_skips_the_step_and_keeps_weights():
    core = _core()
    before = _weights(core)
    # an infinite advantage makes the loss and gradient non-finite
    episodes = _episodes(np.random.default_rng(2), advantage=float("inf"))
    out = core.train_step([_batch(episodes)], temperature=1.0)
    assert out["trainer/skipped_steps"] == 1 and core.policy_version == 0
    after = _weights(core)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_sft_steps_lower_the_loss():
    core = _core()
    opt = core.begin_warm_start(WarmStartConfig(lr=1e-2))
    batch = _batch(_episodes(np.random.default_rng(3)))
    out = core.sft_step(batch, opt)
    first = out["warm_start/loss"]
    # warm-start steps log at <= 0: under warm_start/, off the RL grad-norm chart
    assert sorted(out) == ["warm_start/grad_norm", "warm_start/loss", "warm_start/skipped_steps"]
    for _ in range(15):
        last = core.sft_step(batch, opt)["warm_start/loss"]
    assert last < first * 0.8


def test_trainer_logprobs_match_the_generator_logprobs_it_is_given():
    """With generator log-probs equal to the trainer's own, the step reports ~0 mismatch."""
    core = _core()
    episodes = _episodes(np.random.default_rng(4))
    batch = _batch(episodes)
    own = core.logprobs(batch[0])
    mb = batch[0]
    flat = mb.logprobs_RS.reshape(-1)
    flat[np.flatnonzero(mb.loss_mask_RS.reshape(-1))] = own
    out = core.train_step([[mb]], temperature=1.0)
    assert out["trainer/logprob_diff/max"] < 1e-5


def test_packed_weights_round_trip():
    state = {"a": torch.randn(3, 4), "b.c": torch.randn(5)}
    packed = pack_weights(state, version=7)
    assert packed.version == 7 and packed.flat_P.numel() == 17
    back = unpack_weights(packed)
    assert all(torch.equal(state[k], back[k]) for k in state)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_follow_temperature(temperature):
    core = _core()
    mb = _batch(_episodes(np.random.default_rng(5)))[0]
    lp = core.logprobs(mb, temperature)
    assert np.all(lp <= 0) and np.all(np.isfinite(lp))


def _logprobs_and_grads(core, mb):
    """Log-probs of mb's loss tokens and the gradients of their sum."""
    logprobs_N, _ = core._logprobs(core._tensors(mb), 1.0)
    core.model.zero_grad(set_to_none=True)
    logprobs_N.sum().backward()
    return logprobs_N.detach(), {k: p.grad.clone() for k, p in core.model.named_parameters()}


def test_compiled_blocks_trace_whole_and_match_eager_on_cpu():
    """Each block compiles to one graph (fullgraph), gives eager's numbers, keeps parameter
    names, and a batch with other documents reuses the graph (no recompile)."""
    core = _core()
    first, second = (_batch(_episodes(np.random.default_rng(s)))[0] for s in (0, 1))
    eager = [_logprobs_and_grads(core, mb) for mb in (first, second)]
    names = list(core.model.state_dict())
    apply_compile(core.model, backend="aot_eager")
    compiled = [_logprobs_and_grads(core, first)]
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled.append(_logprobs_and_grads(core, second))
    assert list(core.model.state_dict()) == names
    for (lp_e, grads_e), (lp_c, grads_c) in zip(eager, compiled):
        torch.testing.assert_close(lp_c, lp_e, atol=1e-5, rtol=0)
        for k in grads_e:
            torch.testing.assert_close(grads_c[k], grads_e[k], atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_training_matches_eager_in_bf16_on_gpu(monkeypatch):
    """The production single-GPU path (1-rank FSDP, bf16 compute): training.compile gives
    the eager losses and gradient norms within bf16 tolerance over two steps, and the
    second batch (other documents, same [R, S]) reuses the compiled graph."""
    from torch.nn.attention.flex_attention import flex_attention

    from torchtitan_rl.models.qwen3 import FlexAttention

    # eager FlexAttention (no compile of its own); the compiled blocks trace it
    monkeypatch.setattr(FlexAttention, "_compiled_defaults", flex_attention)
    torch.cuda.set_device(0)
    batches = [_batch(_episodes(np.random.default_rng(s), n=12)) for s in (0, 1)]
    results = {}
    for compiled in (False, True):
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
        try:
            core = _core("cuda", dtype="bfloat16", compile=compiled)
            steps = [core.train_step([batches[0]], temperature=1.0)]
            with torch._dynamo.config.patch(error_on_recompile=compiled):
                steps.append(core.train_step([batches[1]], temperature=1.0))
            results[compiled] = [(s["loss/mean"], s["trainer/grad_norm"]) for s in steps]
        finally:
            dist.destroy_process_group()
    print(results)
    # bf16 keeps 8 bits of mantissa (2^-8 = 3.9e-3); fusion changes rounding order
    np.testing.assert_allclose(results[True], results[False], rtol=2e-2)
