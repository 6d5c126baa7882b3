"""The repository's root folder, for tests that read its files (docs, scripts, examples, results):
one definition, so a test's depth under ``tests/unit/<package>/`` or ``tests/distributed/<package>/`` does
not matter (pytest.ini puts ``tests/`` on the import path)."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
