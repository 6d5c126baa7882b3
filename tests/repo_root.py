"""The repository's root folder, for tests that read its files (docs, scripts, examples, results):
one definition, so a test's depth under ``tests/unit/<package>/`` or ``tests/distributed/<package>/`` does
not matter (pytest.ini puts ``tests/`` on the import path)."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def import_script(name: str):
    """The module ``scripts/<name>.py`` (the scripts are not a package; they import their siblings
    by name, so ``scripts/`` is on the path while it loads)."""
    import importlib
    import sys

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)
