#!/usr/bin/env bash
# One digest of everything the compiled extension is built from (csrc/, setup.py), run from any
# directory: scripts/build_for_gpu_machine.sh records it next to its build, and bench/gpu_run.sh
# uses a carried build only when the tree it runs on has the same digest.
set -euo pipefail
cd "$(dirname "$0")/.."
# LC_ALL=C: the files' order (and so the digest) must not depend on the machine's locale; the
# device image's differed from this one's (2026-11-28, a284fc8: the same sources, another digest)
export LC_ALL=C
find csrc setup.py -type f -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -d" " -f1
