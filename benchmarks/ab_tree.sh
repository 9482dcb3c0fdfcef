#!/usr/bin/env bash
# Another revision's tree for an A/B of two revisions on one device machine (hosts differ between
# calls by more than many changes move a figure: on 2026-12-06 the talker's model load took
# 11.5-14.7 s on the afternoon's H100 and 9.8-11.0 s on the morning's). Run here, from the
# repository root; it writes .ab/<rev>/ (git-ignored; AB_DIR names another folder than .ab;
# benchmarks/results/ left out), which a device call carries and names for one of its stacks:
#
#   benchmarks/ab_tree.sh f76a2ea
#   # run, carry [".whl", ".ab"]:
#   REVISION=<rev sent> STACKS="open open" STACK_TREE_2=.ab/f76a2ea ... bash benchmarks/device_call.sh stacks
#
# The stack then runs that tree's services and client, with its own launch_gpu_stack.sh, from
# .ab/<rev>/ (run_h200.sh stacks, STACK_TREE_<n>), and its results record that revision.
set -euo pipefail
REV_ARG="${1:?a revision (commit, tag or branch)}"
REV="$(git rev-parse --short "$REV_ARG^{commit}")"
DEST="${AB_DIR:-.ab}/$REV"
rm -rf "$DEST"
mkdir -p "$DEST"
git archive --format=tar "$REV" -- . ':(exclude)benchmarks/results' | tar -x -C "$DEST"
echo "$REV" >"$DEST/REVISION"
echo "$DEST: $(du -sh "$DEST" | cut -f1), revision $REV"
