"""The training stage of an RL step: rollout groups -> episodes -> packed microbatches -> one
call to the trainer (an optimizer step per minibatch of whole groups).

    stage = TrainStage(config, pad_id=tokenizer.pad_id)
    batches, metrics = stage.pack(episodes)           # the warm start packs with it too
    scalars = await stage.train(trainer, groups)      # {} of trainer/* when nothing trains
"""

from __future__ import annotations

from torchtitan_rl.config import Config
from torchtitan_rl.reductions import merge, results
from torchtitan_rl.rollout.batcher import pack_batch
from torchtitan_rl.rollout.episodes import rollout_to_episodes
from torchtitan_rl.types import Episode, RolloutGroup


class TrainStage:
    def __init__(self, config: Config, *, pad_id: int):
        self.config = config
        self.pad_id = pad_id

    def pack(self, episodes: list[Episode]):
        """(microbatches per rank, batcher metrics) of `episodes`."""
        return pack_batch(
            episodes,
            config=self.config.batcher,
            num_ranks=self.config.parallelism.dp,  # the ranks of one TP group share a slice
            pad_id=self.pad_id,
        )

    async def train(self, trainer, groups: list[RolloutGroup]) -> dict[str, float]:
        """One RL step on `trainer`: an optimizer step per minibatch of whole groups
        (`training.minibatches`), in one call (pi_old is recomputed before the first).
        Nothing to train on: no call, and no `trainer/*` scalars."""
        n = self.config.training.minibatches
        updates, packed = [], []
        for chunk in (groups[i::n] for i in range(n)):
            batches, batch_metrics = self.pack(episodes_of(chunk))
            packed.append(batch_metrics)
            if any(mb.num_global_loss_tokens for mb in batches[0]):
                updates.append(batches)
        metrics = results(merge(packed))
        if not updates:
            return metrics
        out = await trainer.train_step.call(updates, self.config.rollout.temperature)
        return {**metrics, **next(iter(out.values()))}


def episodes_of(groups: list[RolloutGroup]) -> list[Episode]:
    """Every episode of every rollout of `groups`, in order."""
    return [e for g in groups for r in g.rollouts for e in rollout_to_episodes(r)]
