"""Keeping a run going when a process stalls: the hang watchdog (:mod:`.watchdog`: a thread per rank that
times each training step against a heartbeat and, past the step's limit, has every rank write its stacks
and exit with :data:`~lightning_scale.core.resilience.watchdog.HANG_EXIT_CODE`) and its report
(:mod:`.hang_report`: each rank's record, and the summary naming the ranks that never reached the
collective the others wait in); preemption (:mod:`.preemption`: the signals' flag, the one agreement per
optimizer step, :class:`Preempted`); the straggler action (:mod:`.stragglers`: the rank slow at enough
consecutive logging intervals, and ``exclude.json``, which a relaunch reads to leave its host out);
goodput across restarts (:mod:`.goodput`: a run's wall time split into productive, lost, checkpoint,
start-up, restart and hang detection seconds from its ledger, which :mod:`.goodput_ledger` writes); elastic world size
(:mod:`.elastic`: the sizes torchrun's rendezvous gave this attempt, and the check that the Trainer's agree).

May import: torch, the standard library, :mod:`lightning_scale.core.compat`,
:mod:`lightning_scale.core.compat_c10d` and :mod:`lightning_scale.core.checks`.
"""

from lightning_scale.core.resilience.elastic import check_launched_world, launched_sizes
from lightning_scale.core.resilience.goodput import GoodputSummary, Ledger, read_ledger, summarize
from lightning_scale.core.resilience.preemption import Preempted, SignalFlag, anyone_signalled
from lightning_scale.core.resilience.stragglers import STRAGGLER_EXIT_CODE, SlowStreaks, record_exclusion
from lightning_scale.core.resilience.watchdog import HANG_EXIT_CODE, HangTimeout, StepWatchdog, hang_timeout_policy

__all__ = [
    "HANG_EXIT_CODE",
    "STRAGGLER_EXIT_CODE",
    "GoodputSummary",
    "HangTimeout",
    "Ledger",
    "Preempted",
    "SignalFlag",
    "SlowStreaks",
    "StepWatchdog",
    "anyone_signalled",
    "check_launched_world",
    "hang_timeout_policy",
    "launched_sizes",
    "read_ledger",
    "record_exclusion",
    "summarize",
]
