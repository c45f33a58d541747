"""Words for people: durations and the sentences the scheduler records."""

from __future__ import annotations


def fmt_duration(seconds: float) -> str:
    """900 -> '15 min', 14400 -> '4 h', 5400 -> '1 h 30 min', 42 -> '42 s'."""
    s = round(max(0.0, seconds))
    if s < 60:
        return f"{s} s"
    minutes, _ = divmod(s, 60)
    hours, minutes = divmod(minutes, 60)
    if hours == 0:
        return f"{minutes} min"
    if minutes == 0:
        return f"{hours} h"
    return f"{hours} h {minutes} min"


def plural(n: int, word: str, words: str | None = None) -> str:
    return f"{n} {word if n == 1 else (words or word + 's')}"


def waiting_for_checkpoints(n: int, nodes: tuple[str, ...]) -> str:
    shown = ", ".join(nodes[:4]) + (f" and {len(nodes) - 4} more" if len(nodes) > 4 else "")
    return f"waiting for {plural(n, 'job')} to reach a checkpoint; {plural(len(nodes), 'node')} reserved ({shown})"
