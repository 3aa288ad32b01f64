"""The repository is roles composed over one connection source (issue 41): each role a class
of its own built once over the same ``Database``, none a subclass of another, and the store's
protocols naming roles the repository has."""

from __future__ import annotations

import inspect
from typing import Protocol

from sqlalchemy import create_engine

from backfill.store import Database, Repository, protocol

# Never connected to: building the repository opens no connection.
UNREACHABLE = "postgresql+psycopg://nobody@127.0.0.1:1/none"


def _roles(repo: Repository) -> dict[str, object]:
    return {name: value for name, value in vars(repo).items() if name != "db"}


def test_every_role_is_built_once_over_the_repositorys_one_database() -> None:
    repo = Repository(create_engine(UNREACHABLE), fair_share=False)
    roles = _roles(repo)
    assert {"tenants", "files", "nodes", "jobs", "claims", "items"} <= set(roles)
    assert isinstance(repo.db, Database)
    assert not repo.fair_share
    for name, role in roles.items():
        assert role._db is repo.db, name  # type: ignore[attr-defined]
    assert len({type(role) for role in roles.values()}) == len(roles)


def test_no_role_subclasses_another_or_a_shared_base() -> None:
    repo = Repository(create_engine(UNREACHABLE))
    for name, role in _roles(repo).items():
        assert type(role).__bases__ == (object,), (name, type(role).__mro__)


def test_each_store_protocol_names_only_roles_the_repository_has() -> None:
    repo = Repository(create_engine(UNREACHABLE))
    roles = _roles(repo)
    protocols = [
        cls
        for _, cls in inspect.getmembers(protocol, inspect.isclass)
        if cls.__module__ == protocol.__name__ and Protocol in cls.__mro__
    ]
    assert protocols
    for cls in protocols:
        for klass in cls.__mro__:
            for name, wanted in getattr(klass, "__annotations__", {}).items():
                assert name in roles, (cls.__name__, name)
                assert type(roles[name]).__name__ == wanted, (cls.__name__, name)
