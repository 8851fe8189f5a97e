"""Walking a ``controller.gbnf.Grammar``'s rules: a random derivation (``derive``: hypothesis makes
every choice) yields a text the grammar admits; ``admits`` decides whether a given text is admitted.
For the grammar tests, and for any test that must know what a reply grammar lets a model write."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st

from controller.gbnf import Alt, Chars, Expr, Grammar, Lit, Ref, Repeat, Seq

WALK_EXTRA = 4  # a derivation repeats an item at most this many times beyond the minimum...
SHORT_RUN = 32  # ...unless it is one character class repeated at most this many times
INTERESTING = "\"'\\\n\t\r #=,:()[]{}<>`é中😀\u2028\x7f"


# --- Walking the rules ----------------------------------------------------------------------------


def derive(grammar: Grammar, draw: Callable[[st.SearchStrategy[Any]], Any]) -> str:
    """One random text the grammar admits; ``draw`` makes every choice."""
    out: list[str] = []

    def walk(expr: Expr) -> None:
        if isinstance(expr, Lit):
            out.append(expr.text)
        elif isinstance(expr, Chars):
            out.append(draw(char_in(expr)))
        elif isinstance(expr, Seq):
            for item in expr.items:
                walk(item)
        elif isinstance(expr, Alt):
            walk(expr.options[draw(st.integers(0, len(expr.options) - 1))])
        elif isinstance(expr, Repeat):
            # Short runs of single characters (digits, hex) go all the way to their bound, where
            # 64-bit and float overflow would hide; anything else stays short.
            whole = isinstance(expr.item, Chars) and expr.high - expr.low <= SHORT_RUN
            high = expr.high if whole else min(expr.high, expr.low + WALK_EXTRA)
            for _ in range(draw(st.integers(expr.low, high))):
                walk(expr.item)
        else:
            walk(grammar.rules[expr.name])

    walk(Ref(grammar.root))
    return "".join(out)


def char_in(chars: Chars) -> st.SearchStrategy[str]:
    if not chars.negated:
        return st.one_of([st.characters(min_codepoint=ord(lo), max_codepoint=ord(hi)) for lo, hi in chars.ranges])
    interesting = [c for c in INTERESTING if chars.matches(c)]
    return st.one_of(st.sampled_from(interesting), st.characters(codec="utf-8").filter(chars.matches))


def admits(grammar: Grammar, text: str) -> bool:
    """Whether ``text`` as a whole derives from the grammar's root (all parses at once, memoised)."""
    memo: dict[tuple[str, int], frozenset[int]] = {}

    def ends(expr: Expr, pos: int) -> frozenset[int]:
        if isinstance(expr, Lit):
            return frozenset({pos + len(expr.text)}) if text.startswith(expr.text, pos) else frozenset()
        if isinstance(expr, Chars):
            return frozenset({pos + 1}) if pos < len(text) and expr.matches(text[pos]) else frozenset()
        if isinstance(expr, Seq):
            here = frozenset({pos})
            for item in expr.items:
                here = frozenset(e for p in here for e in ends(item, p))
            return here
        if isinstance(expr, Alt):
            return frozenset(e for option in expr.options for e in ends(option, pos))
        if isinstance(expr, Repeat):
            found = {pos} if expr.low == 0 else set()
            here = frozenset({pos})
            for count in range(1, expr.high + 1):
                here = frozenset(e for p in here for e in ends(expr.item, p))
                if not here:
                    break
                if count >= expr.low:
                    found |= here
            return frozenset(found)
        key = (expr.name, pos)
        if key not in memo:
            memo[key] = ends(grammar.rules[expr.name], pos)
        return memo[key]

    return len(text) in ends(Ref(grammar.root), 0)
