"""tests/docs skip as a whole, in one line of the summary, where chromium or the built site/ is missing; runs that
deselect them (-m unit) say nothing about them."""

import pytest


def pytest_collection_modifyitems(config, items):
    docs = [item for item in items if item.path.parent.name == "docs" and item.path.parent.parent.name == "tests"]
    if docs:
        reason = docs[0].module.missing()
        for item in docs if reason else ():
            item.add_marker(pytest.mark.skip(reason=reason))
