"""The suite's own order: `make test` deals the costliest files to its workers first (conftest.COSTLIEST_FIRST)."""

from types import SimpleNamespace

from ordering import COSTLIEST_FIRST, in_cost_order
from repo import ROOT


def test_every_costliest_file_exists_once():
    assert len(set(COSTLIEST_FIRST)) == len(COSTLIEST_FIRST)
    missing = [name for name in COSTLIEST_FIRST if not (ROOT / "tests" / name).is_file()]
    assert not missing, f"COSTLIEST_FIRST names files that are gone: {missing}"


def test_listed_files_come_first_in_list_order_and_tests_keep_their_order():
    def item(name, test):
        return SimpleNamespace(path=ROOT / "tests" / name, test=test)

    items = [
        item("model/test_model.py", 1),
        item(COSTLIEST_FIRST[1], 2),
        item("model/test_model.py", 3),
        item(COSTLIEST_FIRST[0], 4),
        item(COSTLIEST_FIRST[1], 5),
    ]
    assert [i.test for i in in_cost_order(items)] == [4, 2, 5, 1, 3]
