"""The public API is exactly what __all__ says, and every name in it exists."""

from __future__ import annotations

import microbatch


def test_every_public_name_is_importable_from_the_package():
    missing = [name for name in microbatch.__all__ if not hasattr(microbatch, name)]

    assert missing == []


def test_public_api_is_sorted_and_has_no_duplicates():
    assert list(microbatch.__all__) == sorted(set(microbatch.__all__))
