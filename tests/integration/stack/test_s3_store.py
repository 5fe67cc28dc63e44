"""The embedded store is a real S3 API: conditional writes, ranges, listing, auth."""

from __future__ import annotations

import uuid

import boto3
import pytest
from botocore.exceptions import ClientError

pytestmark = pytest.mark.integration


def test_second_conditional_put_of_a_key_gets_412(s3_client, s3_settings):
    key = f"cond/{uuid.uuid4().hex}"
    s3_client.put_object(Bucket=s3_settings.s3_bucket, Key=key, Body=b"first", IfNoneMatch="*")

    with pytest.raises(ClientError) as err:
        s3_client.put_object(Bucket=s3_settings.s3_bucket, Key=key, Body=b"second", IfNoneMatch="*")

    assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    body = s3_client.get_object(Bucket=s3_settings.s3_bucket, Key=key)["Body"].read()
    assert body == b"first", "the losing conditional PUT overwrote the object"


def test_ranged_get_returns_exactly_the_requested_bytes(s3_client, s3_settings):
    key = f"range/{uuid.uuid4().hex}"
    data = bytes(range(256)) * 40
    s3_client.put_object(Bucket=s3_settings.s3_bucket, Key=key, Body=data)

    got = s3_client.get_object(Bucket=s3_settings.s3_bucket, Key=key, Range="bytes=1000-1999")

    assert got["Body"].read() == data[1000:2000]


def test_list_by_prefix_pages_through_every_key(s3_client, s3_settings):
    prefix = f"list/{uuid.uuid4().hex}/"
    keys = [f"{prefix}{i:03d}" for i in range(25)]
    for key in keys:
        s3_client.put_object(Bucket=s3_settings.s3_bucket, Key=key, Body=b"x")

    pages = s3_client.get_paginator("list_objects_v2").paginate(
        Bucket=s3_settings.s3_bucket, Prefix=prefix, PaginationConfig={"PageSize": 10}
    )
    listed = [obj["Key"] for page in pages for obj in page.get("Contents", [])]

    assert listed == keys


def test_wrong_secret_is_refused(s3_settings):
    kwargs = s3_settings.boto3_client_kwargs() | {"aws_secret_access_key": "not-the-secret"}
    client = boto3.client("s3", **kwargs)

    with pytest.raises(ClientError) as err:
        client.list_objects_v2(Bucket=s3_settings.s3_bucket)

    assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
