"""The tests run against a real `locker serve`: LOCKER_URL and LOCKER_API_KEY say where
(tests/python_sdk.rs starts one and runs pytest). Without them every test is skipped."""

import os
import sys
import uuid

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # standin.py

from locker import Client, LockerError  # noqa: E402


@pytest.fixture(scope="session")
def client():
    if not os.environ.get("LOCKER_URL") or not os.environ.get("LOCKER_API_KEY"):
        pytest.skip("LOCKER_URL and LOCKER_API_KEY are not set: these tests need a running `locker serve`")
    c = Client(os.environ["LOCKER_URL"], os.environ["LOCKER_API_KEY"])
    c.health()
    return c


@pytest.fixture
def sandbox(client):
    sb = client.sandboxes.create(ttl_s=600, metadata={"test": "python-sdk"})
    yield sb
    try:
        sb.delete()
    except LockerError:
        pass


@pytest.fixture
def volume(client):
    v = client.volumes.create(f"py-{uuid.uuid4().hex[:10]}", size_mb=64)
    yield v
    try:
        v.delete()
    except LockerError:
        pass
