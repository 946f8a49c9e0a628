"""Reward environments behind one interface (base.py): math answers with math-verify in a pool of Ray actors
(math.py, verifier_pool.py), exact-match arithmetic in-process (arith.py); registry.py builds the one env.kind names."""
