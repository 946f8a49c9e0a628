"""The growth measure passes what the engine's USS does over refits that leak nothing and fails a steady leak."""

from __future__ import annotations

import random

from mrl.testing.memory import growth_per_step

KIB = 1024
REFIT = 1_696_256  # bytes one refit of the test model moves (tests/functional/inference/test_inference_vllm.py)


def _clean(n: int, seed: int) -> list[float]:
    """Like a measured series (AVX2 EPYC, 100 refits of the tiny qwen2, KiB over the first sample): a ramp of
    ~820 KiB over the first ~20 refits (allocator pools filling), then 4 KiB steps now and then, plus page jitter
    and one 5% drop (the reload session's buffers given back, seen in a clean CI run)."""
    rng = random.Random(seed)
    out, level = [], 700 * 2**20
    for i in range(n):
        level += (rng.choice([0, 4, 4, 340, 250, 84]) * KIB if i < 20 else rng.choice([0] * 9 + [4]) * KIB)
        if i == n // 2:
            level *= 0.95
        out.append(level + rng.choice([-1, 0, 1]) * 4 * KIB)
    return out


def test_refits_that_leak_nothing_pass_and_a_steady_leak_of_a_tenth_of_a_refit_fails():
    for seed in range(20):
        clean = _clean(51, seed)
        assert growth_per_step(clean) < 0.1 * REFIT, seed
        leaking = [value + i * 0.12 * REFIT for i, value in enumerate(clean)]
        assert growth_per_step(leaking) >= 0.1 * REFIT, seed


def test_the_slope_of_a_line_is_its_slope_a_single_jump_is_trimmed_and_a_chunky_leak_still_shows():
    assert growth_per_step([3.0 + 2.5 * i for i in range(10)]) == 2.5
    assert growth_per_step([5.0]) == 0.0
    assert growth_per_step([0.0] * 25 + [1000.0] * 25) == 0.0  # one jump of 1000 in 50 steps
    chunky = [1000.0 * (i // 5) for i in range(51)]  # 1000 kept every 5th step: 200 a step
    assert 100.0 <= growth_per_step(chunky) <= 200.0
