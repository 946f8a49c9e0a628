#!/usr/bin/env bash
# make gym-venv: NeMo Gym's own virtual environment, .venv-gym, at requirements/gym.lock's versions (make lock-gym
# re-resolves the lock). nemo-gym needs Python >= 3.12: $MRL_GYM_BASE_PYTHON, else what requirements/find_python.sh
# finds. Where no Python 3.12 is found or the registry cannot be reached, one line says so and the command
# exits 0 without the environment: the NeMo Gym tests then skip in one line each (tests/gym).
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-gym
mode=${1:-install}

python=$(bash requirements/find_python.sh "${MRL_GYM_BASE_PYTHON:-}") || { echo "gym-venv: no Python 3.12 found (set MRL_GYM_BASE_PYTHON, or install it: pyenv install 3.12); NeMo Gym's tests will skip"; exit 0; }
rm -rf "$VENV.new"
"$python" -m venv "$VENV.new" || { echo "gym-venv: $python -m venv failed; NeMo Gym's tests will skip"; exit 0; }
"$VENV.new/bin/python" -m pip install -q --upgrade pip==25.3 2>/dev/null || true
if [ "$mode" = lock ]; then
    "$VENV.new/bin/python" -m pip install -q nemo-gym==0.4.0 math-verify==0.8.0 || exit 1
    { sed -n '1,4p' requirements/gym.lock; "$VENV.new/bin/python" -m pip freeze --all | grep -v -E '^(pip|setuptools|wheel)=='; } \
        > requirements/gym.lock.new && mv requirements/gym.lock.new requirements/gym.lock
elif ! "$VENV.new/bin/python" -m pip install -q --no-deps -r requirements/gym.lock 2>"$VENV.new/pip.err"; then
    echo "gym-venv: pip could not install requirements/gym.lock ($(tail -1 "$VENV.new/pip.err")); NeMo Gym's tests will skip"
    rm -rf "$VENV.new"
    exit 0
fi
rm -rf "$VENV" && mv "$VENV.new" "$VENV"
# A moved venv's scripts name their old folder; python itself (what mrl runs) does not care. (Importing nemo_gym
# writes caches under the current directory, so the check only finds it.)
version=$("$VENV/bin/python" -c 'import importlib.metadata as m, importlib.util as u, math_verify
assert u.find_spec("nemo_gym") and u.find_spec("resources_servers"); print(m.version("nemo-gym"))') || exit 1
touch "$VENV/.installed"
echo "gym-venv: $VENV with $("$VENV/bin/python" --version), nemo-gym $version"
