#!/usr/bin/env bash
# The whole test suite, set-up included (the README's test command; .ci/run calls it).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test || exit 1
export HF_HUB_OFFLINE=1 GRADIO_ANALYTICS_ENABLED=False
# two workers, a test file each (module fixtures stay in one process): the suite is half
# subprocess interpreter runs and model loads, which overlap well on two cores
python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile tests "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests"
  exit 0
fi
exit "$rc"
