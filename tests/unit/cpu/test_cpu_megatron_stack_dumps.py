"""megatron-core 0.19.2's dynamic engine, imported, makes every SIGTERM and SIGINT print a Python stack
(its data-parallel coordinator module registers faulthandler for them); importing mrl's dynamic loop
(mrl/inference/megatron_dynamic.py) takes that back, and a SIGTERM handler set before (Ray's, in a worker) still
runs. One fresh interpreter: megatron's import alone first (the stack is printed: the upstream behaviour the
workaround exists for), then mrl's."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

SCRIPT = """
import os, signal, sys
signal.signal(signal.SIGTERM, lambda *args: print("handled", file=sys.stderr, flush=True))
import megatron.core.inference.engines.dynamic_engine
os.kill(os.getpid(), signal.SIGTERM)
print("-- mrl's loop imported", file=sys.stderr, flush=True)
import mrl.inference.megatron_dynamic
os.kill(os.getpid(), signal.SIGTERM)
"""


def test_a_sigterm_prints_no_stack_once_mrl_s_dynamic_loop_is_imported_and_the_handler_before_still_runs():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    upstream, mrl = proc.stderr.split("-- mrl's loop imported")
    assert "Stack (most recent call first)" in upstream and "handled" in upstream, upstream[-3000:]
    assert "Stack (most recent call first)" not in mrl and "handled" in mrl, mrl[-3000:]
