"""Hydra configs of lightning-scale. Importing this package (Hydra does, to read ``pkg://lightning_scale.conf``)
registers the resolvers the configs use (``ls_run_name``, ``ls_log_suffix``)."""

from lightning_scale.cli.resolvers import register_resolvers

register_resolvers()
