"""dpgs: distributed parallel gradient stacking for multiple-instance learning on whole-slide images.

The roles ``dpgs.master`` and ``dpgs.workers`` live in the top-level folders ``master/`` and ``workers/``
of a checkout; an install maps them into the package (pyproject.toml, ``package-dir``). When this
``dpgs`` is the checkout's own folder (imported from the checkout's root: ``python -m dpgs.cli`` there, or
a Ray worker of a run started there, since Ray puts the driver's working directory on the workers'
``sys.path``), :class:`_CheckoutRoles` maps the two roles to those folders, so that the checkout imports
whole whatever is installed (a regular install, an editable one, or none).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

__version__ = "0.1.0"

_ROLES = ("master", "workers")


class _CheckoutRoles(importlib.abc.MetaPathFinder):
    """Finds ``dpgs.master`` and ``dpgs.workers`` in the checkout's ``master/`` and ``workers/``."""

    def __init__(self, root: Path):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        package, _, role = fullname.partition(".")
        if package != __name__ or role not in _ROLES:
            return None
        folder = self.root / role
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )


def _install_checkout_roles() -> None:
    here = Path(__file__).resolve().parent
    if any((here / role).is_dir() for role in _ROLES):
        return  # an installed package: the roles are sub-folders
    if all((here.parent / role / "__init__.py").is_file() for role in _ROLES):
        sys.meta_path.insert(0, _CheckoutRoles(here.parent))


_install_checkout_roles()
