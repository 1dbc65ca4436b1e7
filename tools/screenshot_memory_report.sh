#!/bin/sh
# Opens a memory report (ferrograd train/demo --memory-trace DIR writes DIR/memory_report.html)
# in headless Chromium and saves a screenshot: a check that the page renders with no network.
# Usage: tools/screenshot_memory_report.sh DIR/memory_report.html out.png
# Needs Debian's chromium-headless-shell (apt-get install chromium-headless-shell) or chromium.
set -eu
page=$(realpath "$1")
out=$(realpath -m "$2")
browser=$(command -v chromium-headless-shell || command -v chromium || true)
if [ -z "$browser" ]; then
    echo "no headless Chromium found: apt-get install chromium-headless-shell" >&2
    exit 1
fi
"$browser" --headless --no-sandbox --disable-gpu --window-size=1100,1100 \
    --screenshot="$out" "file://$page" 2>/dev/null
test -s "$out"
echo "wrote $out"
