"""Multi-turn regeneration (RunConfig.turns == "all_turns"): every assistant turn by the target.

A prompt frame's `messages` end at the last user turn and may hold the source dataset's
earlier assistant turns. With turns="last_turn" (the default) only the last assistant turn
is generated; the earlier ones stay the dataset's and the exports never train on them.
With turns="all_turns" the conversation is replayed in order: at each assistant turn of the
source, the target answers the conversation so far (its own earlier answers in place of the
dataset's), then the final turn is generated as usual. A record is written only when the
whole conversation is done (a failed turn fails the sample; a resume starts it again), and
`completion_tokens` counts every generated turn, so the budget does too.

    slots(messages)            how many assistant turns a conversation makes the target write
    regenerate(complete, ...)  the replay: earlier turns as Record.turns, the last Completion

Example:
    >>> slots([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
    ...        {"role": "user", "content": "Bye"}])
    2
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from kit.types import Completion, Message


def slots(messages: list[Message]) -> int:
    """Generated turns for one conversation: its assistant turns plus the final answer."""
    return 1 + sum(m.get("role") == "assistant" for m in messages)


def turn_dict(comp: Completion) -> dict:
    """One earlier generated turn, as stored in Record.turns."""
    return {
        "content": comp.text, "reasoning": comp.reasoning, "finish_reason": comp.finish_reason,
        "completion_tokens": comp.completion_tokens, "count_source": comp.count_source,
        "output_ids": comp.output_ids, "prompt_ids": comp.prompt_ids,
    }  # fmt: skip


async def regenerate(
    complete: Callable[[list[Message]], Awaitable[Completion]], messages: list[Message]
) -> tuple[list[Message], list[dict], Completion, int]:
    """Replay a conversation through the target, turn by turn.

    Args:
        complete: sends one conversation (ending in a user turn) and returns the Completion
            (retries inside; raises when every attempt failed).
        messages: the source conversation up to its last user turn.

    Returns:
        (prompt, turns, last, total): the final prompt with the target's own assistant
        turns, the earlier generated turns (turn_dict each), the last Completion, and the
        completion tokens of every generated turn together.
    """
    prompt: list[Message] = []
    turns: list[dict] = []
    total = 0
    for message in messages:
        if message.get("role") != "assistant":
            prompt.append(message)
            continue
        comp = await complete(list(prompt))
        turns.append(turn_dict(comp))
        total += comp.completion_tokens
        prompt.append({"role": "assistant", "content": comp.text})
    last = await complete(prompt)
    return prompt, turns, last, total + last.completion_tokens
