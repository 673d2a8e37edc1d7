#!/usr/bin/env bash
# Run this checkout without installing it (the GPU machine runs from source): the import names live under
# `sluice.` (pyproject's package-dir maps `sluice.core` onto `core/`), so a folder with a `sluice/` of links
# to the four parts goes on PYTHONPATH instead of the checkout itself:
#
#   export PYTHONPATH=$(scripts/namespace_path.sh)
#
# Prints that folder (made under ${TMPDIR:-/tmp}; the links follow the checkout, so it never goes stale).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${TMPDIR:-/tmp}/sluice-src-$(printf '%s' "$root" | cksum | cut -d' ' -f1)
mkdir -p "$dir/sluice"
for part in app core kv spec; do ln -sfn "$root/$part" "$dir/sluice/$part"; done
echo "$dir"
