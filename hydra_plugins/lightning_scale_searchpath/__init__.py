"""Lets any Hydra app compose lightning-scale's config groups (``model``, ``data``, ``trainer``...).

Hydra discovers plugins in the ``hydra_plugins`` namespace package. Once lightning-scale is
installed, a user's own ``config.yaml`` can say ``defaults: [model: tiny, data: shakespeare]``.
"""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class LightningScaleSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="lightning-scale", path="pkg://lightning_scale.conf")
