#!/usr/bin/env bash
# CI leg "oot-prev": the stability promise (docs/porting.md, "Compatibility promise"). The
# out-of-tree example as it was at the previous plugin API version (examples/oot_backend_api2.0,
# a frozen copy that states plugin_api_version 2.0 and imports the 2.0 paths) is pip-installed
# unchanged and runs the conformance suite against this engine (.ci/leg_oot.sh does the
# install, in its own virtual environment). It writes no conformance report: the support
# matrix lists the current example, and both are device "toyaccel".
# The suite runs sampled (--conformance-sample 2: every declared value of every swept
# dimension still runs once) to keep the leg short; the plugin must load with its old version.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXAMPLE=examples/oot_backend_api2.0
STATED="$(sed -n 's/^ *plugin_api_version = "\(.*\)".*/\1/p' "$ROOT/$EXAMPLE/pagedllm_toyaccel/backend.py")"
CURRENT="$(${PYTHON:-python} -c 'from pagedllm.contract.version import PLUGIN_API_VERSION as v; print(v)')"
echo "oot-prev: $EXAMPLE states plugin API $STATED; this pagedllm implements $CURRENT"
[[ "$STATED" != "$CURRENT" ]] || {
  echo "oot-prev: the frozen example states the current version $CURRENT; it must be the" \
       "previous one (refresh $EXAMPLE from git history, see its FROZEN.md)" >&2
  exit 1
}
PREVIOUS="${CURRENT%%.*}.$(( ${CURRENT#*.} - 1 ))"
[[ "$STATED" == "$PREVIOUS" ]] || echo "oot-prev: NOTE: the frozen example states $STATED, not" \
  "the previous minor $PREVIOUS: it still tests that old plugins run unchanged; add a copy of" \
  "the example as of its last commit stating $PREVIOUS (FROZEN.md says how)"
exec "$ROOT/.ci/leg_oot.sh" "$EXAMPLE" --conformance-sample 2 \
  "tests/backends/test_plugins.py::test_example_package_when_installed"
