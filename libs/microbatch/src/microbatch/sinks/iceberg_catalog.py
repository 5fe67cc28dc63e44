"""Where an Iceberg sink's tables are: a pyiceberg catalog as plain, picklable properties.

The sink travels to Spark tasks pickled, so it holds the catalog's *properties* and opens
the catalog lazily, once per process. Secrets never travel with it: pyiceberg reads them
from ``PYICEBERG_CATALOG__<NAME>__<KEY>`` variables wherever it opens the catalog.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlparse

from microbatch.errors import ConfigError
from microbatch.settings import Settings

__all__ = ["IcebergCatalog", "s3_properties"]

#: Catalog properties that are secrets: they come from the environment, never the DAG.
_SECRET_KEYS = ("credential", "token", "s3.secret-access-key", "s3.session-token")


@dataclasses.dataclass(frozen=True)
class IcebergCatalog:
    """A pyiceberg catalog as plain properties (picklable; opened lazily, once per process).

    Secrets stay out of the pipeline definition: pyiceberg merges in
    ``PYICEBERG_CATALOG__<NAME>__<KEY>`` environment variables (e.g. ``..._CREDENTIAL``)
    when it opens the catalog, on the driver and on each executor."""

    name: str = "microbatch"
    properties: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        props = self.properties
        pairs = sorted((props.items() if isinstance(props, Mapping) else props), key=str)
        object.__setattr__(self, "properties", tuple((str(k), str(v)) for k, v in pairs))
        for key, _ in self.properties:
            if key in _SECRET_KEYS:
                env_key = key.upper().replace(".", "__").replace("-", "_")
                env = f"PYICEBERG_CATALOG__{self.name.upper()}__{env_key}"
                raise ConfigError(
                    f"Iceberg catalog {self.name!r}: property {key!r} is a secret and would travel "
                    f"with the pipeline's definition; set it in the environment as {env} instead"
                )

    @classmethod
    def sql(cls, uri: str, warehouse: str, name: str = "microbatch") -> IcebergCatalog:
        """A SQL catalog: ``sqlite:////abs/catalog.db`` or a SQLAlchemy URI such as
        ``postgresql+psycopg://user@host/db``; tables go under ``warehouse``."""
        return cls(name, (("type", "sql"), ("uri", uri), ("warehouse", warehouse)))

    @classmethod
    def rest(
        cls, uri: str, warehouse: str | None = None, name: str = "microbatch", **extra: str
    ) -> IcebergCatalog:
        """A REST catalog (Polaris, Nessie, Gravitino, Lakekeeper, a cloud's): credentials
        from the environment (see the class docstring)."""
        props = {"type": "rest", "uri": uri, **extra}
        if warehouse:
            props["warehouse"] = warehouse
        return cls(name, tuple(props.items()))

    @classmethod
    def embedded(cls, settings: Settings) -> IcebergCatalog:
        """The default: a SQLite catalog and a warehouse folder under the microbatch home."""
        root = settings.home_path / "iceberg"
        return cls.sql(f"sqlite:///{root / 'catalog.db'}", (root / "warehouse").as_uri())

    def get(self, key: str) -> str | None:
        return dict(self.properties).get(key)

    def open(self, settings: Settings) -> Any:
        """The pyiceberg ``Catalog``; a SQL catalog on S3 gets microbatch's S3 settings."""
        props = dict(self.properties)
        if props.get("type") == "sql":
            uri = props.get("uri", "")
            if uri.startswith("sqlite:///"):
                from pathlib import Path

                Path(uri[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
            if urlparse(props.get("warehouse", "")).scheme == "s3":
                for key, value in s3_properties(settings).items():
                    props.setdefault(key, value)
        return _open_catalog(self.name, tuple(sorted(props.items())))


@functools.lru_cache(maxsize=8)
def _open_catalog(name: str, props: tuple[tuple[str, str], ...]) -> Any:
    from pyiceberg.catalog import load_catalog

    return load_catalog(name, **dict(props))


def s3_properties(settings: Settings) -> dict[str, str]:
    """pyiceberg's FileIO properties for microbatch's S3 settings."""
    props = {"s3.region": settings.s3_region}
    if settings.s3_endpoint_url:
        props["s3.endpoint"] = settings.s3_endpoint_url
    if settings.s3_access_key_id:
        props["s3.access-key-id"] = settings.s3_access_key_id
        props["s3.secret-access-key"] = settings.s3_secret_access_key
    return props
