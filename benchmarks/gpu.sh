#!/usr/bin/env bash
# The benchmarks on an NVIDIA GPU through MLX's CUDA backend, on a machine without network access.
#
# Three steps (run from the repository root):
#
#   benchmarks/gpu.sh pack       # here, with network: wheels (cp312, manylinux x86_64) and the
#                                # converted default model into .gpu/, split into parts
#                                # .gpu/p1, .gpu/p2, ... of at most PART_MB MiB each
#   benchmarks/gpu.sh receive    # there, once per part: copies the carried .gpu/pN into STAGE
#   benchmarks/gpu.sh run        # there, after the last part: unpacks, installs into a private
#                                # site folder, checks MLX sees the GPU, runs the benchmarks and
#                                # writes $OUT/RESULTS-gpu.md and $OUT/doctor-gpu.json
#
# On this workplace's lent H200 (a copy of the working tree travels with each call, at most 64 MiB
# in all; files written under $OUT come back; a warm machine keeps STAGE between calls): one call
# per part, carrying that part's folder, the last one also running the benchmarks, e.g.
#   carry [".gpu/p1"]  command: benchmarks/gpu.sh receive
#   carry [".gpu/p2"]  command: benchmarks/gpu.sh receive
#   ...
#   carry [".gpu/pN"]  command: benchmarks/gpu.sh receive && benchmarks/gpu.sh run
# (.gitignore holds /.gpu/, so only carried parts travel). Where the whole payload
# is already on the machine (a shared disk), `STAGE=/that/folder benchmarks/gpu.sh run` suffices.
#
# Variables: CUDA (12 or 13: which mlx-cuda wheel; 13 matches the H200 image's CUDA 13 libraries),
# PYVER (3.12: the GPU machine's python3), PART_MB (48), STAGE (/tmp/batchmlx-gpu),
# SECTIONS (default: all of benchmarks.run), BENCH_ARGS (extra `python -m benchmarks.run`
# arguments, e.g. --quick),
# BENCH_TIMEOUT (480 seconds: the benchmarks stop there, so a 10-minute call still returns).
set -euo pipefail

CUDA=${CUDA:-13}
PYVER=${PYVER:-3.12}
PART_MB=${PART_MB:-48}
STAGE=${STAGE:-/tmp/batchmlx-gpu}
SECTIONS=${SECTIONS:-}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-480}
MODEL_NAME=SmolLM2-135M-Instruct-mlx
# batchmlx's and mlx-lm's runtime needs that the GPU image (KINDS.md's package list) lacks
EXTRA_WHEELS=(sqlalchemy greenlet aiosqlite alembic mako orjson watchfiles starlette uvicorn
              python-multipart llguidance)

pack() {
    local cache=${BATCHMLX_CACHE_DIR:-$HOME/.cache/batchmlx-test}
    local mlx_version mlx_lm_version
    mlx_version=$(python -c 'import importlib.metadata as m; print(m.version("mlx"))')
    mlx_lm_version=$(python -c 'import importlib.metadata as m; print(m.version("mlx-lm"))')
    if [ ! -f "$cache/models/$MODEL_NAME/model.safetensors" ]; then
        python -c "from pathlib import Path; from batchmlx.core.models import resolve_model
from batchmlx.engine.models.loader import model_folder
c = Path('$cache'); model_folder(resolve_model('default', cache_dir=c), cache_dir=c)"
    fi
    rm -rf .gpu && mkdir -p .gpu/payload/wheels .gpu/payload/cache/models
    local platforms=()
    for n in 17 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
    python -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
        --implementation cp "${platforms[@]}" -d .gpu/payload/wheels \
        "mlx==$mlx_version" "mlx-cuda-$CUDA==$mlx_version" "mlx-lm==$mlx_lm_version" \
        "${EXTRA_WHEELS[@]}"
    cp -r "$cache/models/$MODEL_NAME" .gpu/payload/cache/models/
    rm -rf ".gpu/payload/cache/models/$MODEL_NAME/__pycache__"
    tar -C .gpu/payload -cf .gpu/payload.tar .
    rm -rf .gpu/payload
    split -b "${PART_MB}m" -d -a 2 .gpu/payload.tar .gpu/chunk-
    local i=0 chunk
    for chunk in .gpu/chunk-*; do
        i=$((i + 1))
        mkdir -p ".gpu/p$i" && mv "$chunk" ".gpu/p$i/"
    done
    sha256sum .gpu/payload.tar | cut -d' ' -f1 > .gpu/payload.sha256
    echo "$i" > .gpu/parts
    for d in .gpu/p[0-9]*; do cp .gpu/parts .gpu/payload.sha256 "$d/"; done
    rm .gpu/payload.tar
    echo "packed $(du -sh .gpu | cut -f1) in $i parts: carry .gpu/p1 .. .gpu/p$i, one per call"
}

receive() {
    mkdir -p "$STAGE/chunks"
    local d found=0
    for d in .gpu/p[0-9]*; do
        [ -d "$d" ] || continue
        cp "$d"/chunk-* "$STAGE/chunks/" && cp "$d/parts" "$d/payload.sha256" "$STAGE/"
        found=1
    done
    [ "$found" = 1 ] || { echo "no .gpu/pN folder carried" >&2; exit 2; }
    echo "staged $(ls "$STAGE/chunks" | wc -l) of $(cat "$STAGE/parts") parts in $STAGE"
}

run() {
    local out=${OUT:-benchmarks/out/gpu}
    mkdir -p "$out"
    if [ ! -d "$STAGE/payload" ]; then
        local have want
        have=$(ls "$STAGE/chunks" | wc -l)
        want=$(cat "$STAGE/parts")
        [ "$have" = "$want" ] || { echo "only $have of $want parts staged" >&2; exit 2; }
        cat "$STAGE"/chunks/chunk-* > "$STAGE/payload.tar"
        echo "$(cat "$STAGE/payload.sha256")  $STAGE/payload.tar" | sha256sum -c --quiet
        mkdir -p "$STAGE/payload" && tar -C "$STAGE/payload" -xf "$STAGE/payload.tar"
        rm "$STAGE/payload.tar"
    fi
    local py=${PYTHON:-python3}
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$STAGE/site" "$STAGE"/payload/wheels/*.whl
    # libmlx.so finds CUDA's libraries through its RPATH, $ORIGIN/../../nvidia/...: beside
    # the private site folder, point that at the nvidia packages python3 already has
    local nv
    nv=$("$py" -c 'import nvidia; print(list(nvidia.__path__)[0])' 2>/dev/null || true)
    if [ -n "$nv" ] && [ ! -e "$STAGE/site/nvidia" ]; then ln -s "$nv" "$STAGE/site/nvidia"; fi
    export PYTHONPATH="$STAGE/site:$PWD" BATCHMLX_CACHE_DIR="$STAGE/payload/cache"
    export BATCHMLX_FAST_BLAS=0 PYTHONUNBUFFERED=1  # no CPU BLAS re-exec: the GPU does the math
    "$py" -c 'import mlx.core as mx
assert mx.cuda.is_available(), "MLX sees no CUDA device"
print("MLX", mx.__version__, "on", mx.default_device())'
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
        > "$out/nvidia-smi.txt" 2>&1 || true
    "$py" -m batchmlx.accel > "$out/doctor-gpu.json"
    local status=0
    timeout "$BENCH_TIMEOUT" "$py" -m benchmarks.run ${SECTIONS:+--sections "$SECTIONS"} \
        --model "$BATCHMLX_CACHE_DIR/models/$MODEL_NAME" --dtype auto \
        --out "$out/RESULTS-body.md" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.log" || status=$?
    {
        echo "# GPU figures: batchmlx on MLX's CUDA backend"
        echo
        echo "- GPU: $(cat "$out/nvidia-smi.txt")"
        echo "- $(date -u +%Y-%m-%dT%H:%MZ), benchmarks/gpu.sh, sections ${SECTIONS:-all} ${BENCH_ARGS:-}"
        [ "$status" = 0 ] || echo "- the run stopped early (exit $status): figures below are partial"
        echo
        [ -f "$out/RESULTS-body.md" ] && cat "$out/RESULTS-body.md"
    } > "$out/RESULTS-gpu.md"
    rm -f "$out/RESULTS-body.md"
    echo "wrote $out/RESULTS-gpu.md"
    return "$status"
}

case "${1:-}" in
    pack) pack ;;
    receive) receive ;;
    run) run ;;
    *) sed -n '2,/^set -euo/p' "$0" | grep '^#'; exit 2 ;;
esac
