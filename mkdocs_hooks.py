"""mkdocs hooks (mkdocs.yml's `hooks`): the docstrings' Sphinx roles (:func:`grad`) read as plain code on the site."""
from __future__ import annotations

import re

_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|exc|obj):(?=<code)")


def on_page_content(html: str, **kwargs) -> str:
    return _ROLE.sub("", html)
