#!/usr/bin/env bash
# bubblewrap for the code environment's sandbox (env kind code: mrl/environments/code/sandbox.py), when missing:
# apt-get as root (Debian/Ubuntu). Where it cannot be installed (not root, no apt-get, offline), one line says so and
# the command exits 0: the sandbox's tests skip in one line, and a run with env kind code refuses to start.
command -v bwrap >/dev/null && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
    echo "bubblewrap: missing, and not root with apt-get: install it (apt-get install bubblewrap) for the code sandbox"
    exit 0
fi
if DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null 2>&1 \
   || { apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null 2>&1; }; then
    echo "bubblewrap: installed, $(bwrap --version)"
else
    echo "bubblewrap: apt-get install bubblewrap failed (offline?); the code sandbox's tests skip"
fi
