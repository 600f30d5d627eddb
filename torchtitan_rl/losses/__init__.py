"""Log-probs from hidden states, GRPO-family policy losses, off-policy corrections."""

from torchtitan_rl.losses.corrections import CorrectionConfig, correction_weights
from torchtitan_rl.losses.logprobs import token_logprobs
from torchtitan_rl.losses.policy_loss import LOG_RATIO_CLAMP, LOSSES, LossConfig, policy_loss

__all__ = [
    "LOG_RATIO_CLAMP",
    "LOSSES",
    "CorrectionConfig",
    "LossConfig",
    "correction_weights",
    "policy_loss",
    "token_logprobs",
]
