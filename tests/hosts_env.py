"""A test environment whose reward depends on every sampled token, so two runs that sample
differently score differently even when the policy is untrained (AlphabetSort scores 0 until
a model writes answer tags). Plugged in as env.name = "hosts_env:EvenTokens"."""

from torchtitan_rl.envs.base import Environment, MessageEnv, Rubric, StepResult


class _OneTurn(MessageEnv):
    def __init__(self, sample):
        self.sample = sample

    async def init(self):
        return [{"role": "user", "content": f"Say something about {self.sample['word']}."}]

    async def step(self, assistant_message):
        return StepResult(messages=[], done=True)


def even_tokens(rollout) -> float:
    """The fraction of sampled token ids that are even (truncated turns count too)."""
    ids = [int(t) for turn in rollout.turns for t in turn.completion.token_ids_N]
    return sum(1 for t in ids if t % 2 == 0) / max(1, len(ids))


class EvenTokens(Environment):
    config_class = None

    def train_sample(self, index):
        return {"word": ["apple", "river", "stone", "cloud"][index % 4] + str(index)}

    def validation_samples(self, n):
        return [self.train_sample(10_000 + i) for i in range(n)]

    def make_env(self, sample):
        return _OneTurn(sample)

    def rubric(self):
        return Rubric([("even_tokens", even_tokens, 1.0)])
