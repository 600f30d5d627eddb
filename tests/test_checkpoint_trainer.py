"""Trainer state through torch.distributed.checkpoint: a restored core continues exactly."""

import numpy as np
import pytest
import torch
from fakes import tiny_core

from torchtitan_rl.losses.policy_loss import LossConfig
from torchtitan_rl.rollout.batcher import BatcherConfig, pack_batch
from torchtitan_rl.training.checkpoint import load_trainer_state, save_trainer_state
from torchtitan_rl.types import Episode

VOCAB = 96


def _core(seed=0, kl_coef=0.0):
    return tiny_core(seed=seed, loss=LossConfig(kl_coef=kl_coef), warmup_steps=5, weight_decay=0.1)


def _batch(seed):
    rng = np.random.default_rng(seed)
    episodes = []
    for i in range(4):
        length = int(rng.integers(6, 20))
        mask = np.zeros(length, bool)
        mask[length // 2 :] = True
        episodes.append(
            Episode(
                token_ids_L=rng.integers(0, VOCAB, length).astype(np.int32),
                loss_mask_L=mask,
                logprobs_L=np.where(mask, -3.0, 0).astype(np.float32),
                advantages_L=np.where(mask, 1.0 if i % 2 else -1.0, 0).astype(np.float32),
                rollout_id=i,
            )
        )
    batches, _ = pack_batch(
        episodes, config=BatcherConfig(seq_len=64, rows_per_microbatch=2), num_ranks=1, pad_id=0
    )
    return batches[0]


def _no_timings(metrics):
    return {k: v for k, v in metrics.items() if not k.startswith("perf/")}


@pytest.mark.parametrize("kl_coef", [0.0, 0.5])
def test_restored_trainer_continues_exactly(tmp_path, kl_coef):
    """With a KL penalty the frozen reference comes back from the checkpoint too (the
    resumed core starts from other weights, so loss/kl would differ otherwise)."""
    straight = _core(kl_coef=kl_coef)
    for step in range(4):
        out_straight = straight.train_step([_batch(step)], temperature=1.0)

    first = _core(kl_coef=kl_coef)
    for step in range(2):
        first.train_step([_batch(step)], temperature=1.0)
    save_trainer_state(first, tmp_path / "trainer")
    # different init: everything must come from the checkpoint
    resumed = _core(seed=1, kl_coef=kl_coef)
    assert load_trainer_state(resumed, tmp_path / "trainer") == 2
    assert resumed.scheduler.last_epoch == first.scheduler.last_epoch
    for step in range(2, 4):
        out_resumed = resumed.train_step([_batch(step)], temperature=1.0)

    # loss, grad norm, lr (warmup position), version, kl; not timings
    assert _no_timings(out_resumed) == _no_timings(out_straight)
    assert (out_straight.get("loss/kl", 1.0)) > 0
    a, b = straight.full_state_dict(), resumed.full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_one_rank_group_saves_and_loads_without_collectives(tmp_path, monkeypatch):
    """In a gloo group of one, DCP must not run its collectives: on CPU one large gloo
    collective made every later train step ~40% slower (scripts/bench_checkpoint_slowdown.py).
    Every collective raises while the state is saved and loaded."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        core = _core()
        core.train_step([_batch(0)], temperature=1.0)
        resumed = _core(seed=1)
        with monkeypatch.context() as patch:
            for name in (
                "all_gather_object",
                "gather_object",
                "broadcast_object_list",
                "scatter_object_list",
                "all_reduce",
                "barrier",
                "all_gather",
            ):
                patch.setattr(dist, name, _refuse(name))
            save_trainer_state(core, tmp_path / "trainer")
            assert load_trainer_state(resumed, tmp_path / "trainer") == core.policy_version
        a, b = core.full_state_dict(), resumed.full_state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)
    finally:
        dist.destroy_process_group()


def _refuse(name):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a collective ({name}) in a group of one")

    return refuse


@pytest.mark.parametrize("kl_coef", [0.0, 0.5])
def test_a_lora_checkpoint_holds_the_adapters_only_and_resumes_exactly(tmp_path, kl_coef):
    """The base is rebuilt from the seed, not saved; the adapters, their Adam moments and
    (with KL) the reference's adapters come back, and a resume continues exactly. A
    resume on another base (another seed) is refused."""
    import torch.distributed.checkpoint as dcp
    from test_lora import lora_core

    from torchtitan_rl.models.lora import lora_modules

    loss = LossConfig(kl_coef=kl_coef)
    straight = lora_core(loss=loss)
    for step in range(4):
        out_straight = straight.train_step([_batch(step)], temperature=1.0)
    first = lora_core(loss=loss)
    for step in range(2):
        first.train_step([_batch(step)], temperature=1.0)
    save_trainer_state(first, tmp_path / "trainer")
    saved = dcp.FileSystemReader(str(tmp_path / "trainer")).read_metadata().state_dict_metadata
    model_keys = {k for k in saved if k.startswith(("model.", "reference."))}
    assert model_keys and all(k.endswith(("lora_A", "lora_B")) for k in model_keys)
    assert "lora_base" in saved

    resumed = lora_core(loss=loss)
    with torch.no_grad():  # other adapters: they must come from the checkpoint
        for _, m in lora_modules(resumed.model):
            m.lora_A.add_(1.0)
    assert load_trainer_state(resumed, tmp_path / "trainer") == 2
    for step in range(2, 4):
        out_resumed = resumed.train_step([_batch(step)], temperature=1.0)
    assert _no_timings(out_resumed) == _no_timings(out_straight)
    a, b = straight.full_state_dict(), resumed.full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)

    with pytest.raises(ValueError, match="belong to base .*seed.: 0.*this run's is .*seed.: 1"):
        load_trainer_state(lora_core(seed=1, loss=loss), tmp_path / "trainer")
    # another rank: the clear line, before the adapters' shapes could fail to match
    with pytest.raises(ValueError, match="belong to base .*rank.: 4.*this run's is .*rank.: 8"):
        load_trainer_state(lora_core(rank=8, loss=loss), tmp_path / "trainer")
