"""Where the repository is, for test files and helper modules (which import this, not conftest:
pytest loads conftest as a plugin, and a module import of it would be a second copy)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
