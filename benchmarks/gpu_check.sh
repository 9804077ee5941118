#!/usr/bin/env bash
# The GPU check of a lent machine, in one go (issue 22): the CUDA-marked tests, two ranks sharing the one GPU,
# and the benchmarks that take --device cuda. The steps' time limits add up to under 8 minutes after the set-up.
#
#   bash benchmarks/gpu_check.sh            # on the GPU machine
#   bash benchmarks/gpu_check.sh --dry-run  # anywhere, on the CPU, < 60 s: each step in a minimal CPU form
#
# Results: $OUT if set, else runs/gpu_check: gpu_check.log (every step's output) and summary.md.
# Environment: a venv ($HALOPIPE_GPU_VENV, default $TMPDIR/halopipe-gpu-venv) made from $HALOPIPE_GPU_PYTHON
# (default python3). When that python's torch sees a GPU (the lent machine's image: a CUDA torch, no package
# index), the venv sees that python's packages and gets only what halopipe and its test extra lack; otherwise it
# gets torch and halopipe[test,mace]. Packages come from the wheels in $HALOPIPE_WHEELS (default .whl, carried
# to the machine) when there are any, else from the index. halopipe and tests/ are imported from this checkout.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
case "${1:-}" in
    --dry-run) DRY=1 ;;
    "") DRY=0 ;;
    *) echo "usage: bash benchmarks/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac

RESULTS=${OUT:-runs/gpu_check}
LOG=$RESULTS/gpu_check.log
SUMMARY=$RESULTS/summary.md
PY=${HALOPIPE_GPU_PYTHON:-python3}
WHEELS=${HALOPIPE_WHEELS:-$ROOT/.whl}
VENV=${HALOPIPE_GPU_VENV:-${TMPDIR:-/tmp}/halopipe-gpu-venv}
# Scratch outside the checkout and outside $RESULTS: $OUT brings back only a few files.
WORK=$(mktemp -d "${TMPDIR:-/tmp}/halopipe-gpu-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
# No retries: without a network each try would wait out its timeout.
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=10 PIP_RETRIES=0
# The checks import halopipe and tests.* from this checkout (the venv over the image's python has no install).
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$RESULTS" && : >"$LOG" || exit 2
ROWS=()
FAILED=0

say() { echo "$*" | tee -a "$LOG"; }

# step COUNTS NAME SECONDS CMD...: CMD under a time limit, its output into the log, a row into the summary.
# COUNTS=0 marks a step whose failure is recorded but does not fail the check.
step() {
    local counts=$1 name=$2 limit=$3 start=$SECONDS rc verdict=ok
    shift 3
    say "== $name: $*"
    # A function of this script runs in a child bash (timeout runs programs only): see the export -f below.
    if declare -F "$1" >/dev/null; then set -- bash -c '"$@"' _ "$@"; fi
    timeout "$limit" "$@" >>"$LOG" 2>&1
    rc=$?
    if ((rc != 0)); then
        verdict="failed (exit $rc$( ((rc == 124)) && echo ", over ${limit} s"))"
        ((counts)) && FAILED=$((FAILED + 1))
        ((counts)) || verdict="$verdict, informational"
    fi
    ROWS+=("| $name | $verdict | $((SECONDS - start)) s |")
    say "-- $name: $verdict"
    return "$rc"
}

# The requirements of halopipe and its test extra that python $1 lacks, one a line (pip's spelling).
missing_requirements() {
    "$1" - <<'EOF'
import importlib.metadata as md
import re

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for requirement in project["dependencies"] + project["optional-dependencies"]["test"]:
    name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)
    try:
        md.version(name)
    except md.PackageNotFoundError:
        print(requirement)
EOF
}

# pip install into the venv, from the carried wheels when there are any (no index on the GPU machine).
venv_pip() {
    local source=()
    compgen -G "$WHEELS/*.whl" >/dev/null && source=(--no-index --find-links "$WHEELS")
    "$VENV/bin/python" -m pip install -q "${source[@]}" "$@"
}

# A venv over $PY's packages: its site-packages listed in a .pth of the venv (a venv of a venv sees only the
# base interpreter's), so pip counts them as installed and adds only what is missing.
layer_venv_over_python() {
    local inner
    "$PY" -m venv --system-site-packages "$VENV" || return
    inner=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
    "$PY" -c 'import site; print("\n".join(site.getsitepackages()))' >"$inner/_gpu_check_base.pth"
}

export -f venv_pip layer_venv_over_python
export PY VENV WHEELS

prepare_with_cuda_torch() {
    local missing
    step 1 "venv over $PY" 120 layer_venv_over_python || return
    missing=$(missing_requirements "$VENV/bin/python")
    say "missing: ${missing:-none}"
    # One at a time: a package that cannot be had (no wheel, no index) must not stop the others.
    while read -r requirement; do
        [[ -n $requirement ]] && step 0 "install $requirement" 120 venv_pip "$requirement"
    done <<<"$missing"
}

prepare_without_cuda_torch() {
    say "$PY has no CUDA torch: the venv gets its own"
    step 1 "venv" 120 "$PY" -m venv "$VENV" &&
        step 1 "install torch" 600 venv_pip torch &&
        step 1 "install halopipe[test,mace]" 600 venv_pip -e ".[test,mace]"
}

prepare_python() {
    if ((DRY)); then
        local missing
        missing=$(missing_requirements "$PY")
        say "dry run: $PY as it is (the GPU run makes a venv at $VENV); it lacks: ${missing:-nothing}"
        return
    fi
    if "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>>"$LOG"; then
        prepare_with_cuda_torch
    else
        prepare_without_cuda_torch
    fi
    PY=$VENV/bin/python
}

# Two ranks, one GPU: gloo, because NCCL refuses two ranks on one device ("Duplicate GPU detected").
write_two_rank_check() {
    cat >"$WORK/two_ranks_one_gpu.py" <<'EOF'
"""tests/test_cuda.py's composite on 2 spawned ranks (gloo) on DEVICE, against one process on the CPU."""

import sys

import torch

from halopipe.distributed import ShardedSystem
from halopipe.distributed.launch import spawn
from tests.conftest import triclinic_nacl
from tests.test_cuda import composite


def evaluate(device: str):
    system, pipeline = triclinic_nacl(), composite().to(device)
    sharded = ShardedSystem.scatter(system.to(device=device) if torch.distributed.get_rank() == 0 else None, pipeline.config)
    out = pipeline(sharded, stress=True)
    return float(out["energy"]), sharded.gather(out["forces"]).cpu(), out["stress"].cpu()


if __name__ == "__main__":
    from two_ranks_one_gpu import evaluate  # by its module's name, which the spawned ranks import

    device = sys.argv[1]
    ref = composite()(triclinic_nacl(), stress=True)
    energy, forces, stress = spawn(evaluate, 2, device, timeout=300)[0]
    errors = {
        "energy": (abs(energy - float(ref["energy"])), 1e-10),
        "forces": (float((forces - ref["forces"]).abs().max()), 1e-10),
        "stress": (float((stress - ref["stress"]).abs().max()), 1e-12),
    }
    print(f"two ranks on {device} vs one CPU process: " + ", ".join(f"max |d{k}| {e:.2e} (limit {t:.0e})" for k, (e, t) in errors.items()))
    sys.exit(0 if all(e <= t for e, t in errors.values()) else 1)
EOF
}

# GPU, versions and kernel backend: into the log and, as they are, into the summary.
report_environment() {
    {
        command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
        "$PY" - <<'EOF'
import importlib.metadata as md

import torch

from halopipe.kernels.backend import kernel_backend

try:
    warp = md.version("warp-lang")
except md.PackageNotFoundError:
    warp = "absent"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPUs {torch.cuda.device_count()}; warp-lang {warp}; halopipe kernels: {kernel_backend()}")
EOF
    } >"$WORK/environment" 2>&1
    say "== environment"
    tee -a "$LOG" <"$WORK/environment"
}

# Benchmarks besides md_throughput.py that take --device (none yet); run with their defaults.
other_device_benchmarks() {
    grep -l -e '"--device"' benchmarks/*.py | grep -v -e md_throughput.py -e peers.py
}

run_steps() {
    local cuda_tests tests two_ranks lj
    mapfile -t cuda_tests < <(grep -rl --include='test_*.py' 'mark.cuda' tests)
    write_two_rank_check
    tests=("$PY" -m pytest -q -x -m cuda "${cuda_tests[@]}")
    two_ranks=(env PYTHONPATH="$WORK:$PYTHONPATH" "$PY" "$WORK/two_ranks_one_gpu.py")
    lj=("$PY" benchmarks/md_throughput.py --cases lj-argon-32k --markdown)
    if ((DRY)); then
        say "the GPU run: ${tests[*]}"
        say "the GPU run: ${two_ranks[*]} cuda"
        say "the GPU run: ${lj[*]} --device cuda --nproc 1 --steps 20 --warmup 3; then --nproc 2 (nccl, informational)"
        step 1 "CUDA tests (collected)" 60 "${tests[@]}" --collect-only
        step 1 "2 ranks, gloo (cpu)" 120 "${two_ranks[@]}" cpu
        step 1 "md_throughput LJ (cpu, 1 step)" 60 "${lj[@]}" --device cpu --nproc 1 --steps 1 --warmup 0
        for bench in $(other_device_benchmarks); do step 1 "$bench --help" 60 "$PY" "$bench" --help; done
        return
    fi
    step 1 "CUDA tests" 180 "${tests[@]}"
    step 1 "2 ranks, gloo, one GPU" 150 "${two_ranks[@]}" cuda
    step 1 "md_throughput LJ (cuda)" 120 "${lj[@]}" --device cuda --nproc 1 --steps 20 --warmup 3
    step 0 "md_throughput LJ, 2 ranks, nccl, one GPU" 60 "${lj[@]}" --device cuda --nproc 2 --steps 5 --warmup 1
    for bench in $(other_device_benchmarks); do step 1 "$bench" 120 "$PY" "$bench" --device cuda; done
}

write_summary() {
    {
        echo "# GPU check$( ((DRY)) && echo " (dry run, CPU)")"
        echo
        echo "$(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)."
        echo
        sed 's/^/    /' "$WORK/environment"
        echo
        echo "| step | result | time |"
        echo "| --- | --- | --- |"
        printf '%s\n' "${ROWS[@]}"
        echo
        grep -e '^two ranks on' -e '^|' -e '^NVE throughput' "$LOG"
        echo
        echo "Full output: gpu_check.log."
    } >"$SUMMARY"
}

prepare_python
report_environment
run_steps
write_summary
say "$FAILED failed step(s); summary: $SUMMARY"
((FAILED == 0))
