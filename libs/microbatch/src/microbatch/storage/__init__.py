"""Object stores: a local folder or S3, one contract (see :mod:`.base`)."""

from microbatch.storage.base import (
    AlreadyExistsError,
    ObjectNotFoundError,
    ObjectStore,
    PreconditionFailedError,
)
from microbatch.storage.factory import open_store
from microbatch.storage.local import LocalFileStore
from microbatch.storage.s3 import S3Store

__all__ = [
    "AlreadyExistsError",
    "LocalFileStore",
    "ObjectNotFoundError",
    "ObjectStore",
    "PreconditionFailedError",
    "S3Store",
    "open_store",
]
