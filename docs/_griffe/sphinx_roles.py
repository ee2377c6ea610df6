"""A Griffe extension for the API reference: the docstrings use Sphinx roles (:class:`Name`,
:mod:`.module`, :func:`~pkg.function`), which Markdown would show verbatim; each becomes inline code
naming the object (the ``~`` and leading dots dropped)."""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:mod|class|func|meth|data|attr|exc|obj|const):`~?\.?([^`]+)`")


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(r"`\1`", obj.docstring.value)
