#!/usr/bin/env bash
# Azurite, Microsoft's Azure Storage emulator, for the az:// tests (tests/helpers/objectservers.py):
# installed once with npm and kept.
#
#   scripts/azurite.sh     # installs it (about half a minute), then prints its azurite-blob
#
# Where: $SHARDLOAD_AZURITE_DIR, else $SHARDLOAD_CACHE/azurite, else ~/.cache/shardload/azurite.
# Needs node and npm (Azurite 3.37 asks for node >= 22 in its package.json, and runs on node 20
# too: npm's warning about it is not shown).
set -euo pipefail
DIR="${SHARDLOAD_AZURITE_DIR:-${SHARDLOAD_CACHE:-$HOME/.cache/shardload}/azurite}"
AZURITE=3.37.0
# the last step writes $DIR/ready: an install half made (a run stopped midway, or one still
# being made) is made again, and the tests never take it for a ready one
if [ "$(cat "$DIR/ready" 2>/dev/null)" != "azurite@$AZURITE" ]; then
    # one install at a time: two test sessions starting together wait for each other
    mkdir -p "$(dirname "$DIR")"
    if command -v flock >/dev/null; then
        exec 9>"$DIR.lock"
        flock 9
    fi
fi
if [ "$(cat "$DIR/ready" 2>/dev/null)" != "azurite@$AZURITE" ]; then
    command -v npm >/dev/null || { echo "azurite.sh: npm is not installed" >&2; exit 1; }
    echo "installing Azurite $AZURITE at $DIR" >&2
    rm -rf "$DIR"
    mkdir -p "$DIR"
    # a private prefix: nothing global changes; the output goes to stderr, so that the path
    # stays the last line of stdout
    npm install --prefix "$DIR" --no-audit --no-fund --no-save --loglevel=error \
        "azurite@$AZURITE" >&2
    [ -x "$DIR/node_modules/.bin/azurite-blob" ] || {
        echo "azurite.sh: azurite-blob did not install in $DIR" >&2; exit 1; }
    echo "azurite@$AZURITE" > "$DIR/ready"
fi
echo "$DIR/node_modules/.bin/azurite-blob"
