"""pass@k (Chen et al. 2021): with n samples of a problem of which c are correct, the unbiased estimate of the chance
that at least one of k samples is correct is 1 - C(n - c, k) / C(n, k); a run reports its mean over problems.

Pure Python (the config check uses the same rule as the evaluation, without importing torch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k of one problem: 1 - C(n - c, k) / C(n, k)."""
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def pass_k_problem(pass_k: Sequence[int], num_samples: int) -> str | None:
    """Why `pass_k` cannot be estimated from `num_samples` samples per problem (None when it can): every k must be
    in 1..n. The one rule behind the config check (`eval.pass_k`) and `evaluate`."""
    bad = [k for k in pass_k if not 1 <= k <= num_samples]
    if bad:
        return f"pass@k needs 1 <= k <= the samples per problem ({num_samples}); {bad} are not"
    return None
