"""`env.kind: code`: programs from the responses run with their tests in a sandbox (environment.py), the sandbox
(sandbox.py: bubblewrap, a uid per slot, rlimits) and what runs inside it (harness.py: the standard library only)."""
