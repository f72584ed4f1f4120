import sys
from pathlib import Path

# Make tests/helpers.py importable as `helpers` without installing the tests as a package.
sys.path.insert(0, str(Path(__file__).parent))
