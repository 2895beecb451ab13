"""docs/troubleshooting.md lists every error flexshard raises for a user, as the
source has it now (tests/error_catalogue.py reads them from the code)."""

from __future__ import annotations

from error_catalogue import PAGE, errors, page_with_catalogue


def test_the_error_catalogue_is_current():
    page = PAGE.read_text()
    assert page == page_with_catalogue(page), (
        "docs/troubleshooting.md's error list is out of date: run python tests/error_catalogue.py")


def test_the_catalogue_holds_the_errors_users_meet():
    messages = [m for *_, m in errors()]
    assert len(messages) > 100
    assert any("were on the meta device" in m for m in messages)
    assert any("matches several buckets" in m for m in messages)
