#!/usr/bin/env bash
# One command for a lent GPU machine (no network; this repository copied in, the wheels of
# scripts/build_gpu_wheels.sh in it):
#
#   bash scripts/gpu_check.sh [--device cuda|cpu] [--wheels DIR] [--out REPORT.md] [--budget SECONDS]
#                             [--test-timeout SECONDS] [--quick] [--no-compile] [--sections "layer training decode quant"]
#
#   --device        cuda (default) or cpu: a dry run of every step on CPU (tests/gpu skip, benchmarks at tiny shapes)
#   --wheels        the wheels to install (default .whl); none there: the environment's packages are used
#   --out           the report (default gpu_check_report.md)
#   --budget        seconds for the whole run (default 480: 8 minutes); every step gets what is left, at most its share;
#                   0: no budget and no per-step time limit (a dry run that a busy machine cannot make run out of time)
#   --test-timeout  seconds per test (default 120, GPU_TEST_TIMEOUT of tests/gpu/conftest.py)
#   --quick         benchmarks at their --quick shapes (smaller, fewer rounds)
#   --no-compile    benchmarks without torch.compile (a quick CPU dry run)
#   --sections      which benchmark sections to run (default all four; the others are reported as not asked for)
#
# Steps: install the wheels into a temporary --target (then PYTHONPATH), print card, driver, torch, transformers;
# every tests/gpu file under `timeout`; benchmarks/gpu.py's sections (layer, training, decode) each in a fresh process
# under `timeout`; quant: benchmarks/quantization.py's footprint and decoding rows (4-bit / 8-bit experts; needs
# bitsandbytes, which the kit does not carry: reported as not run where the machine lacks it). The report is written after every step and names what did not run and why, also when the script
# is stopped or a step fails or runs out of time.
set -uo pipefail
cd "$(dirname "$0")/.."
device=cuda wheels=.whl report=gpu_check_report.md budget=480 test_timeout=120 quick="" compile=""
sections="layer training decode quant"
while [ $# -gt 0 ]; do
    case $1 in
        --device) device=$2; shift 2 ;;
        --wheels) wheels=$2; shift 2 ;;
        --out) report=$2; shift 2 ;;
        --budget) budget=$2; shift 2 ;;
        --test-timeout) test_timeout=$2; shift 2 ;;
        --quick) quick=--quick; shift ;;
        --no-compile) compile=--no_compile; shift ;;
        --sections) sections=$2; shift 2 ;;
        -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
    esac
done
case $device in cuda | cpu) ;; *) echo "gpu_check.sh: --device is cuda or cpu, not '$device'" >&2; exit 2 ;; esac
case $budget in '' | *[!0-9]*) echo "gpu_check.sh: --budget is a number of seconds, not '$budget'" >&2; exit 2 ;; esac
deadline=$((SECONDS + budget))
work=$(mktemp -d)
# step name -> its share of the budget in seconds (each also capped by what is left)
steps=(wheels versions tests layer training decode quant)
declare -A share=([wheels]=60 [versions]=60 [tests]=120 [layer]=110 [training]=150 [decode]=100 [quant]=90)
declare -A done_=()
if [ "$device" = cpu ]; then share=([wheels]=60 [versions]=60 [tests]=60 [layer]=60 [training]=60 [decode]=60 [quant]=60); fi

say() { printf '%s\n' "$@" >>"$report"; }
left() {
    if [ "$budget" = 0 ]; then echo unlimited; return; fi
    local t=$((deadline - SECONDS)); [ "$t" -lt "${share[$1]}" ] && echo "$t" || echo "${share[$1]}"
}
finish() {
    local missing=()
    for s in "${steps[@]}"; do [ -n "${done_[$s]:-}" ] || missing+=("$s"); done
    if [ ${#missing[@]} -gt 0 ]; then
        say "" "## Not run" "" "The script stopped (exit or signal) before: ${missing[*]}."
    fi
    if [ "$budget" = 0 ]; then say "" "Finished after $SECONDS s (no budget)."
    else say "" "Finished after $SECONDS s of a $budget s budget."; fi
    rm -rf "$work"
}
trap finish EXIT
trap 'exit 130' INT TERM
# run STEP LOG CMD...: under `timeout` with the step's time; prints rc (124: ran out of time)
run() {
    local step=$1 log=$2 t; shift 2
    t=$(left "$step")
    if [ "$t" = unlimited ]; then "$@" >"$log" 2>&1; echo $?; return; fi
    if [ "$t" -le 5 ]; then echo skipped; return; fi
    timeout -k 10 "$t" "$@" >"$log" 2>&1
    echo $?
}
tail_of() { say '```' "$(tail -n "${2:-15}" "$1")" '```'; }

: >"$report"
say "# GPU check, $(date -u '+%Y-%m-%d %H:%M UTC'), $(git rev-parse --short HEAD 2>/dev/null || echo 'no git') ($device)" ""

# ---- 1. wheels
say "## Setup" ""
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if compgen -G "$wheels/*.whl" >/dev/null; then
    rc=$(run wheels "$work/pip.log" python3 -m pip install -q --no-index --find-links "$wheels" --no-deps \
        --target "$work/site" "$wheels"/*.whl)
    if [ "$rc" = 0 ]; then
        export PYTHONPATH=$work/site:$PYTHONPATH
        say "- wheels: $(ls "$wheels"/*.whl | wc -l) from $wheels installed into a temporary target (PYTHONPATH)"
    else
        say "- wheels: installing from $wheels FAILED (rc $rc); the environment's packages are used:"; tail_of "$work/pip.log"
    fi
else
    say "- wheels: none in $wheels (bash scripts/build_gpu_wheels.sh brings them); the environment's packages are used"
fi
done_[wheels]=1

# ---- 2. versions
if command -v nvidia-smi >/dev/null; then
    say "- card, driver, memory: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)"
else
    say "- nvidia-smi: not found"
fi
rc=$(run versions "$work/versions.log" python3 -c "
import sys, torch, transformers, accelerate
cuda = torch.cuda.get_device_name() + ' (sm%d%d)' % torch.cuda.get_device_capability() if torch.cuda.is_available() else 'no CUDA device'
print(f'- python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), transformers '
      f'{transformers.__version__}, accelerate {accelerate.__version__}; torch sees: {cuda}')
import hf_ppmoe; print(f'- import hf_ppmoe: ok ({hf_ppmoe.__file__})')")
if [ "$rc" = 0 ]; then say "$(cat "$work/versions.log")"; else say "- versions / import FAILED (rc $rc):"; tail_of "$work/versions.log"; fi
done_[versions]=1

# ---- 3. tests/gpu, one process per file
say "" "## tests/gpu (per test ${test_timeout} s; per file the step's time)" ""
export GPU_TEST_TIMEOUT=$test_timeout
for f in tests/gpu/test_*.py; do
    log=$work/$(basename "$f" .py).log
    rc=$(run tests "$log" python3 -m pytest -q -rfE -p no:cacheprovider "$f")
    case $rc in
        skipped) say "- $f: NOT RUN, no time left in the budget" ;;
        124 | 137) say "- $f: TIMED OUT after its $(left tests) s or the budget; last lines:"; tail_of "$log" ;;
        *) say "- $f (rc $rc): $(tail -n 1 "$log")"
           grep -E '^(FAILED|ERROR) ' "$log" | sed 's/^/    - /' >>"$report" ;;
    esac
done
done_[tests]=1

# ---- 4. benchmarks/gpu.py, one fresh process per section
say "" "## benchmarks/gpu.py (bf16; one process per section)" ""
for s in layer training decode; do
    log=$work/$s.log
    if [[ " $sections " != *" $s "* ]]; then
        say "### $s: NOT RUN, not asked for (--sections \"$sections\")" ""; done_[$s]=1; continue
    fi
    rc=$(run "$s" "$log" python3 benchmarks/gpu.py --device "$device" $quick $compile --sections "$s" --out "$work/$s.md")
    case $rc in
        0) sed 1,2d "$work/$s.md" >>"$report" ;;
        skipped) say "### $s: NOT RUN, no time left in the budget" "" ;;
        124 | 137) say "### $s: TIMED OUT (share ${share[$s]} s or the budget); what it printed:" ""; tail_of "$log" 30 ;;
        *) say "### $s: FAILED (rc $rc)" ""
           [ -f "$work/$s.md" ] && sed 1,2d "$work/$s.md" >>"$report"
           tail_of "$log" 20 ;;
    esac
    done_[$s]=1
done
# ---- 5. quantized experts: benchmarks/quantization.py's footprint and decoding rows
log=$work/quant.log
if [[ " $sections " != *" quant "* ]]; then
    say "### quant: NOT RUN, not asked for (--sections \"$sections\")" ""
elif ! python3 -c "import bitsandbytes" >/dev/null 2>&1; then
    say "### quant: NOT RUN, bitsandbytes is not installed here: its wheel (41 MiB, 0.50.2) does not fit the kit's" \
        "64 MiB beside transformers and the rest (28 MiB); an image with bitsandbytes runs this row" ""
else
    size=(); [ "$device" = cpu ] || [ -n "$quick" ] && size=(--smoke)
    rc=$(run quant "$log" python3 benchmarks/quantization.py --device "$device" --parts footprint "${size[@]}" \
        --markdown "$work/quant.md")
    case $rc in
        0) cat "$work/quant.md" >>"$report"; say "" ;;
        skipped) say "### quant: NOT RUN, no time left in the budget" "" ;;
        124 | 137) say "### quant: TIMED OUT (share ${share[quant]} s or the budget); what it printed:" ""; tail_of "$log" 30 ;;
        *) say "### quant: FAILED (rc $rc)" ""; tail_of "$log" 20 ;;
    esac
fi
done_[quant]=1
echo "gpu_check.sh: report written to $report"
