"""A multi-turn verifiers 0.4.0 environment for the tests ("verifiers:vf-guess"): guess a
digit, told "higher" or "lower" after each wrong guess. Its own Env plays the turns (an
interaction, as verifiers' TextArena env does); its own @reward scores the trace."""

import verifiers.v1 as vf


class GuessData(vf.TaskData):
    secret: int


class GuessTask(vf.Task[GuessData]):
    @vf.reward(weight=1.0)
    async def found(self, trace: vf.Trace) -> float:
        replies = [m.content.strip() for m in trace.assistant_messages]
        return float(str(self.data.secret) in replies)


class GuessConfig(vf.TasksetConfig):
    num_tasks: int = 40


class GuessTaskset(vf.Taskset[GuessTask, GuessConfig]):
    def load(self) -> list[GuessTask]:
        return [
            GuessTask(
                GuessData(
                    name=f"guess#{i}",
                    prompt="Guess my digit.",
                    system_prompt="Answer with one digit.",
                    secret=i % 10,
                ),
                self.config.task,
            )
            for i in range(self.config.num_tasks)
        ]


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()
    max_guesses: int = 3


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        async with agents.player.interaction(task) as chat:
            segment = await chat.turn()
            for _ in range(self.config.max_guesses - 1):
                guess = segment.last_reply
                if segment.terminated or guess == str(task.data.secret):
                    break
                low = not guess.isdigit() or int(guess) < task.data.secret
                segment = await chat.turn("higher" if low else "lower")


__all__ = ["GuessEnv", "GuessTaskset"]
