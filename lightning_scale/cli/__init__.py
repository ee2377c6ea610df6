"""The command-line apps: ``lightning-scale-train`` (``train``), ``-prepare``, ``-ckpt``, ``-report``, ``-plan`` and ``-study``.

``lightning-scale-train`` is one chain of modules, each importing only those before it (never back;
``tests/test_layering.py`` enforces the direction, and that no import cycle exists anywhere):

- :mod:`~lightning_scale.cli.environment`: the process and its launcher (ranks, torchrun/SLURM, the
  run directory's name, dying with the parent process); imports no other ``cli`` module;
- :mod:`~lightning_scale.cli.resume`: which checkpoint a run resumes from; no other ``cli`` module;
- :mod:`~lightning_scale.cli.job_config`: the composed config read and checked before any process
  starts (process counts, the layout, the fingerprint, what the model admits); ``environment``, ``resume``;
- :mod:`~lightning_scale.cli.results`: what a run leaves (``results.json``, ``summary.json``,
  ``job.json``, loss curves, ``metrics.csv``'s history) and reading a study's results back; ``environment``,
  ``job_config``;
- :mod:`~lightning_scale.cli.run`: one training job in this process; the modules above;
- :mod:`~lightning_scale.cli.sweep_dirs` (a sweep job's directory: chosen by config, claimed, locked) and
  :mod:`~lightning_scale.cli.sweep_launch` (a job's ranks under torchrun, its progress, its reaper):
  ``environment``, ``job_config`` and (``sweep_dirs``) ``results``;
- :mod:`~lightning_scale.cli.sweep`: a multirun's jobs one by one and its summary; the modules above;
- :mod:`~lightning_scale.cli.resolvers`: the config's ``ls_*`` resolvers; ``environment``, ``sweep_dirs``;
- :mod:`~lightning_scale.cli.train`: the entry point; any of them.

The other apps stand apart: ``report`` (reads a study through ``results``, plots with ``report_plots``),
``ckpt`` and ``prepare`` import no other ``cli`` module, ``plan`` (the planner's Hydra app) only
``plan_sizing`` (compute-optimal sizing for a budget) and ``plan_calibrate`` (``lightning-scale-plan calibrate``).
``study`` (``lightning-scale-study``: a study that proposes, calibrates and prunes its own jobs) runs its trials
as a sweep runs its jobs (``run``, ``sweep_launch``), with ``study_state`` (options, pruners, ``study.json``),
``study_layouts`` (the planner's candidates and their calibrated predictions) and ``study_report`` (its end).

0.1.0's ``lightning_scale.cli.launch`` (split into ``environment`` and ``resolvers``) still imports, with a
``DeprecationWarning``, until 0.3.0.
"""

from lightning_scale.core.deprecation import moved_modules

moved_modules(__name__, {"launch": ("lightning_scale.cli.environment", "lightning_scale.cli.resolvers")})
