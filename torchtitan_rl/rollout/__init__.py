"""From prompts to trainable microbatches: rollouts, advantages, episodes, packing."""

from torchtitan_rl.rollout.advantages import AdvantageConfig, compute_advantages, group_has_signal
from torchtitan_rl.rollout.batcher import BatcherConfig, pack_batch
from torchtitan_rl.rollout.episodes import rollout_to_episodes
from torchtitan_rl.rollout.rollout_config import RolloutConfig
from torchtitan_rl.rollout.rollouter import (
    Rollouter,
    request_id_for,
    request_seed,
    session_id_for,
)
from torchtitan_rl.rollout.token_env import TokenEnv, TokenEnvError, TokenStep

__all__ = [
    "AdvantageConfig",
    "BatcherConfig",
    "RolloutConfig",
    "Rollouter",
    "TokenEnv",
    "TokenEnvError",
    "TokenStep",
    "compute_advantages",
    "group_has_signal",
    "pack_batch",
    "request_id_for",
    "request_seed",
    "rollout_to_episodes",
    "session_id_for",
]
