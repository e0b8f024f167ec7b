#!/usr/bin/env bash
# CI leg "oot": the out-of-tree example backend (examples/oot_backend, device "toyaccel").
#
# Installs the example with pip into a throwaway virtual environment layered on this one
# (--system-site-packages: it sees the installed pagedllm and torch, while toyaccel stays out of
# the main environment, where `--device auto` would otherwise prefer it to cpu), then runs, in
# one pytest session, the conformance suite against it and the plugin-discovery tests.
#
# Idempotent and fast on re-runs: the venv is reused and the example reinstalled only when its
# pyproject.toml changed (the editable install picks up source edits by itself).
# Env: PAGEDLLM_OOT_VENV (default: $TMPDIR/pagedllm-ci-oot-venv-<checkout hash>), PYTHON (python).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXAMPLE="$ROOT/examples/oot_backend"
# one venv per checkout, so two checkouts never test each other's editable install
CHECKOUT_ID="$(sha256sum <<< "$ROOT" | cut -c1-8)"
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
  echo "oot: pip install -e examples/oot_backend"
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

"$VPY" -m pytest -q -p no:cacheprovider --pyargs pagedllm.testing tests/backends/test_plugins.py \
  --device toyaccel ${PAGEDLLM_CI_REPORTS:+--conformance-report "$PAGEDLLM_CI_REPORTS/toyaccel.json"}
