"""Test modules outside packages are imported by their basename (pytest's default rootdir
import mode), so two with one name in different folders stop the whole collection."""

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).parent


def test_test_modules_outside_packages_have_unique_names():
    by_name = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        if not (path.parent / "__init__.py").exists():
            by_name[path.name].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not clashes, f"rename one of each: {clashes}"
