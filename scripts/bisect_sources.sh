#!/usr/bin/env bash
# The swiftune package as it was at each named revision, in .bisect/<rev>/swiftune (ignored; carry ".bisect" to
# the device), for scripts/gpu_suite.sh's sft-bisect: one benchmark row per revision in one call, the benchmark
# scripts themselves as in the working tree.
#
#   scripts/bisect_sources.sh HEAD 48f49fc d286b64 725143d HEAD   (a revision may come twice: first and last)
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { echo "bisect_sources.sh: name at least one revision" >&2; exit 2; }
rm -rf .bisect && mkdir -p .bisect
for rev in "$@"; do
  short=$(git rev-parse --short "$rev")
  mkdir -p ".bisect/$short"
  git archive "$short" src/swiftune | tar xf - -C ".bisect/$short" --strip-components=1
  echo "$short $(git log -1 --format=%s "$short" | cut -c1-100)" >> .bisect/revisions.txt
done
cat .bisect/revisions.txt
