"""Multi-turn episodes: a user coroutine that generates, calls tools and generates again, whose
whole transcript becomes one completion of a GRPO group.

The user writes ``async def episode(ctx, prompt, **meta)`` (named by ``episode.fn``), or a
class with ``reset(prompt, **meta)`` and ``step(reply) -> (observation, reward, done)`` that
:func:`environment_episode` drives; the producer runs G of them per prompt as one group.
``ctx`` (:class:`EpisodeContext`) offers:

- ``await ctx.generate(messages_or_tokens=None, **sampling)``: one turn. With no argument it
  continues the transcript; a string is environment text appended first; a list of token ids or
  of chat messages is the whole conversation so far, whose tokens beyond the transcript are
  appended first as environment tokens (they must extend it: token in, token out). ``sampling``
  overrides the run's ``generation`` options for this turn. Returns a :class:`Turn`.
- ``ctx.append(text_or_tokens)``: environment output (a tool's answer) after the last turn.
- ``await ctx.tool(fn, *args, **kwargs)``: a sync or async tool under ``episode.tool_timeout_s``;
  one that raises or hangs raises :class:`ToolError`, which fails the episode.
- ``ctx.text`` / ``ctx.token_ids``: the completion so far (after the prompt).

Invariants of the completion an episode yields (:class:`Transcript`):
- tokens the policy sampled keep their behaviour logprobs and per-token versions (each turn is
  one engine request, admitted through the sync barrier's gate and tagged like any completion,
  so a swap between or inside turns tags later tokens with the new version);
- environment tokens are ``masked_spans`` (out of the loss, logprob 0) and carry the version of
  the token before them, so they never make the group look older or newer than its sampled
  tokens; versions stay non-decreasing;
- the completion never exceeds ``episode.max_tokens``: each turn generates at most what is
  left, environment output is cut at the budget, and a turn past ``max_turns`` or the budget
  raises :class:`EpisodeOver`, which ends the episode normally (not a failure).
The reward is the episode's return value (a number, or a dict of named numbers summed), or, when
it returns None, the run's reward functions applied to the final transcript text.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from buffer.schema import Completion
from pipeline.producer.trained_sampling import DEFAULT, add_segment
from sync.threads import in_daemon_thread

log = logging.getLogger(__name__)

# (request id, prompt token ids, sampling overrides) -> (completion of that request, its text)
GenerateFn = Callable[[str, list[int], dict[str, Any]], Awaitable[tuple[Completion, str]]]


class EpisodeOver(Exception):
    """A limit (``episode.max_turns``, ``episode.max_tokens``, the context length) ended the
    episode: the transcript so far is its completion. Not a failure."""


class ToolError(RuntimeError):
    """A tool call raised or ran past ``episode.tool_timeout_s``: the episode fails."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind  # "timeout" or "error"


@dataclass(frozen=True)
class EpisodeLimits:
    """The limits of one episode (``episode`` config, and the context left after the prompt)."""

    max_turns: int
    max_tokens: int
    tool_timeout_s: float
    timeout_s: float


def episode_limits(cfg: Any) -> EpisodeLimits:
    """The limits of ``cfg`` (an ``EpisodeConfig``)."""
    return EpisodeLimits(cfg.max_turns, cfg.max_tokens, cfg.tool_timeout_s, cfg.timeout_s)


@dataclass
class Turn:
    """One generate call's result."""

    text: str
    token_ids: list[int]
    finish_reason: str
    versions: list[int]
    """Policy version of each token of this turn."""


@dataclass
class Transcript:
    """The completion of one episode as it grows (pure bookkeeping, no engine)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    segments: list[tuple[int, int]] = field(default_factory=list)
    masked_spans: list[tuple[int, int]] = field(default_factory=list)
    sampling: list[tuple[int, float, float, int]] = field(default_factory=list)
    turns: int = 0
    finish_reason: str = ""

    def __len__(self) -> int:
        return len(self.token_ids)

    def _tag(self, start: int, version: int) -> None:
        if not self.segments:
            self.segments.append((start, version))
        elif version != self.segments[-1][1]:
            if version < self.segments[-1][1]:
                raise ValueError(
                    f"turn of version {version} after tokens of version "
                    f"{self.segments[-1][1]}: versions must not go back"
                )
            self.segments.append((start, version))

    def add_generated(self, comp: Completion) -> None:
        """A turn's tokens: its logprobs and version segments, shifted to this transcript."""
        start = len(self.token_ids)
        n = len(comp.token_ids)
        self.turns += 1
        self.finish_reason = comp.finish_reason
        if not n:
            return
        for s, v in comp.version_segments:
            if s < n:
                self._tag(start + s, v)
        # Each turn may override the sampling: its distribution is carried from its first token.
        turn = comp.sampling_segments
        ends = [s for s, *_ in turn[1:]] + [n] if turn else []
        if not turn or turn[0][0] > 0:
            add_segment(self.sampling, start, DEFAULT)
        for (s, *dist), end in zip(turn, ends, strict=True):
            if s < end:
                add_segment(self.sampling, start + s, tuple(dist))
        self.token_ids.extend(int(t) for t in comp.token_ids)
        self.logprobs.extend(float(x) for x in comp.logprobs)

    def add_env(self, ids: Sequence[int], version: int) -> None:
        """Environment tokens: masked out of the loss, tagged with the last token's version
        (``version`` only when the transcript has no token yet)."""
        if not ids:
            return
        start = len(self.token_ids)
        self._tag(start, self.segments[-1][1] if self.segments else version)
        self.token_ids.extend(int(t) for t in ids)
        self.logprobs.extend([0.0] * len(ids))
        if self.masked_spans and self.masked_spans[-1][1] == start:
            self.masked_spans[-1] = (self.masked_spans[-1][0], len(self.token_ids))
        else:
            self.masked_spans.append((start, len(self.token_ids)))

    def completion(self, version: int) -> Completion:
        """The transcript as one Completion (``version`` tags an empty one)."""
        return Completion(
            token_ids=np.asarray(self.token_ids, dtype=np.int32),
            logprobs=np.asarray(self.logprobs, dtype=np.float32),
            version_segments=list(self.segments) or [(0, version)],
            finish_reason=self.finish_reason,
            masked_spans=list(self.masked_spans),
            sampling_segments=list(self.sampling),
        )

    @property
    def generated_tokens(self) -> int:
        return len(self.token_ids) - sum(e - s for s, e in self.masked_spans)


def turn_budget(limits: EpisodeLimits, used_turns: int, used_tokens: int, context_left: int) -> int:
    """Tokens the next turn may generate: 0 when the episode must end (turns or tokens spent).
    ``context_left`` is what engine.max_model_len leaves after the prompt (and one token)."""
    if used_turns >= limits.max_turns:
        return 0
    return max(0, min(limits.max_tokens, context_left) - used_tokens)


def extension(current: Sequence[int], full: Sequence[int]) -> list[int]:
    """The tokens of ``full`` after ``current``; ValueError when ``full`` does not start with
    ``current`` (a re-rendered conversation must extend the tokens the policy saw)."""
    n = len(current)
    if len(full) < n or list(full[:n]) != list(current):
        first = next(
            (i for i, (a, b) in enumerate(zip(current, full, strict=False)) if a != b),
            min(n, len(full)),
        )
        raise ValueError(
            f"the conversation passed to ctx.generate does not extend the "
            f"transcript: its tokens differ from position {first} of {n} (render "
            f"messages so that earlier turns keep their tokens, or pass text)"
        )
    return list(full[n:])


def episode_reward(value: Any) -> tuple[float, dict[str, float]] | None:
    """(total, breakdown) from an episode's return value; None when it returned None (the
    reward functions score the transcript). TypeError/ValueError for anything else."""
    if value is None:
        return None
    if isinstance(value, bool | int | float | np.number):
        v = float(value)
        if not np.isfinite(v):
            raise ValueError(f"the episode returned a non-finite reward {value!r}")
        return v, {"episode": v}
    if isinstance(value, dict):
        parts = {str(k): float(v) for k, v in value.items()}
        if not all(np.isfinite(v) for v in parts.values()):
            raise ValueError(f"the episode returned a non-finite reward {value!r}")
        return sum(parts.values()), parts
    raise TypeError(
        f"an episode returns a number, a dict of numbers or None, got {type(value).__name__}"
    )


def load_episode(path: str) -> Callable[..., Awaitable[Any]]:
    """The episode coroutine function ``path`` names (``episode.fn``), or one that drives the
    environment class it names (:func:`environment_episode`); ValueError with one line when it
    cannot be imported or is neither."""
    from pipeline.producer.rewards.loading import load_callable

    try:
        fn = load_callable(path)
    except (ImportError, ValueError) as e:
        raise ValueError(str(e).replace("reward path", "path")) from None
    if inspect.isclass(fn):
        missing = [m for m in ("reset", "step") if not callable(getattr(fn, m, None))]
        if missing:
            raise ValueError(f"{path!r}: an environment class needs {' and '.join(missing)}")
        try:
            inspect.signature(fn).bind()
        except TypeError as e:
            raise ValueError(f"{path!r}: an environment class is built with no arguments "
                             f"(episode.kwargs reach reset): {e}") from None
        return environment_episode(fn)
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"{path!r} must be an `async def episode(ctx, prompt, **meta)` or a "
                         "class with reset(prompt, **meta) and step(reply)")
    return fn


def environment_episode(env_class: type) -> Callable[..., Awaitable[Any]]:
    """The episode coroutine for a gym-style environment class: one instance per episode;
    ``reset(prompt, **meta)`` returns the text that opens the first turn (or None), then each
    turn's reply goes to ``step(reply)``, which returns ``(observation, reward, done)``: the
    observation opens the next turn (None: the policy continues), rewards add up. ``reset``
    and ``step`` may be sync or async and run like tools (``episode.tool_timeout_s``; one that
    raises or hangs fails the episode). The episode's reward is the sum of the rewards, or,
    when every step returned None, the run's reward functions score the transcript; a limit
    (turns, tokens) ends it with the rewards so far."""

    async def episode(ctx: EpisodeContext, prompt: Any, **meta: Any) -> float | None:
        env = env_class()
        observation = await ctx.tool(env.reset, prompt, **meta)
        total: float | None = None
        try:
            while True:
                turn = await ctx.generate(observation or None)
                result = await ctx.tool(env.step, turn.text)
                if not (isinstance(result, tuple) and len(result) == 3):
                    raise TypeError(f"{env_class.__name__}.step must return (observation, "
                                    f"reward, done), got {result!r}"[:300])
                observation, reward, done = result
                if reward is not None:
                    total = (total or 0.0) + float(reward)
                if done:
                    break
        except EpisodeOver:
            pass
        return total

    episode.__name__ = episode.__qualname__ = f"{env_class.__name__}.episode"
    return episode


class EpisodeContext:
    """What an episode coroutine talks to (see the module docstring)."""

    # Reachable as ``ctx.EpisodeOver``, so that an episode (a built-in task, a user's file) can
    # catch the end of its budget without importing the producer.
    EpisodeOver = EpisodeOver

    def __init__(
        self,
        *,
        generate: GenerateFn,
        tokenizer: Any,
        prompt_ids: list[int],
        limits: EpisodeLimits,
        context_left: int,
        request_prefix: str,
        version: Callable[[], int],
        prompt_id: str = "",
        index: int = 0,
    ):
        self._generate = generate
        self.tokenizer = tokenizer
        self.prompt_ids = list(prompt_ids)
        self.limits = limits
        self._context_left = context_left
        self._prefix = request_prefix
        self._version = version
        self.prompt_id = prompt_id
        self.index = index
        """This episode's place in its group (0 .. G-1)."""
        self.transcript = Transcript()
        self.tool_calls = 0

    # ------------------------------------------------------------------ views
    @property
    def token_ids(self) -> list[int]:
        """The completion so far (generated and environment tokens, after the prompt)."""
        return list(self.transcript.token_ids)

    @property
    def text(self) -> str:
        """The completion so far, decoded."""
        return self.tokenizer.decode(self.transcript.token_ids, skip_special_tokens=True)

    @property
    def turns(self) -> int:
        return self.transcript.turns

    # ------------------------------------------------------------------ environment
    def append(self, text_or_tokens: str | Sequence[int]) -> None:
        """Environment output after the last turn (masked out of the loss). Cut at
        ``episode.max_tokens``; the next generate then ends the episode."""
        ids = self._encode(text_or_tokens)
        room = min(self.limits.max_tokens, self._context_left) - len(self.transcript)
        self.transcript.add_env(ids[: max(room, 0)], self._version())

    def _encode(self, text_or_tokens: str | Sequence[int]) -> list[int]:
        if isinstance(text_or_tokens, str):
            return list(self.tokenizer.encode(text_or_tokens, add_special_tokens=False))
        return [int(t) for t in text_or_tokens]

    def _absorb(self, conversation: Any) -> None:
        """A whole conversation (token ids or chat messages): append its new tokens."""
        if isinstance(conversation, str):
            self.append(conversation)
            return
        seq = list(conversation)
        if seq and isinstance(seq[0], dict):
            full = self.tokenizer.apply_chat_template(
                seq, add_generation_prompt=True, tokenize=True
            )
            if isinstance(full, dict):  # newer transformers return a BatchEncoding
                full = full["input_ids"]
        else:
            full = seq
        self.append(extension(self.prompt_ids + self.transcript.token_ids, list(full)))

    # ------------------------------------------------------------------ turns
    async def generate(self, messages_or_tokens: Any = None, **sampling: Any) -> Turn:
        """One turn of the policy (see the module docstring). Raises EpisodeOver when the
        episode has no turn or token left."""
        if messages_or_tokens is not None:
            self._absorb(messages_or_tokens)
        t = self.transcript
        budget = turn_budget(self.limits, t.turns, len(t), self._context_left)
        if budget <= 0:
            raise EpisodeOver(
                f"episode limits reached after {t.turns} turn(s) and {len(t)} token(s)"
            )
        sampling["max_tokens"] = min(int(sampling.get("max_tokens", budget)), budget)
        comp, text = await self._generate(
            f"{self._prefix}-t{t.turns}", self.prompt_ids + t.token_ids, sampling
        )
        t.add_generated(comp)
        return Turn(
            text=text,
            token_ids=[int(x) for x in comp.token_ids],
            finish_reason=comp.finish_reason,
            versions=comp.per_token_versions().tolist(),
        )

    async def tool(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call a tool (sync functions run in a daemon thread) under the tool timeout."""
        self.tool_calls += 1
        name = getattr(fn, "__name__", repr(fn))
        try:
            if inspect.iscoroutinefunction(fn):
                return await asyncio.wait_for(fn(*args, **kwargs), self.limits.tool_timeout_s)
            return await asyncio.wait_for(
                in_daemon_thread(partial(fn, *args, **kwargs), name="episode-tool"),
                self.limits.tool_timeout_s
            )
        except TimeoutError:
            raise ToolError(
                f"tool {name} ran past episode.tool_timeout_s ({self.limits.tool_timeout_s:g} s)",
                "timeout",
            ) from None
        except asyncio.CancelledError:
            raise
        except Exception as e:
            raise ToolError(f"tool {name} raised {e!r}", "error") from e


@dataclass
class EpisodeResult:
    """One finished (or failed) episode."""

    completion: Completion
    text: str
    reward: tuple[float, dict[str, float]] | None
    """From the episode's return value; None: the reward functions score ``text``."""
    failure: str = ""
    """'' when it ended normally, else "tool_timeout", "tool_error", "timeout" or "error"."""
    detail: str = ""
    turns: int = 0
    env_tokens: int = 0
    tool_calls: int = 0


async def run_episode(
    fn: Callable[..., Awaitable[Any]], ctx: EpisodeContext, prompt: Any, meta: dict[str, Any]
) -> EpisodeResult:
    """Run one episode under ``episode.timeout_s``; a failure (a tool, the timeout, the
    episode's own exception) is returned, never raised, with the transcript so far."""
    failure = detail = ""
    reward = None
    try:
        value = await asyncio.wait_for(fn(ctx, prompt, **meta), ctx.limits.timeout_s)
        reward = episode_reward(value)
    except EpisodeOver:
        pass  # a limit ended it: the transcript is the completion, the rewards score it
    except ToolError as e:
        failure, detail = f"tool_{e.kind}", str(e)
    except TimeoutError:
        failure = "timeout"
        detail = f"the episode ran past episode.timeout_s ({ctx.limits.timeout_s:g} s)"
    except asyncio.CancelledError:
        raise
    except Exception as e:
        failure, detail = "error", f"the episode raised {e!r}"
    t = ctx.transcript
    return EpisodeResult(
        completion=t.completion(ctx._version()),
        text=ctx.text,
        reward=reward,
        failure=failure,
        detail=detail,
        turns=t.turns,
        env_tokens=len(t) - t.generated_tokens,
        tool_calls=ctx.tool_calls,
    )


class FailureLog:
    """How failed episodes are logged without flooding the console (pure; one per producer).

    The first ``first`` failures are warnings, which the launcher shows on the console; later
    ones are INFO records, kept in the producer's log file only, and counted by kind until
    ``summary`` turns the count into one warning line, which the producer calls once per
    learner step. So a tool that raises in every episode costs a few console lines, then one
    line per step; the log file holds every failure with its detail."""

    def __init__(self, first: int = 5):
        self.first = first
        self.failures = 0
        self.quiet: dict[str, int] = {}
        """Failures by kind (``EpisodeResult.failure``) logged since the last summary."""

    def record(self, prompt_id: str, failure: str, detail: str) -> tuple[int, str]:
        """(logging level, message) for one failed episode."""
        self.failures += 1
        message = f"prompt {prompt_id}: episode failed ({failure}): {detail}"
        if self.failures < self.first:
            return logging.WARNING, message
        if self.failures == self.first:
            return logging.WARNING, (f"{message} (further failures: one line per step here, "
                                     "each one in the log file)")
        self.quiet[failure] = self.quiet.get(failure, 0) + 1
        return logging.INFO, message

    def summary(self, version: int) -> str | None:
        """One line counting the failures logged quietly since the last summary (None when
        there were none), and a new count from here; ``version``: the learner's now."""
        if not self.quiet:
            return None
        n = sum(self.quiet.values())
        kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(self.quiet.items()))
        self.quiet = {}
        return (f"{n} more episode{'s' * (n != 1)} failed ({kinds}) up to learner version "
                f"{version}; {self.failures} in all, each one in the log file")


async def score_episodes(
    rewards: Any, prompt: Any, episodes: Sequence[EpisodeResult], meta: dict[str, Any]
) -> tuple[list[float], list[dict[str, float]]] | None:
    """Each episode's total reward and breakdown: its own return value; a failed one 0 (the
    caller has already dropped the group where ``rewards.on_failure`` is drop); the rest scored
    on their transcript text by ``rewards`` (a ``RewardSet``). None when the reward functions
    dropped the group."""
    if all(e.reward is not None or e.failure for e in episodes):
        return ([e.reward[0] if e.reward else 0.0 for e in episodes],
                [e.reward[1] if e.reward else {} for e in episodes])
    result = await rewards.score_group(
        prompt, [e.text for e in episodes], meta,
        completion_ids=[e.completion.token_ids for e in episodes])
    if result.dropped:
        return None
    totals, breakdowns = list(result.total), list(result.breakdown)
    for i, e in enumerate(episodes):
        if e.failure:
            totals[i], breakdowns[i] = 0.0, {}
        elif e.reward is not None:
            totals[i], breakdowns[i] = e.reward
    return totals, breakdowns


async def run_episodes(
    fn: Callable[..., Awaitable[Any]],
    n: int,
    *,
    generate: GenerateFn,
    tokenizer: Any,
    prompt_ids: list[int],
    limits: EpisodeLimits,
    max_model_len: int,
    request_prefix: str,
    version: Callable[[], int],
    prompt: Any,
    prompt_id: str,
    kwargs: dict[str, Any],
) -> list[EpisodeResult]:
    """``n`` episodes of one prompt, run concurrently (a training group, or one held-out
    prompt's evaluation samples); ``kwargs`` are ``episode.kwargs`` and the record's fields."""
    return list(await asyncio.gather(*(
        run_episode(fn, EpisodeContext(
            generate=generate, tokenizer=tokenizer, prompt_ids=prompt_ids, limits=limits,
            context_left=max_model_len - len(prompt_ids) - 1,
            request_prefix=f"{request_prefix}-{j}", version=version, prompt_id=prompt_id,
            index=j), prompt, kwargs)
        for j in range(n))))
