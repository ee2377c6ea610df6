"""``lightning-scale-plan`` run in the test's process: its exit status, stdout and stderr."""

from __future__ import annotations

import pytest


def plan_cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    from hydra.core.global_hydra import GlobalHydra

    from lightning_scale.cli import plan as plan_app

    GlobalHydra.instance().clear()  # each call composes afresh
    monkeypatch.setattr("sys.argv", ["lightning-scale-plan"])
    status = plan_app.main(list(args))
    out = capsys.readouterr()
    return status, out.out, out.err
