"""Example rewards for the arithmetic task, written as plain functions (the simplest reward form).

Each takes ``(prompt, completion, **meta)`` and returns a float; ``meta`` carries the dataset
record's extra fields (``answer``) plus ``prompt_id`` and ``completion_index``. Use them from a
config as ``pipeline.tasks.rewards:exact_match`` etc. ``stated_answer``, the one number a reply
is graded on, is shared with the multi-turn game in ``pipeline.tasks.feedback``.
"""

from __future__ import annotations

import re

_INT = re.compile(r"-?\d+")
_JUST_A_NUMBER = re.compile(r"-?\d+\.?")
_AFTER_EQUALS = re.compile(r"=\s*(-?\d+)")


def _first_int(text: str) -> int | None:
    m = _INT.search(text.replace(",", ""))  # "1,024" is one number
    return int(m.group()) if m else None


def stated_answer(text: str) -> int | None:
    """The integer right after the first '=' ("12 + 7 = 19"), else the first integer; None when
    the text has no integer. One number only, so a reply listing candidates is not graded on
    the best of them."""
    text = text.replace(",", "")
    m = _AFTER_EQUALS.search(text)
    return int(m.group(1)) if m else _first_int(text)


def exact_match(prompt: str, completion: str, answer: str | None = None, **meta) -> float:
    """1.0 if the completion's stated answer equals ``answer``, else 0.0.

    The stated answer is the integer right after the first '=' when there is one (small instruct
    models restate the sum: "12 + 7 = 19"), else the first integer ("19", "The answer is 19").
    Only one number is read, so listing candidates does not pay. A record without a usable
    answer scores 0 (nothing to verify), not an error.
    """
    if answer is None:
        return 0.0
    try:
        expected = int(str(answer).strip())
    except ValueError:
        return 0.0
    return 1.0 if stated_answer(completion) == expected else 0.0


def format_reward(prompt: str, completion: str, **meta) -> float:
    """1.0 if the completion is just a number, 0.5 if it is short (<= 20 chars) and contains
    one, else 0.0.

    A shaping reward: it is dense (no answer needed) so early GRPO groups differ even when every
    answer is wrong, and it rewards the format the prompt asked for.
    """
    text = completion.strip()
    if _JUST_A_NUMBER.fullmatch(text):
        return 1.0
    if len(text) <= 20 and _INT.search(text):
        return 0.5
    return 0.0


def length_reward(prompt: str, completion: str, **meta) -> float:
    """-|20 - len(completion)|: the toy reward of TRL's "colocate vLLM" blog post.

    Useful as a smoke-test reward: it needs no answer and any model can learn it quickly, so a
    rising curve shows the training loop works before a real task is tried. Weigh it small (e.g.
    0.01) next to exact_match, as its scale is characters.
    """
    return -float(abs(20 - len(completion)))
