"""The second half of tests/test_legacy_corpus.py's corpus files (see its ``FIRST_HALF``: a file of its own so that
the two halves run in two workers)."""

from __future__ import annotations

import pytest

from tests.test_legacy_corpus import SECOND_HALF, assert_migrates_as_expected


@pytest.mark.slow
@pytest.mark.parametrize("name", SECOND_HALF)
def test_corpus_file_migrates_as_expected(name: str) -> None:
    assert_migrates_as_expected(name)
