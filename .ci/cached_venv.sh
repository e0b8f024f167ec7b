# Sourced by the CI legs that need their own torch (leg_tpu.sh, leg_xpu.sh); not run directly.
#
# cached_venv NAME REQUIREMENT...   prints the path of a virtual environment holding exactly these
#                                   requirements, building it only when no finished one exists.
#
# The venv lives under $PAGEDLLM_CI_CACHE (default ${XDG_CACHE_HOME:-$HOME/.cache}/pagedllm-ci) as
# NAME-<hash of python version + requirements>, so a changed pin builds a new one and an unchanged
# one is reused across CI runs (each is ~7 GB and ~2-4 minutes to install: torch from PyPI brings
# its CUDA libraries). A venv counts as finished only once its stamp file is written; a half-built
# one (an interrupted run) is removed and rebuilt. Older NAME-* venvs are removed to bound the disk.
# PAGEDLLM_<NAME>_VENV (e.g. PAGEDLLM_TPU_VENV=/work/venvs/tpu) overrides the location.
# pagedllm itself is never installed there: legs put the checkout on PYTHONPATH.

cached_venv() {
  local name=$1; shift
  local py="${PYTHON:-python3}"
  local cache="${PAGEDLLM_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pagedllm-ci}"
  local key
  key="$( { "$py" -c 'import sys; print(sys.version.split()[0])'; printf '%s\n' "$@"; } \
          | sha256sum | cut -c1-12)"
  local override_var="PAGEDLLM_${name^^}_VENV"
  local venv="${!override_var:-$cache/$name-$key}"
  local stamp="$venv/.pagedllm-ci-complete"
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$key" ]]; then
    echo "$venv"
    return 0
  fi
  mkdir -p "$(dirname "$venv")"
  if [[ -z "${!override_var:-}" ]]; then  # evict older builds of this leg (same cache only)
    local old
    for old in "$cache/$name"-*; do
      [[ -d "$old" && "$old" != "$venv" ]] && { echo "$name: removing old venv $old" >&2; rm -rf "$old"; }
    done
  fi
  rm -rf "$venv"
  echo "$name: building $venv ($*); this takes a few minutes once" >&2
  "$py" -m venv "$venv" >&2 || return 1
  # (the machine's pip config may list local index folders that do not exist: drop that noise)
  "$venv/bin/python" -m pip install -q --no-cache-dir "$@" 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" >&2
  if [[ ${PIPESTATUS[0]} -ne 0 ]]; then
    echo "$name: pip install failed; the venv at $venv is left unfinished and rebuilt next run" >&2
    return 1
  fi
  echo "$key" > "$stamp"
  echo "$venv"
}
