"""The database URL's secrets (pure): every error about a URL or its password file leaves the
password out, the password file's password goes into the URL the store connects with, and the
CLI's one error line for any exception hides it too."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchmlx.cli.common import error_line
from batchmlx.config import load_settings
from batchmlx.database_url import DatabaseUrlError, parse_target, redact

PW = "S3cretPw!"


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql+pg9000://bmx:{PW}@db.example/q",
        f"mysql://bmx:{PW}@db.example/q",
        f"postgresql://bmx:{PW}@db.example:port/q",
        f"oracle+cx://bmx:{PW}@db.example:1521/q",
    ],
)
def test_url_errors_never_hold_the_password(url: str) -> None:
    with pytest.raises(DatabaseUrlError) as exc:
        parse_target(url)
    assert PW not in str(exc.value) and "bmx:***@" in str(exc.value)


def test_redact_hides_every_url_password_in_a_text() -> None:
    text = f"a postgresql://u:{PW}@h/d and sqlite:///x and mysql://v:p@ss:w@h2/d end"
    assert redact(text) == "a postgresql://u:***@h/d and sqlite:///x and mysql://v:***@h2/d end"


def test_the_password_file_fills_a_url_without_one(tmp_path: Path) -> None:
    pw = tmp_path / "pw"
    pw.write_text("p@ss word\nignored\n")
    env = {"BATCHMLX_HOME": str(tmp_path), "BATCHMLX_DATABASE_URL": "postgresql://bmx@h/d",
           "BATCHMLX_DATABASE_PASSWORD_FILE": str(pw)}  # fmt: skip
    target = load_settings(env).target
    assert target.url == "postgresql+asyncpg://bmx:p%40ss word@h/d"
    assert target.display == "postgresql+asyncpg://bmx:***@h/d"
    with pytest.raises(DatabaseUrlError, match="password file is given too"):
        _ = load_settings(env | {"BATCHMLX_DATABASE_URL": "postgresql://bmx:x@h/d"}).target
    with pytest.raises(DatabaseUrlError, match="for PostgreSQL"):
        _ = load_settings(env | {"BATCHMLX_DATABASE_URL": "sqlite:///x.db"}).target
    pw.write_text("\n")
    with pytest.raises(DatabaseUrlError, match="is empty"):
        _ = load_settings(env).target


@pytest.mark.parametrize("name", ["BATCHMLX_RETENTION_DAYS", "BATCHMLX_LEASE_S"])
def test_numbers_from_the_environment_are_checked(name: str) -> None:
    with pytest.raises(ValueError, match=f"\\${name} must be"):
        load_settings({name: "soon"})
    with pytest.raises(ValueError, match=f"\\${name} must be"):
        load_settings({name: "-1"})
    assert load_settings({"BATCHMLX_RETENTION_DAYS": "30"}).retention_days == 30
    assert load_settings({}).retention_days is None


def test_error_line_is_one_line_without_secrets() -> None:
    from sqlalchemy.exc import OperationalError

    db = OperationalError("SELECT 1", {"p": "a prompt"}, ConnectionError("connection lost\nmore"))
    assert error_line(db) == "the database failed: connection lost"
    assert error_line(PermissionError(13, "Permission denied", "/x")) == "Permission denied: /x"
    assert error_line(ValueError("bad value")) == "bad value"
    assert error_line(ZeroDivisionError("x")).startswith("unexpected ZeroDivisionError: x")
