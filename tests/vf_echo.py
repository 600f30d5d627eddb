"""A single-turn verifiers 0.4.0 environment for the tests ("verifiers:vf-echo"): repeat a
word. In-memory tasks, scored by its own @reward; `raise_in_reward` makes the reward raise."""

import verifiers.v1 as vf

WORDS = ("ant", "bee", "cat", "dog", "eel", "fox", "gnu", "hen")


class EchoData(vf.TaskData):
    answer: str
    raise_in_reward: bool = False


class EchoTask(vf.Task[EchoData]):
    @vf.reward(weight=2.0)
    async def exact(self, trace: vf.Trace) -> float:
        if self.data.raise_in_reward:
            raise KeyError("the reward's own bug")
        return float(trace.last_reply == self.data.answer)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class EchoConfig(vf.TasksetConfig):
    num_tasks: int = 64
    raise_in_reward: bool = False


class EchoTaskset(vf.Taskset[EchoTask, EchoConfig]):
    def load(self) -> list[EchoTask]:
        tasks = []
        for i in range(self.config.num_tasks):
            word = f"{WORDS[i % len(WORDS)]}{i}"
            data = EchoData(
                prompt=f"Say {word}",
                system_prompt="Reply with the word only.",
                answer=word,
                raise_in_reward=self.config.raise_in_reward,
            )
            tasks.append(EchoTask(data, self.config.task))
        return tasks


__all__ = ["EchoTaskset"]
