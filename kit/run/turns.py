"""Multi-turn regeneration (RunConfig.turns == "all_turns"): every assistant turn by the target.

With "last_turn" (the default) only the last assistant turn is generated and the dataset's
earlier ones are never trained on. With "all_turns" the conversation is replayed: at each
assistant turn (or between user turns given as a list, MT-bench's `turns`) the target
answers the conversation so far, its own earlier answers in place of the dataset's. A
record is written when the whole conversation is done (a resume starts it again), and
completion_tokens, so the budget, counts every generated turn.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from kit.types import Completion, Message


def slots(messages: list[Message]) -> int:
    """Generated turns for one conversation: its assistant turns, the answers missing
    between two user turns, and the final answer.

    Example:
        >>> slots([{"role": "user", "content": "Hi"}, {"role": "user", "content": "Bye"}])
        2
    """
    return 1 + sum(_answered(messages, i) for i in range(len(messages)))


def _answered(messages: list[Message], i: int) -> bool:
    """True where the target writes a turn before messages[i] is added: an assistant turn
    (the dataset's, replaced), or a user turn right after another (an answer is missing)."""
    role = messages[i].get("role")
    return role == "assistant" or (
        role == "user" and i > 0 and messages[i - 1].get("role") == "user"
    )


def user_runs(messages: list[Message]) -> bool:
    """True when two user turns follow each other (only all_turns can run such a prompt)."""
    return any(
        messages[i].get("role") == "user" and _answered(messages, i) for i in range(len(messages))
    )


def turn_dict(comp: Completion) -> dict:
    """One earlier generated turn, as stored in Record.turns."""
    return {
        "content": comp.text,
        "reasoning": comp.reasoning,
        "finish_reason": comp.finish_reason,
        "completion_tokens": comp.completion_tokens,
        "count_source": comp.count_source,
        "output_ids": comp.output_ids,
        "prompt_ids": comp.prompt_ids,
        "tool_calls": comp.tool_calls,
    }


async def regenerate(
    complete: Callable[[list[Message]], Awaitable[Completion]], messages: list[Message]
) -> tuple[list[Message], list[dict], Completion, int]:
    """Replay `messages` (up to the last user turn) through the target turn by turn, each
    sent by `complete` (retries inside; raises when every attempt failed) -> (the final
    prompt with the target's own assistant turns, the earlier generated turns as turn_dict
    gives them, the last Completion, the completion tokens of every generated turn)."""
    prompt: list[Message] = []
    turns: list[dict] = []
    total = 0
    for i, message in enumerate(messages):
        if _answered(messages, i):
            comp = await complete(list(prompt))
            turns.append(turn_dict(comp))
            total += comp.completion_tokens
            prompt.append({"role": "assistant", "content": comp.text})
        if message.get("role") != "assistant":
            prompt.append(message)
    last = await complete(prompt)
    return prompt, turns, last, total + last.completion_tokens
