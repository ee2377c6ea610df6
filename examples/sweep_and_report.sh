#!/usr/bin/env bash
# A scaling study and its report: which data x tensor x pipeline layout of 4 processes trains fastest,
# and what it costs.
#
#   bash examples/sweep_and_report.sh                               # 9 layouts of 4 CPU processes (3 skipped)
#   bash examples/sweep_and_report.sh trainer.max_steps=20          # any Hydra override reaches every job
#   bash examples/sweep_and_report.sh trainer=gpu trainer.devices=8 \
#       strategy.tensor_parallel=1,2,4,8 strategy.pipeline_parallel=1,2,4,8   # a sweep value replaces the preset's
#   STUDY=my-layouts bash examples/sweep_and_report.sh               # the sweep's directory: multirun/my-layouts
#
# The sweep (experiment=layout_sweep, lightning_scale/conf/experiment/layout_sweep.yaml) starts every
# job's processes with torchrun, one job after the other, and records each in multirun/<study>/<job>/
# results.json. A layout that does not fit is skipped with the reason; the sweep exits with the number
# of failed jobs. The same command run again skips the finished jobs and resumes the others.
# The report ranks the completed jobs (report.md, a self-contained report.html, plots) and, with
# --best, writes the winner as a config that trains with it.
set -uo pipefail

study="${STUDY:-layouts}"

lightning-scale-train experiment=layout_sweep study="$study" "$@"
failed=$?

lightning-scale-report "multirun/$study" --rank-by tokens_per_sec --best || exit $?
echo "the ranking: multirun/$study/report/report.md"
exit "$failed"
