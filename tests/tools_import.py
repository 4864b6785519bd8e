"""The scripts of ``tools/``, imported by the tests that check them: ``tool("gpu_record")``."""

import importlib
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def tool(name: str):
    """``tools/<name>.py`` as a module (the folder on the path while it imports, for the
    scripts it imports in turn)."""
    sys.path.insert(0, str(TOOLS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(TOOLS))
