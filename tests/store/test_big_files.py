"""A 200 MB file goes in and comes out streamed: never whole in memory, identical every time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchmlx.store.types import FileStorage

REPO = Path(__file__).resolve().parents[2]
SIZE_MB = 200
# peak resident memory allowed for the whole process: the interpreter and its libraries take
# about 80 MB; a file held whole would add 200 MB, or 400 MB with a copy
PEAK_MB = 170
SCRIPT = """
import asyncio, hashlib, json, resource, sys
from pathlib import Path
from batchmlx.store import Store
from batchmlx.store.types import FileStorage

async def main(target, storage, folder, size_mb):
    store = await Store.open(target, files=FileStorage(storage), files_dir=Path(folder))
    made = hashlib.sha256()
    def lines():
        for i in range(size_mb * 1024):  # 1 KiB lines
            line = (b'{"custom_id": "r%08d", "pad": "' % i).ljust(1023, b"x") + b"\\n"
            made.update(line)
            yield line
    rec = await store.save_file("file-big", lines(), filename="big.jsonl", purpose="batch",
                                created_at=1)
    reads = []
    for _ in range(2):
        h = hashlib.sha256()
        async for chunk in store.read_file(rec):
            h.update(chunk)
        reads.append(h.hexdigest())
    await store.close()
    # VmHWM is this program's own peak: ru_maxrss also counts the parent's RSS at the exec
    # (a vfork child execs in the parent's memory), so under a big pytest it reads high
    try:
        status = Path("/proc/self/status").read_text()
        hwm = next(line for line in status.splitlines() if line.startswith("VmHWM"))
        peak_mb = int(hwm.split()[1]) / 1024
    except OSError:
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"bytes": rec.bytes, "made": made.hexdigest(), "reads": reads,
                      "peak_mb": peak_mb}))

asyncio.run(main(*sys.argv[1:4], int(sys.argv[4])))
"""


@pytest.mark.parametrize("storage", list(FileStorage))
def test_200_mb_file_is_streamed_and_read_back_identically(store_target, storage, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(store_target), storage.value, str(tmp_path / "files"),
         str(SIZE_MB)],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["bytes"] == SIZE_MB * 1024 * 1024
    assert out["reads"] == [out["made"]] * 2
    assert out["peak_mb"] < PEAK_MB, out
