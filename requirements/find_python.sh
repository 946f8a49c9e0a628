#!/usr/bin/env bash
# Prints the path of a CPython 3.12, the Python mrl's environments are made with (make install's .venv, NeMo Gym's
# .venv-gym, the GPU lock's resolver): the first that runs as 3.12 of its arguments (a user's choice such as
# $MRL_GYM_BASE_PYTHON), python3.12 on PATH, pyenv's newest 3.12.x, python3. Each candidate is run, not trusted
# by its name: pyenv's python3.12 shim exists but fails where 3.12 is not a selected version. Prints nothing and exits
# 1 where none is found.
set -uo pipefail

pyenv_root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
for candidate in "$@" python3.12 $(ls -d "$pyenv_root"/versions/3.12*/bin/python3.12 2>/dev/null | sort -V -r) python3; do
    [ -n "$candidate" ] || continue
    path=$(command -v "$candidate" 2>/dev/null) || continue
    if "$path" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
        # pyenv's shim resolves to the interpreter it would run, so the venv does not depend on pyenv's selection.
        "$path" -c 'import sys; print(sys.executable)'
        exit 0
    fi
done
exit 1
