"""Chat-history trimming: fit a conversation into a message count and a token budget.

The initial messages (instructions, tool list, task) are never dropped. Older steps go first, and the
kept part always starts with an assistant message, so a tool result never appears without the call
that produced it. The latest step is always kept. Nothing passed in is mutated: the result is a new
list of the same message objects, plus a short note saying how much was left out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from controller.models import Message, estimate_tokens

TOKEN_HEADROOM = 0.10  # fraction of the token budget kept free: token counts are estimates
KEEP_LAST = 2  # messages always kept (the latest call and its result)
TRIM_NOTE = (
    "({dropped} earlier messages of this conversation were left out to fit the context. "
    "The instructions and the task above are complete.)"
)

TokenCounter = Callable[[Sequence[Message]], int]


def trim_history(
    initial: Sequence[Message],
    history: Sequence[Message],
    *,
    max_messages: int | None = None,
    max_tokens: int | None = None,
    count_tokens: TokenCounter = estimate_tokens,
    headroom: float = TOKEN_HEADROOM,
) -> tuple[list[Message], int]:
    """Return ``(messages, dropped)``: ``initial`` plus the newest part of ``history`` that fits.

    ``max_messages`` bounds the number of history messages; ``max_tokens`` bounds the tokens of the
    whole list (initial messages included), less ``headroom``. ``dropped`` counts the history
    messages left out; when it is not zero, a note saying so follows the initial messages."""
    kept = list(history)
    if max_messages is not None and len(kept) > max_messages:
        kept = kept[len(kept) - max(max_messages, KEEP_LAST) :]
    if max_tokens is not None and kept:
        budget = int(max_tokens * (1.0 - headroom))
        used = count_tokens(initial) + count_tokens([_note(len(history))])
        sizes = [count_tokens([m]) for m in kept]
        total = used + sum(sizes)
        start = 0
        while total > budget and len(kept) - start > KEEP_LAST:
            total -= sizes[start]
            start += 1
        kept = kept[start:]
    if len(kept) < len(history):
        # A result without the call before it confuses the model: start at an assistant message.
        first = next((i for i, m in enumerate(kept) if m.get("role") == "assistant"), len(kept))
        if len(kept) - first >= 1:
            kept = kept[first:]
    dropped = len(history) - len(kept)
    if dropped == 0:
        return [*initial, *kept], 0
    return [*initial, _note(dropped), *kept], dropped


def _note(dropped: int) -> Message:
    return {"role": "user", "content": TRIM_NOTE.format(dropped=dropped)}
