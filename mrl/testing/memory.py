"""Memory growth as a leak shows it: a slope per step that a steady leak keeps and one-off jumps do not.

A process's USS after each of n steps (refits, GRPO steps) moves for reasons that are not leaks: allocator pools and
first-call caches fill during the first steps and then stay, pages come and go in 4 KiB units, one step frees what
an earlier one held. Comparing the first and last sample (the bound this replaces: "USS within 5%") measures all of
that: one CI run saw -5.03%, another +5.4%, on the same code. A leak is different in kind: it keeps something every
step, so the USS grows by about the same amount per step for as long as the run goes on.

`growth_per_step` is a trimmed mean of the step-to-step differences (the largest 10% and the smallest 10% left out):
a steady leak of L bytes a step makes most differences L, so their trimmed mean is L; a ramp that saturates early
adds its few differences spread over all steps; a single jump (up or down, even 5% of the process) is one
difference and is trimmed away. A leak that keeps memory in chunks every k steps still shows as about half its rate
or more (for k <= 5). Tests bound it by a fraction of what one step moves (a leak that keeps a refit's tensors
grows by the refit's bytes per refit). The median of all pairwise slopes (Theil-Sen) was tried first and fails
here: a 5% drop in the middle of 50 steps moves it by more than any leak worth finding.
"""

from __future__ import annotations

from typing import Sequence

TRIM = 0.1


def growth_per_step(samples: Sequence[float]) -> float:
    """Trimmed mean (`TRIM` of each end) of the differences between consecutive samples, in their unit per step;
    0 for fewer than 2 samples."""
    diffs = sorted(b - a for a, b in zip(samples, samples[1:]))
    cut = int(len(diffs) * TRIM)
    kept = diffs[cut : len(diffs) - cut] or diffs
    return sum(kept) / len(kept) if kept else 0.0
