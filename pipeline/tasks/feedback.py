"""A multi-turn game on the arithmetic task: answer, hear "higher" or "lower", try again.

Each turn the model states a number; the environment compares it with the record's ``answer``
and, while it is wrong and turns remain (``episode.max_turns``), appends ``"Too low. Try
again: "`` or ``"Too high. Try again: "`` (masked out of the loss) for the next turn. The reward
is 1 / (the turn of the first right answer), 0 if none was right: answering right at once pays
most, and using the feedback still pays.

Use it with ``--episode.fn pipeline.tasks.feedback:episode --episode.max_turns 3`` on
``--data arithmetic:N``. ``GuessEnv`` is the same game as an environment class
(``--episode.fn pipeline.tasks.feedback:GuessEnv``): ``reset``/``step`` instead of a coroutine.
"""

from __future__ import annotations

from typing import Any

from pipeline.tasks.rewards import stated_answer


def feedback(guess: int | None, answer: int) -> str:
    """What the environment says to a wrong guess."""
    if guess is None:
        return "Answer with a number. Try again: "
    return "Too low. Try again: " if guess < answer else "Too high. Try again: "


async def episode(ctx: Any, prompt: Any, answer: str | None = None, **meta: Any) -> float:
    """Turns until right or out of turns; reward 1/turn of the right answer."""
    try:
        target = int(str(answer).strip())
    except ValueError:
        return 0.0  # nothing to verify (as exact_match)
    say = None
    for turn in range(1, ctx.limits.max_turns + 1):
        try:
            reply = await ctx.generate(say)
        except ctx.EpisodeOver:  # the token budget ran out
            return 0.0
        guess = stated_answer(reply.text)
        if guess == target:
            return 1.0 / turn
        say = "\n" + feedback(guess, target)
    return 0.0


class GuessEnv:
    """The game as a gym-style environment (``pipeline.producer.episode.environment_episode``):
    ``step`` gets each reply and returns (feedback or None, reward, done)."""

    def reset(self, prompt: Any, answer: str | None = None, **meta: Any) -> None:
        try:
            self.target: int | None = int(str(answer).strip())
        except ValueError:
            self.target = None
        self.turn = 0
        return None  # the prompt alone opens the first turn

    def step(self, reply: str) -> tuple[str | None, float, bool]:
        self.turn += 1
        if self.target is None:
            return None, 0.0, True
        guess = stated_answer(reply)
        if guess == self.target:
            return None, 1.0 / self.turn, True
        return "\n" + feedback(guess, self.target), 0.0, False
