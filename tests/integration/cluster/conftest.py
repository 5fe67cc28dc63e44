"""Shared by the cluster and Connect tests: the example pipeline's profile service."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    from microbatch.examples.profile_service import ProfileService

    service = ProfileService(5, 0.05, tmp_path_factory.mktemp("profiles") / "service.log")
    yield service
    service.stop()
