#!/usr/bin/env bash
# CI leg "oot": the out-of-tree example backend (examples/oot_backend, device "toyaccel").
# With an argument, another copy of it: .ci/leg_oot_prev.sh passes the frozen example of the
# previous plugin API version (examples/oot_backend_api2.0), to run it against this engine.
#
# Installs the example with pip into a throwaway virtual environment layered on this one
# (--system-site-packages: it sees the installed pagedllm and torch, while toyaccel stays out of
# the main environment, where `--device auto` would otherwise prefer it to cpu), then runs, in
# one pytest session, the conformance suite against it and the plugin-discovery tests.
#
# Idempotent and fast on re-runs: the venv is reused and the example reinstalled only when its
# pyproject.toml changed (the editable install picks up source edits by itself).
# Usage: .ci/leg_oot.sh [EXAMPLE_DIR [PYTEST_ARGS...]] (default: examples/oot_backend, the
# conformance suite with a report for the support matrix and all of test_plugins.py).
# Env: PAGEDLLM_OOT_VENV (default: $TMPDIR/pagedllm-ci-oot-venv-<checkout and example hash>),
#      PYTHON (python).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXAMPLE="$ROOT/${1:-examples/oot_backend}"
[[ -f "$EXAMPLE/pyproject.toml" ]] || { echo "oot: $EXAMPLE has no pyproject.toml" >&2; exit 1; }
shift $(( $# > 0 ? 1 : 0 ))
# one venv per checkout and example, so two never test each other's editable install
CHECKOUT_ID="$(sha256sum <<< "$ROOT $EXAMPLE" | cut -c1-8)"
VENV="${PAGEDLLM_OOT_VENV:-${TMPDIR:-/tmp}/pagedllm-ci-oot-venv-$CHECKOUT_ID}"
PY="${PYTHON:-python}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 TOKENIZERS_PARALLELISM=false

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "oot: creating $VENV (system site packages visible)"
  # no pip of its own: the base environment's pip module is importable and installs here
  "$PY" -m venv --system-site-packages --without-pip "$VENV"
  # --system-site-packages shows the base interpreter's packages only; when $PY is itself a venv
  # (a developer's run of .ci/run), its site-packages (.pth files included) are added this way
  VSITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  "$PY" -c 'import site; print("\n".join(site.getsitepackages()))' \
    | sed "s|.*|import site; site.addsitedir('&')|" > "$VSITE/_pagedllm_outer_env.pth"
fi
VPY="$VENV/bin/python"
"$VPY" -c "import pagedllm, torch" || {
  echo "oot: pagedllm/torch are not importable from $VENV; install pagedllm in $PY first" >&2
  exit 1
}

STAMP="$VENV/.toyaccel-pyproject.sha256"
WANT="$(cat "$EXAMPLE/pyproject.toml" <(echo "$EXAMPLE") | sha256sum | cut -d' ' -f1)"
if [[ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]] \
    || ! "$VPY" -c "import pagedllm_toyaccel" 2>/dev/null; then
  echo "oot: pip install -e ${EXAMPLE#"$ROOT"/}"
  "$VPY" -m pip install -q --no-deps --no-build-isolation -e "$EXAMPLE"
  echo "$WANT" > "$STAMP"
fi

cd "$ROOT"
echo "oot: pagedllm backends (as the plugin's users see it)"
TABLE="$("$VPY" -m pagedllm.entrypoints.cli backends)"
echo "$TABLE"
grep -q "^toyaccel .*pagedllm-toyaccel .*available" <<< "$TABLE" || {
  echo "oot: toyaccel is not listed as available by \`pagedllm backends\`" >&2
  exit 1
}

if [[ $# -eq 0 ]]; then
  # --conformance-sweep values: the swept checks take every value of each dimension once, which
  # keeps the leg's time (the example's blockwise kernel walks a 16k context block by block);
  # the default covering array runs in the cpu leg (and passes for toyaccel: benchmarks/RESULTS.md)
  set -- --conformance-sweep values tests/backends/test_plugins.py \
    ${PAGEDLLM_CI_REPORTS:+--conformance-report "$PAGEDLLM_CI_REPORTS/toyaccel.json"}
fi
"$VPY" -m pytest -q -p no:cacheprovider --pyargs pagedllm.testing --device toyaccel "$@"
