"""The study database behind ``treegraft tune``: any SQLAlchemy URL, opened with a worker heartbeat.

``sqlite:///file.db`` is the embedded default. ``postgresql://USER:PASSWORD@HOST:PORT/DB`` lets workers
on many machines share one study; it is opened with psycopg 3 (the ``postgres`` extra) whatever
SQLAlchemy's default driver. Everything that can go wrong here (a malformed URL, a missing driver, an
unreachable server, a missing database) is a ConfigError that names the fix.
"""

from __future__ import annotations

import os
import socket
import time
import warnings

import optuna
import sqlalchemy
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback

from ..errors import ConfigError

RETRIES = 2  # re-enqueues of a trial whose worker died: a configuration that kills its worker is not tried for ever
SCHEMA_ATTEMPTS = 5
URL_FORMS = "write sqlite:///PATH.db or postgresql://USER:PASSWORD@HOST:PORT/DATABASE"


def worker_id() -> str:
    """This process, as trials record it: ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"


def hide_password(url: str) -> str:
    """``url`` with any password hidden."""
    try:
        return sqlalchemy.engine.make_url(url).render_as_string(hide_password=True)
    except sqlalchemy.exc.ArgumentError:
        return url


def _reason(error: BaseException) -> str:
    """The driver's own first line (SQLAlchemy wraps it with a long preamble)."""
    text = str(getattr(error, "orig", None) or error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _lost_schema_race(error: BaseException) -> bool:
    """Workers started together on an empty database all create Optuna's tables; all but one fail so."""
    text = _reason(error)
    return "already exists" in text or "duplicate key value" in text


def _create(url: str, engine_kwargs: dict, heartbeat_s: int) -> RDBStorage:
    for attempt in range(SCHEMA_ATTEMPTS):
        try:
            with warnings.catch_warnings():  # the heartbeat options are marked experimental
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return RDBStorage(url, engine_kwargs=engine_kwargs,
                                  heartbeat_interval=heartbeat_s, grace_period=2 * heartbeat_s,
                                  heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=RETRIES))
        except (sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError) as error:
            if attempt + 1 == SCHEMA_ATTEMPTS or not _lost_schema_race(error):
                raise
            time.sleep(0.2 * (attempt + 1))  # the winner finishes the schema; then it only needs reading
    raise AssertionError("unreachable")


def open_storage(url: str, heartbeat_s: int) -> RDBStorage:
    """The study database at ``url`` with a heartbeat; an unusable URL or server is a ConfigError naming the fix."""
    if heartbeat_s < 1:
        raise ConfigError(f"--heartbeat {heartbeat_s} < 1", "pass --heartbeat 1 or more (seconds)")
    try:
        parsed = sqlalchemy.engine.make_url(url)
    except sqlalchemy.exc.ArgumentError:
        raise ConfigError(f"--storage {url!r} is not a database URL", URL_FORMS) from None
    if parsed.drivername == "postgresql":  # the driver of the `postgres` extra, whatever SQLAlchemy's default
        parsed = parsed.set(drivername="postgresql+psycopg")
    engine_kwargs: dict = {"pool_pre_ping": True}  # a long trial outlives idle connections the server drops
    if parsed.get_backend_name() == "postgresql" and "connect_timeout" not in parsed.query:
        engine_kwargs["connect_args"] = {"connect_timeout": 10}  # an unreachable host fails, not hangs
    shown = hide_password(url)
    try:
        return _create(parsed.render_as_string(hide_password=False), engine_kwargs, heartbeat_s)
    except sqlalchemy.exc.NoSuchModuleError:
        raise ConfigError(f"--storage {shown}: unknown database kind {parsed.drivername!r}", URL_FORMS) from None
    except ImportError as error:
        missing = _reason(error.__cause__ or error)
        raise ConfigError(f"--storage {shown}: the database driver is not installed ({missing})",
                          "pip install 'treegraft[postgres]' (psycopg 3) for PostgreSQL, "
                          "or the SQLAlchemy driver your URL names") from None
    except sqlalchemy.exc.OperationalError as error:
        hint = "start the server, check host, port, user and password, and create the database (createdb NAME)"
        if parsed.get_backend_name() == "sqlite":
            hint = "check that the directory of the .db file exists and is writable"
        raise ConfigError(f"cannot open the study database {shown}: {_reason(error)}", hint) from None
    except (sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError, RuntimeError) as error:
        raise ConfigError(f"cannot use the study database {shown}: {_reason(error)}",
                          f"{URL_FORMS}; an older Optuna schema: `optuna storage upgrade --storage URL`") from None
