"""Issue 12: when the scheduler's next cycle starts after a wake-up (services.runner.wake_delay):
wake-ups within coalesce_s of a cycle's start share the next cycle, and a slow cycle is followed by
a rest in proportion, so the scheduler is busy at most max_busy_share of the time."""

from __future__ import annotations

import pytest

from hai.services.runner import wake_delay


@pytest.mark.parametrize(
    ("since_start_s", "cycle_s", "coalesce_s", "busy_share", "expected"),
    [
        # a fast cycle: only coalescing applies (the rest of coalesce_s after the cycle began)
        (0.05, 0.01, 0.2, 0.5, 0.15),
        (0.30, 0.01, 0.2, 0.5, -0.10),  # the wake-up came later than that: at once
        # a slow cycle (a deep queue): the next waits as long as the cycle took
        (0.60, 0.60, 0.2, 0.5, 0.60),
        (0.90, 0.60, 0.2, 0.5, 0.30),  # the wake-up came 0.3 s after the cycle ended
        # a quarter of the time at most: three times the cycle's length of rest
        (0.40, 0.40, 0.2, 0.25, 1.20),
        # no limit: back to back after a slow cycle, as before
        (0.60, 0.60, 0.2, 1.0, -0.40),
    ],
)
def test_the_next_cycle_waits_for_coalescing_and_a_rest_in_proportion_to_the_last(
    since_start_s: float, cycle_s: float, coalesce_s: float, busy_share: float, expected: float
) -> None:
    assert wake_delay(since_start_s=since_start_s, cycle_s=cycle_s, coalesce_s=coalesce_s,
                      busy_share=busy_share) == pytest.approx(expected)


def test_the_share_bounds_the_scheduler_busy_time_over_a_burst() -> None:
    """Cycles of 0.3 s woken continuously (a burst of submissions): with a share of 0.5 the
    scheduler is busy half the time, not all of it."""
    t, busy, cycle_s = 0.0, 0.0, 0.3
    for _ in range(100):
        start = t
        t += cycle_s
        busy += cycle_s
        t += max(0.0, wake_delay(since_start_s=t - start, cycle_s=cycle_s, coalesce_s=0.2, busy_share=0.5))
    assert busy / t == pytest.approx(0.5)
