#!/usr/bin/env bash
# The whole test suite, set-up included (the README's test command; .ci/run calls it).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test || exit 1
export HF_HUB_OFFLINE=1 GRADIO_ANALYTICS_ENABLED=False
# two workers, a test file each (module fixtures stay in one process): the suite is half
# subprocess interpreter runs and model loads, which overlap well on two cores
# each test fails after 300 s (pytest.ini), and the whole run is stopped after 40 minutes, so that
# a hang fails CI with pytest's report instead of holding it to its limit
timeout --signal=INT --kill-after=60 2400 python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile tests "$@"
rc=$?
if [ "$rc" -eq 124 ]; then
  echo "the test suite ran past its 40-minute bound"
fi
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests"
  exit 0
fi
exit "$rc"
