# Sourced by scripts/setup and scripts/setup-model: the one way anything is installed into a venv.
#
# The installer is uv, pinned and hash-checked in scripts/locks/installer.lock. The venv's own pip
# (whatever release `python -m venv` bundled) installs only that one wheel, with --no-deps, which
# every pip does the same way; every lock is then installed by uv, hash-checked, so what lands is
# the same bytes whatever the registry releases later. (Before, the venv's pip 23.2.1 installed the
# lock and, for `httpx[http2]`, looked at the newest httpx instead of the pinned one: pypa/pip#9644.)
# Measured on a fresh machine: uv installs requirements.lock in 3.1 s, pip 26.3 in 30 s.
#
# Functions: check_python PY, ensure_installer VENV (sets UV), install_lock PY LOCK [UV ARGS...],
# stage_done NAME START (records a stage's time in $CIAYN_SETUP_TIMES), print_stage_times.

CIAYN_PYTHON_MIN=3.11  # the supported CPython releases: CI runs 3.11; the locks also install on
CIAYN_PYTHON_MAX=3.13  # 3.12 and 3.13 (checked by installing them there)
ciayn_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

say() { echo "${ciayn_step:-setup}: $*" >&2; }

# check_python PY: exit 1 with a clear message unless PY runs a supported CPython.
check_python() {
  local py=$1 version
  if ! version=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null); then
    say "cannot run $py: install Python $CIAYN_PYTHON_MIN to $CIAYN_PYTHON_MAX (Debian: apt-get install python3), or name one with CIAYN_PYTHON=/path/to/python3"
    exit 1
  fi
  if ! "$py" -c "import sys; sys.exit(not ((${CIAYN_PYTHON_MIN/./, }) <= sys.version_info[:2] <= (${CIAYN_PYTHON_MAX/./, })))"; then
    say "$py is Python $version; ciayn-sandbox supports $CIAYN_PYTHON_MIN to $CIAYN_PYTHON_MAX. Name another with CIAYN_PYTHON=/path/to/python3.11 (and remove .venv if it was made with this one)"
    exit 1
  fi
}

# ensure_installer VENV: the pinned uv in VENV/bin (installed by VENV's own pip if missing or another
# release); sets UV to its path.
ensure_installer() {
  local venv=$1 want t=$SECONDS out
  want=$(sed -n 's/^uv==\([^ ]*\).*/\1/p' "$ciayn_root/scripts/locks/installer.lock")
  UV="$venv/bin/uv"
  if [ "$("$UV" --version 2>/dev/null | cut -d' ' -f2)" != "$want" ]; then
    say "installing the installer: uv $want (scripts/locks/installer.lock, hash-checked)"
    if ! out=$("$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --require-hashes \
               -r "$ciayn_root/scripts/locks/installer.lock" 2>&1); then
      echo "$out" >&2
      exit 1
    fi
    stage_done installer "$t"
  fi
  export UV
}

# install_lock PY LOCK [UV ARGS...]: install a hash-checked lock into the environment of PY, and
# compile what it installed to bytecode. Python writes a module's bytecode at its first import only
# where it may: with PYTHONDONTWRITEBYTECODE set (as on this project's machines) every process
# compiled every module it imported from source, each time. Measured: `import litellm` 7.8 s of
# CPU without bytecode and 4.6 s with it, `import langgraph.prebuilt` 2.4 s and 1.2 s; the suite
# starts hundreds of such processes.
install_lock() {
  local py=$1 lock=$2
  shift 2
  "$UV" pip install --quiet --python "$py" --require-hashes --compile-bytecode -r "$lock" "$@"
}

# stage_done NAME START: record that stage NAME, begun at $SECONDS == START, is over.
stage_done() {
  [ -n "${CIAYN_SETUP_TIMES:-}" ] && echo "$1 $(($SECONDS - $2))" >> "$CIAYN_SETUP_TIMES"
  return 0
}

print_stage_times() {
  [ -s "${CIAYN_SETUP_TIMES:-}" ] || return 0
  local line
  line=$(awk '{ printf "%s%s %d s", (NR > 1 ? ", " : ""), $1, $2; total += $2 } END { printf "; total %d s", total }' "$CIAYN_SETUP_TIMES")
  say "stage times: $line"
}
