"""A small random fault campaign (mrl/testing/fault_campaign.py): three SIGKILLs of a random kind (engine worker,
policy worker, verifier actor, the controller and its processes) at moments uniform over the life of their kind in an
uninterrupted run. Nothing may crash or hang, engine and verifier deaths are survived, and every run that finished (at
once, or re-run after a clean stop) trains exactly as the uninterrupted run. The seed is new each time (printed, and
MRL_CAMPAIGN_SEED replays it): each CI run tries moments no earlier one did; the 50-fault campaign's table is in
docs/measurements.md.
"""

from __future__ import annotations

import os
import random

import pytest

from mrl.testing.fault_campaign import campaign, problems, table

# The reference run, then three trials of up to one run and its re-run each: minutes on an AVX2-only EPYC.
pytestmark = pytest.mark.timeout(1500)


def test_three_random_faults_are_survived_or_stopped_cleanly_and_nothing_is_lost(warm, tmp_path):
    seed = int(os.environ.get("MRL_CAMPAIGN_SEED", random.SystemRandom().randrange(10**6)))
    print(f"campaign seed {seed} (MRL_CAMPAIGN_SEED={seed} replays it)")
    trials, _ = campaign(warm, tmp_path, faults=3, seed=seed, twin=False)
    print(table(trials, sorted({t["kind"] for t in trials})))
    assert sum(t["outcome"] != "missed" for t in trials) == 3, trials
    found = problems(trials)
    assert not found, f"MRL_CAMPAIGN_SEED={seed}:\n" + "\n".join(found)
