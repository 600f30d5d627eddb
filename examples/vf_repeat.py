"""A verifiers 0.4.0 taskset to start from: repeat a word ("verifiers:vf-repeat").

verifiers finds a taskset by id: "vf-repeat" imports the module `vf_repeat`, so put this
folder on the path and name it:

    PYTHONPATH=examples ./run_train.sh --env.name=verifiers:vf-repeat \\
        --model.hf_checkpoint=path/to/Qwen3-0.6B --warm_start.steps=0

A taskset carries no demonstrations, so the run needs a model that can already answer
(`model.hf_checkpoint`, a Qwen3 folder): a random-init model earns 0 reward and learns
nothing. Copy this file to write your own: tasks are `vf.Task`s with their data, rewards
are `@vf.reward` methods (weighted and summed), `@vf.metric` methods are logged only, and
the config's fields are set from `[env.args.taskset]` (`--env.args.taskset.num_tasks=32`).
"""

import verifiers.v1 as vf

WORDS = ("apple", "river", "stone", "cloud", "maple", "ember", "quill", "tundra")


class RepeatData(vf.TaskData):
    answer: str
    """The word the reply must be, exactly."""


class RepeatTask(vf.Task[RepeatData]):
    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        """1 for the word alone; surrounding spaces are forgiven."""
        return float(trace.last_reply.strip() == self.data.answer)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class RepeatConfig(vf.TasksetConfig):
    num_tasks: int = 256
    """How many distinct words (a word from WORDS and a number)."""


class RepeatTaskset(vf.Taskset[RepeatTask, RepeatConfig]):
    def load(self) -> list[RepeatTask]:
        tasks = []
        for i in range(self.config.num_tasks):
            word = f"{WORDS[i % len(WORDS)]}{i}"
            data = RepeatData(
                prompt=f"Repeat this word: {word}",
                system_prompt="Reply with the word only.",
                answer=word,
            )
            tasks.append(RepeatTask(data, self.config.task))
        return tasks


__all__ = ["RepeatTaskset"]
