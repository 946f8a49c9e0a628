"""A fault campaign: GRPO runs, each with one SIGKILL of a random kind at a random moment, and a table of outcomes
(mrl/testing/fault_campaign.py says what is run, killed and judged; `make test-faults` runs a small one).

    python benchmarks/fault_campaign.py --faults 50 --seed 0 [--kinds engine policy verifier controller] [--json F]
"""

from mrl.testing.fault_campaign import main

if __name__ == "__main__":
    raise SystemExit(main())
