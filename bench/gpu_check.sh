#!/usr/bin/env bash
# One-shot check of aionvme's GPU paths on a machine with a CUDA GPU.
#
#   bash bench/gpu_check.sh                 # from the repository root (or anywhere)
#
# Needs (already installed; nothing is downloaded): torch with CUDA, Cython and
# a C compiler, numpy, pytest, pytest-asyncio, uvloop; the nvidia-cufile wheel
# (or a CUDA toolkit's libcufile) for the GDS path. Without nvidia-fs, cuFile runs
# in compatibility mode: the gds rows then measure cuFile's compat mode and
# say so; without libcufile they say why they could not run.
#
# Steps: build the extension in place; `aionvme info`; the tests marked `gpu`
# (tests/test_gpu.py: both ways, random sizes and offsets incl. unaligned, rows, a
# gather of many, cancellation, pinned empty, safetensors/checkpoints to cuda)
# and the engine's GDS tests with the stand-in libcufile; then `aionvme bench
# --gpu` (NVMe->GPU and GPU->NVMe through cuFile, the pinned bounce pipeline and
# host memory + .cuda()/.cpu()); `aionvme tune --gpu --quick` (the knobs swept
# with CUDA tensors); last, a short table of GB/s per way.
#
# Environment: OUT (logs go there; default ./gpu_check_out), GPU_CHECK_SIZE
# (bench file size, default 4G), GPU_CHECK_DIR (where the scratch files go:
# put it on the NVMe drive; default ./.gpu_check_scratch), GPU_CHECK_SKIP_TESTS=1.
# Exit status: 0 when the build, the tests and the bench's data checks passed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
SIZE="${GPU_CHECK_SIZE:-4G}"
SCRATCH="${GPU_CHECK_DIR:-$PWD/.gpu_check_scratch}"
mkdir -p "$SCRATCH"
export CUFILE_LOGFILE_PATH="${CUFILE_LOGFILE_PATH:-$OUT/cufile.log}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
failed=()
t0=$(date +%s)
step() { echo; echo "== $* ($(( $(date +%s) - t0 )) s)"; }

step "environment"
{
    uname -r
    nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id --format=csv 2>&1 || true
    lsmod 2>/dev/null | grep -E "^nvidia_fs|^nvidia " || echo "nvidia-fs module: not loaded"
    "$PY" - <<'EOF'
import importlib.metadata as md, torch
print("torch", torch.__version__, "CUDA", torch.version.cuda, "available", torch.cuda.is_available())
for d in ("nvidia-cufile", "nvidia-cufile-cu12", "nvidia-cufile-cu13", "uvloop", "Cython", "pytest"):
    try:
        print(d, md.version(d))
    except md.PackageNotFoundError:
        print(d, "not installed")
EOF
} 2>&1 | tee "$OUT/environment.txt"

if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: torch.cuda.is_available() is False here: nothing to check (see $OUT/environment.txt)"
    exit 1
fi

step "build (python3 setup.py build_ext --inplace)"
if ! "$PY" setup.py build_ext --inplace > "$OUT/build.log" 2>&1; then
    tail -30 "$OUT/build.log"
    echo "BUILD FAILED: see $OUT/build.log"
    exit 1
fi
echo "built: $(ls src/aionvme/_engine*.so)"

step "aionvme info"
"$PY" -m aionvme info "$SCRATCH" --json > "$OUT/info.json" 2> "$OUT/info.err" || failed+=("info")
"$PY" - "$OUT/info.json" <<'EOF' | tee "$OUT/info.txt"
import json, sys
d = json.load(open(sys.argv[1]))
cf, g, p = d["cufile"], d["gpu"], d["path"]
print("GPUs:", ", ".join(f"{x['name']} ({x['memory_gib']} GiB)" for x in g.get("details", [])) or g["devices"])
print("cuFile:", cf["library"], cf["version"], "mode:", cf["mode"], "-", cf["reason"])
for line in cf.get("log") or []:
    print("  cuFile log:", line)
print("scratch:", p.get("path"), p.get("filesystem"), "O_DIRECT:", p.get("o_direct"), "align:", p.get("offset_align"))
EOF

if [ "${GPU_CHECK_SKIP_TESTS:-0}" != 1 ]; then
    # Every test marked gpu (tests/test_gpu.py, the store's GPU tier, the loader's and the
    # offload's device="cuda", DCP's CUDA state dicts...). Files whose peers are not installed
    # on the GPU image (safetensors, transformers, hypothesis) fail to import and are listed,
    # the others run.
    step "tests marked gpu (tests/)"
    if ! timeout 1200 "$PY" -m pytest -q -m gpu tests/ --continue-on-collection-errors -rs -p no:cacheprovider \
            --basetemp="$SCRATCH/pytest" --junitxml="$OUT/tests_gpu.xml" > "$OUT/tests_gpu.log" 2>&1; then
        failed+=("tests_gpu")
    fi
    tail -15 "$OUT/tests_gpu.log"

    step "engine GDS path with the stand-in libcufile (tests/test_gpu_cpu_side.py)"
    if ! timeout 600 "$PY" -m pytest -q tests/test_gpu_cpu_side.py -rs -p no:cacheprovider \
            --basetemp="$SCRATCH/pytest-cpu" > "$OUT/tests_cpu_side.log" 2>&1; then
        failed+=("tests_cpu_side")
    fi
    tail -5 "$OUT/tests_cpu_side.log"
fi

step "aionvme bench --gpu --size $SIZE"
if ! timeout 1200 "$PY" -m aionvme bench --gpu --size "$SIZE" --dir "$SCRATCH" --json \
        > "$OUT/bench_gpu.json" 2> "$OUT/bench_gpu.err"; then
    failed+=("bench")
    tail -20 "$OUT/bench_gpu.err"
fi
step "aionvme tune --gpu --quick (CUDA tensors through aionvme's GPU path)"
if ! timeout 900 "$PY" -m aionvme tune --gpu --quick --dir "$SCRATCH" --output "$OUT/tune_gpu.json" \
        > "$OUT/tune_gpu.log" 2>&1; then
    failed+=("tune_gpu")
fi
tail -12 "$OUT/tune_gpu.log"
if "$PY" -c "import deepspeed" 2>/dev/null; then
    step "offload: ZeRO-3 optimizer state on NVMe through the DeepSpeed drop-in"
    if ! timeout 900 "$PY" bench/probes/zero3_nvme_train.py --nvme "$SCRATCH/zero3_swap" --steps 10 \
            > "$OUT/zero3_nvme.log" 2>&1; then
        failed+=("zero3_nvme_train")
    fi
    tail -3 "$OUT/zero3_nvme.log"
else
    echo "zero3_nvme_train skipped: deepspeed is not installed on this machine"
fi
# The integrations' GPU paths (their gpu-marked tests ran above where the framework is installed:
# accelerate's disk offload to cuda, LMCache CUDA MemoryObjs, the store's loads into CUDA out=).
if "$PY" -c "import transformers" 2>/dev/null; then
    step "integrations: transformers cold load to cuda (ours, from_pretrained, fastsafetensors, InstantTensor)"
    if ! timeout 900 "$PY" bench/suites/bench_integrations_io.py --only transformers --device cuda \
            --model-size "${GPU_CHECK_MODEL_SIZE:-2G}" --repeat 3 --dir "$SCRATCH" \
            > "$OUT/integrations_transformers_cuda.txt" 2>&1; then
        failed+=("integrations transformers cuda")
    fi
    tail -12 "$OUT/integrations_transformers_cuda.txt"
else
    echo "integrations transformers cuda skipped: transformers is not installed on this machine"
fi
if "$PY" -c "import accelerate, transformers" 2>/dev/null; then
    step "integrations: accelerate disk offload to cuda, next to accelerate's own"
    if ! timeout 900 "$PY" bench/suites/bench_integrations_offload.py --workload accelerate --device cuda \
            --model-size 2G --repeat 3 --dir "$SCRATCH" > "$OUT/integrations_accelerate_cuda.txt" 2>&1; then
        failed+=("integrations accelerate cuda")
    fi
    tail -12 "$OUT/integrations_accelerate_cuda.txt"
else
    echo "integrations accelerate cuda skipped: accelerate/transformers are not installed on this machine"
fi
# DCP node-local replicas over an NCCL default group (aionvme makes a gloo group for the bytes):
# two torchrun "nodes" of 2 ranks, one GPU each; skipped with fewer than 4 GPUs.
step "dcp: replicas with an NCCL default group (needs 4 GPUs)"
timeout 900 "$PY" -m pytest -q -p no:cacheprovider tests/test_dcp_nodes.py -k nccl -rs \
    > "$OUT/dcp_nccl.log" 2>&1 || failed+=("dcp nccl")
tail -3 "$OUT/dcp_nccl.log"
rm -rf "$SCRATCH/pytest" "$SCRATCH/pytest-cpu" "$SCRATCH/zero3_swap"

if [ ${#failed[@]} -eq 0 ]; then
    verdict="gpu_check: OK in $(( $(date +%s) - t0 )) s; logs in $OUT"
else
    verdict="gpu_check: FAILED: ${failed[*]}; logs in $OUT"
fi
step "summary"
echo "$verdict"
"$PY" - "$OUT/bench_gpu.json" "$OUT/info.json" <<'EOF' | tee "$OUT/summary.txt"
import json, sys
from aionvme.bench import Result
from aionvme.bench.render import gpu_table
try:
    b = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    print(f"no bench results ({e})")
    sys.exit(0)
info = json.load(open(sys.argv[2])) if len(sys.argv) > 2 else {}
cf = info.get("cufile", {})
print(f"device: {b['device']}; cuFile {cf.get('version')} mode={cf.get('mode')} ({cf.get('reason')})")
print("GB/s: bytes / wall time of a whole transfer (reads: file -> CUDA tensor, verified on the GPU;")
print("writes: CUDA tensor -> file, fsync included); 'vs host': against pread into host memory + .cuda()")
print("(reads) or .cpu() + pwrite (writes); 'path used': what gpu.stats() saw the transfers take.")
print(gpu_table([Result.from_dict(r) for r in b["results"]], width=100))
EOF
[ ${#failed[@]} -eq 0 ]
