"""The `bench` extra: what the benchmarks need beyond ddp_ext's own
dependencies, and the message that says how to install it."""

import importlib.util
from typing import List

# Import name -> distribution name, as listed in pyproject.toml's `bench` extra.
REQUIREMENTS = {"matplotlib": "matplotlib", "PIL": "pillow", "scipy": "scipy", "sklearn": "scikit-learn"}

INSTALL_COMMAND = 'pip install "ddp_ext[bench]"'


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


def missing() -> List[str]:
    """Distribution names of the extra's packages that cannot be imported."""
    return [dist for module, dist in REQUIREMENTS.items() if not _importable(module)]


def missing_message(names: List[str]) -> str:
    return (
        f"the benchmarks need the `bench` extra, and {', '.join(names)} "
        f"{'is' if len(names) == 1 else 'are'} not installed. Install it with:\n\n    {INSTALL_COMMAND}\n\n"
        "(from a checkout: pip install --no-build-isolation -e \".[bench]\")"
    )
