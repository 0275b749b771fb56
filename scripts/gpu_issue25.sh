#!/usr/bin/env bash
# Issue 25's remaining GPU runs, one device call per mode (one H100; run from the repository
# root, $OUT set; every mode ends by its own `timeout` within 9.5 minutes). The plan, its order
# and its time estimates: docs/training.md, "Next GPU runs for issue 25".
#
# Device modes (run these through the device tool, carry ["runs/issue25/ckpt"]):
#   throughput                 item 5: bench_train.py, `small` at 128K, 512K, 1M beside dense
#                              (+ the stdlib corpus of this python, checked before any stdlib run)
#   stdlib32k-ATT-K            item 4: train_stdlib_bytes.py --preset h100-32k, ATT in dilated,
#                              dense, local; K = 1 starts the run, K = 2, 3 resume it (20 min of
#                              training in 3 calls)
#   stdlib128k-ATT-K           item 4: --preset h100-128k, ATT in dilated, local; K = 1, 2
#                              (14 min of training in 2 calls)
#   retrieval512k-seedS-K      item 2: train_retrieval.py --recipe h100-512k --run-to-cap, 20-min
#                              cap (evals counted), S in 0, 1, 2; K = 1, 2, 3
#   retrieval1m-K              item 3: --recipe h100-1m --target 0.9, 30-min cap, stops at the
#                              target; K = 1 .. 4
#   pair K RUN_A RUN_B         item 4 on a machine of two GPUs (nvidia-h100-x2): call K of two
#                              stdlib runs side by side, RUN_A on GPU 0 and RUN_B on GPU 1
#                              (RUN = stdlib32k-ATT or stdlib128k-ATT; each GPU trains one run
#                              alone, so a run's wall clock is its own). Two checkpoints (2 x 37
#                              MiB) are more than a call returns (64 MiB): they stay on the
#                              machine, in runs/issue25/dev/ (ignored, not carried: kept between
#                              calls while the machine is held), so calls 1, 2, 3 of a pair must
#                              follow each other on one machine (within its 30 s idle release
#                              and its 30 minutes of holding: 3 calls of <= 9.4 min fit). A
#                              call K > 1 that finds no checkpoint there (a fresh machine) stops
#                              at once: start the pair again with K = 1. The call returns one
#                              file, pair.tgz (both runs' log, md, json, png); both GPUs must
#                              be H100s (the single-GPU runs ran on one), unless ANY_GPU=1.
#                              THEN=RUN-K: after RUN_A, GPU 0 runs call K of a single run
#                              resumed from the carried runs/issue25/ckpt (e.g. THEN=
#                              stdlib32k-dilated-3 beside the pair's last call), in the time
#                              left (it pauses before the call's limit; its checkpoint comes back)
#   retrieval128k-WHAT         item 1 again with jittered evals, one call each, no checkpoint:
#                              WHAT = seed0, seed1, seed2 (dilated), dense, local (the
#                              baselines with the dilated runs' 5-minute cap, seed 0); every
#                              run stops at the target and keeps its final model (the
#                              checkpoint: 8 files in all), for --eval-checkpoint
# A call returns at most 8 files from $OUT and a retrieval mode writes exactly 8 (the checkpoint
# is 3 of them; with --ema 4, and the mode then leaves out its loss plot, which finalize
# redraws): write nothing else there in the same call, or the checkpoint stays behind.
# A K > 1 mode resumes from runs/issue25/ckpt/RUN.pt (+ .1, .2): the checkpoint files the
# previous call of that run wrote under $OUT, put there by `collect`. Rerunning a K > 1 mode
# after a killed call resumes from the checkpoint of its last eval (at most one eval interval
# is lost); the mode number only says whether to start fresh (1) or resume (> 1).
#
# Local modes (this machine, no GPU):
#   collect-pair FILES_AT      after each pair call: each run's files into
#                              runs/issue25/out/RUN-K/ (what `collect` keeps for a single call,
#                              less the checkpoint), prints both runs' tables
#   collect FILES_AT MODE      after each device call: keeps what came back under
#                              runs/issue25/out/MODE/ and, unless the run finished, its checkpoint
#                              in runs/issue25/ckpt/ (the only thing there: one run at a time);
#                              retrieval128k modes leave runs/issue25/ckpt/ alone (a paused 512K
#                              run survives) and keep their final model in the out dir only
#   finalize [DATE [RUNS]]     merged reports into benchmarks/results/, only the runs whose name
#                              matches the regex RUNS if given (else every run under out/, each
#                              written again under DATE) (stdlib: one report and one
#                              figure per preset; retrieval and throughput: the last call's files)
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
CK=runs/issue25/ckpt
mode=${1:?mode: throughput, stdlib32k-ATT-K, stdlib128k-ATT-K, pair K RUN_A RUN_B, retrieval512k-seedS-K, retrieval1m-K, collect, collect-pair, finalize}
case "$mode" in  # the local modes: this machine's venv (torch, matplotlib) unless PYTHON is set
  collect|collect-pair|finalize) if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi ;;
esac
LIMIT=${LIMIT:-565}   # seconds: the device call's own limit, under 9.5 minutes
# EXTRA: more flags for the training scripts (a CPU check of this script: EXTRA="--tiny ...")
PAUSE=${PAUSE:-8.3}   # minutes of a call (setup and evals included) before a run pauses

env_line() {
  $PY -c "import torch, platform; import triton; print('torch', torch.__version__, 'triton', triton.__version__, 'python', platform.python_version(), torch.cuda.get_device_name() if torch.cuda.is_available() else 'no cuda')"
}

resume_args() {  # RUN K [DIR] -> the --resume flags of call K of RUN (none for K = 1)
  local dir=${3:-$CK}
  if [ "$2" = 1 ]; then
    if [ -e "$dir/$1.pt" ]; then echo "note: $dir/$1.pt exists; call 1 starts a fresh run anyway" >&2; fi
    return 0
  fi
  if [ ! -e "$dir/$1.pt" ]; then
    if [ "$dir" = "$CK" ]; then
      echo "no checkpoint $dir/$1.pt: run 'collect' on the previous call's files and carry $CK" >&2
    else
      echo "no checkpoint $dir/$1.pt on this machine (a fresh one?): start the pair again with K = 1" >&2
    fi
    return 1
  fi
  echo "--resume $dir/$1.pt"
}

run_finished() {  # RUN.json -> whether the run in it is done (stdlib: epochs; retrieval: reached_target)
  $PY -c "
import json, sys
r = json.load(open(sys.argv[1]))['runs'][0]
sys.exit(0 if ('epochs' in r or 'reached_target' in r) else 1)" "$1" 2>/dev/null
}

stdlib_args() {  # RUN (stdlib32k-ATT / stdlib128k-ATT) -> the preset and attention flags
  local size=${1%%-*} att=${1#*-}
  case "$size" in stdlib32k|stdlib128k) ;; *) echo "not a stdlib run: $1" >&2; return 1 ;; esac
  case "$att" in dilated|dense|local) ;; *) echo "not an attention: $att (in $1)" >&2; return 1 ;; esac
  echo "--preset h100-${size#stdlib} --attention $att"
}

case "$mode" in
  throughput)
    OUT=${OUT:?}; mkdir -p "$OUT"
    { env_line; $PY -c "
from dilated_attention.data import StdlibBytes
d = StdlibBytes(131072)
print('stdlib corpus:', d.root, len(d.train_files), 'train files', len(d.train_data), 'bytes;', len(d.val_files), 'validation files', len(d.val_data), 'bytes')"
      timeout -k 10 "$LIMIT" $PY benchmarks/bench_train.py --presets small \
        --lengths 131072,524288,1048576 --attention dilated,dense --dense-steps 1 \
        --search-dense --search-probes 2 --budget-s 420 --out "$OUT/train_throughput_1m_h100"
      echo "rc=$?"; } 2>&1 | tee "$OUT/log.txt"
    ;;
  stdlib32k-*|stdlib128k-*)
    OUT=${OUT:?}; mkdir -p "$OUT"
    IFS=- read -r size att k <<< "$mode"
    run="$size-$att"
    preset=h100-${size#stdlib}
    res=$(resume_args "$run" "$k") || exit 2
    { env_line
      # shellcheck disable=SC2086
      timeout -k 10 "$LIMIT" $PY benchmarks/train_stdlib_bytes.py --preset "$preset" \
        --attention "$att" --pause-after-minutes "$PAUSE" --checkpoint "$OUT/$run.pt" \
        --out "$OUT/$run" $res ${EXTRA:-}; echo "rc=$?"; } 2>&1 | tee "$OUT/log.txt"
    ;;
  retrieval512k-seed*|retrieval1m-*)
    OUT=${OUT:?}; mkdir -p "$OUT"
    k=${mode##*-}
    run=${mode%-*}
    if [ "${run#retrieval1m}" != "$run" ]; then
      flags="--recipe h100-1m --target 0.9"
    else
      seed=${run#retrieval512k-seed}
      flags="--recipe h100-512k --seeds $seed --max-minutes 20 --run-to-cap"
    fi
    res=$(resume_args "$run" "$k") || exit 2
    { env_line
      # shellcheck disable=SC2086
      timeout -k 10 "$LIMIT" $PY benchmarks/train_retrieval.py $flags \
        --pause-after-minutes "$PAUSE" --checkpoint "$OUT/$run.pt" --out "$OUT/$run" $res ${EXTRA:-}
      echo "rc=$?"; } 2>&1 | tee "$OUT/log.txt"
    # a call returns 8 files: with --ema the checkpoint has 4 parts (2026-11-27), so the loss
    # plot stays behind (finalize draws both plots again from the json)
    if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
      rm -f "$OUT/${run}_loss.png"; echo "left out ${run}_loss.png (more than 8 files; finalize redraws it)"
    fi
    ;;
  retrieval128k-*)
    OUT=${OUT:?}; mkdir -p "$OUT"
    case "${mode#retrieval128k-}" in
      seed0|seed1|seed2) flags="--seeds ${mode#retrieval128k-seed}" ;;
      dense) flags="--attention dense --max-minutes 5" ;;
      local) flags="--attention local --max-minutes 5" ;;
      *) echo "unknown mode $mode" >&2; exit 2 ;;
    esac
    { env_line
      # shellcheck disable=SC2086
      timeout -k 10 "$LIMIT" $PY benchmarks/train_retrieval.py --recipe h100-128k $flags \
        --checkpoint "$OUT/$mode.pt" --out "$OUT/$mode" ${EXTRA:-}
      echo "rc=$?"; } 2>&1 | tee "$OUT/log.txt"
    ;;
  pair)
    k=${2:?pair K RUN_A RUN_B}; a=${3:?pair K RUN_A RUN_B}; b=${4:?pair K RUN_A RUN_B}
    OUT=${OUT:?}; mkdir -p "$OUT"
    [ "$a" != "$b" ] || { echo "pair: two different runs, not $a twice" >&2; exit 2; }
    DEV=runs/issue25/dev; mkdir -p "$DEV"
    fa=$(stdlib_args "$a") && fb=$(stdlib_args "$b") || exit 2
    ra=$(resume_args "$a" "$k" "$DEV") && rb=$(resume_args "$b" "$k" "$DEV") || exit 2
    env_line
    if [ "${ANY_GPU:-0}" != 1 ]; then
      names=$($PY -c "import torch; print(';'.join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))")
      echo "GPUs: $names"
      case "$names" in
        *H100*\;*H100*) ;;
        *) echo "pair needs two H100s (the single-GPU stdlib runs ran on one): found '$names' (ANY_GPU=1 overrides)" >&2; exit 2 ;;
      esac
    fi
    # THEN=RUN-K (optional): call K of a single run, resumed from the carried $CK as the
    # single-GPU modes do, on GPU 0 after RUN_A's call, in the time left of this call (it
    # pauses before the call's limit; its checkpoint then comes back as the single modes' do)
    then_run=""; then_k=""; then_res=""; then_flags=""
    if [ -n "${THEN:-}" ]; then
      then_run=${THEN%-*}; then_k=${THEN##*-}
      then_flags=$(stdlib_args "$then_run") && then_res=$(resume_args "$then_run" "$then_k") || exit 2
      case " $a $b " in *" $then_run "*) echo "THEN=$THEN is one of the pair" >&2; exit 2 ;; esac
    fi
    t0=$(date +%s)
    one() {  # GPU RUN K FLAGS RESUME CHECKPOINT PAUSE_MIN LIMIT_S
      mkdir -p "$OUT/$2-$3"
      # shellcheck disable=SC2086
      { env_line; CUDA_VISIBLE_DEVICES=$1 timeout -k 10 "$8" $PY benchmarks/train_stdlib_bytes.py \
          $4 --pause-after-minutes "$7" --checkpoint "$6" \
          --out "$OUT/$2-$3/$2" $5 ${EXTRA:-}; echo "rc=$?"; } > "$OUT/$2-$3/log.txt" 2>&1
    }
    (
      one 0 "$a" "$k" "$fa" "$ra" "$DEV/$a.pt" "$PAUSE" "$LIMIT"
      if [ -n "$then_run" ]; then
        left=$(( LIMIT - ($(date +%s) - t0) ))   # seconds of this call left
        pause=$($PY -c "print(round(min($PAUSE, ($left - 45) / 60), 2))")
        if [ "$left" -gt 120 ]; then
          one 0 "$then_run" "$then_k" "$then_flags" "$then_res" "$OUT/$then_run.pt" "$pause" "$((left - 10))"
        else
          echo "THEN=$THEN not started: $left s of the call left" >&2
        fi
      fi
    ) &
    one 1 "$b" "$k" "$fb" "$rb" "$DEV/$b.pt" "$PAUSE" "$LIMIT" &
    wait
    dirs="$a-$k $b-$k"
    [ -n "$then_run" ] && [ -d "$OUT/$then_run-$then_k" ] && dirs="$dirs $then_run-$then_k"
    for d in $dirs; do
      echo "== $d"
      grep -vE "^\| [0-9]" "$OUT/$d/log.txt" | grep -E "^\||rc=|paused|steps,|Error|error" | tail -8
    done
    # shellcheck disable=SC2086
    tar czf "$OUT/pair.tgz" -C "$OUT" $dirs && (cd "$OUT" && rm -rf $dirs)
    ;;
  collect-pair)
    src=${2:?collect-pair FILES_AT}
    tmp=$(mktemp -d)
    tar xzf "$src/pair.tgz" -C "$tmp" || exit 1
    for d in "$tmp"/*/; do
      m=$(basename "$d"); run=${m%-*}
      dest=runs/issue25/out/$m
      rm -rf "$dest"; mkdir -p "$(dirname "$dest")" && cp -r "$d" "$dest"
      if run_finished "$dest/$run.json"; then
        echo "== $m: $run finished"
        finished="${finished:-} $run"
        if [ -e "$CK/$run.pt" ]; then rm -f "$CK/$run".pt*; echo "   (its carried checkpoint removed from $CK)"; fi
      else
        if [ -e "$src/$run.pt" ]; then echo "== $m: paused (its checkpoint came back: kept below)"
        else echo "== $m: paused (its checkpoint is on the device machine: runs/issue25/dev/$run.pt)"; fi
      fi
      grep -h "^|" "$dest"/*.md 2>/dev/null | head -12
    done
    rm -rf "$tmp"
    # a THEN run that paused: its checkpoint came back beside pair.tgz; keep it as `collect` does
    for f in "$src"/*.pt; do
      [ -e "$f" ] || continue
      case " ${finished:-} " in *" $(basename "$f" .pt) "*) continue ;; esac
      rm -rf "$CK"; mkdir -p "$CK" && cp "$f"* "$CK"/
      echo "kept for the next call: $(ls "$CK" | tr '\n' ' ')"
    done
    ;;
  collect)
    src=${2:?collect FILES_AT MODE}; m=${3:?collect FILES_AT MODE}
    run=${m%-*}
    dest=runs/issue25/out/$m
    rm -rf "$dest"; mkdir -p "$dest" && cp -r "$src"/. "$dest"/  # nothing of an older run of MODE stays
    case "$m" in
      retrieval128k-*)  # one call each: its checkpoint is the final model, kept in $dest only
        grep -h "^|" "$dest"/*.md 2>/dev/null | head -12; exit 0 ;;
    esac
    rm -rf "$CK"; mkdir -p "$CK"
    if [ -e "$dest/$run.pt" ]; then
      if run_finished "$dest/$run.json"; then
        echo "$run finished: no checkpoint kept"
      else
        cp "$dest/$run".pt* "$CK"/
        echo "kept for the next call: $(ls "$CK" | tr '\n' ' ')($(du -sh "$CK" | cut -f1))"
      fi
    fi
    grep -h "^|" "$dest"/*.md 2>/dev/null | head -12
    ;;
  finalize)
    date=${2:-$(date -u +%F)}
    only=${3:-}  # a regex of the runs to write (e.g. 'retrieval512k-seed[02]'); default: every run kept
    want() { [ -z "$only" ] || echo "$1" | grep -Eq "^($only)$"; }
    last() { want "$1" && ls -d runs/issue25/out/"$1"-* 2>/dev/null | sort -V | tail -1; }
    for size in 32k 128k; do
      jsons=""
      for att in dilated dense local; do
        d=$(last "stdlib$size-$att") || true
        [ -n "$d" ] && jsons="$jsons,$d/stdlib$size-$att.json"
      done
      [ -n "$jsons" ] && $PY benchmarks/train_stdlib_bytes.py --merge "${jsons#,}" \
        --out "benchmarks/results/stdlib_bytes_${size}_h100_$date" > /dev/null && echo "stdlib $size: ${jsons#,}"
    done
    for run in retrieval512k-seed0 retrieval512k-seed1 retrieval512k-seed2 retrieval1m; do
      d=$(last "$run") || true
      [ -z "$d" ] && continue
      name=${run/retrieval512k-seed/retrieval_512k_h100_${date}_seed}
      name=${name/retrieval1m/retrieval_1m_h100_$date}
      for f in "$d/$run".md "$d/$run".json; do
        cp "$f" "benchmarks/results/$name${f#"$d/$run"}"
      done
      # both plots from the json (the last call's json holds the whole run; its loss plot may
      # have been left out of the call's files)
      $PY - "$d/$run.json" "benchmarks/results/$name.png" <<'PLOT' || echo "$run: no plots (matplotlib?)"
import json, sys
sys.path.insert(0, "benchmarks")
import train_retrieval
d = json.load(open(sys.argv[1]))
sys.exit(0 if train_retrieval._plot(d["recipe"], d["runs"], sys.argv[2]) else 1)
PLOT
      echo "$run: $d"
    done
    for w in seed0 seed1 seed2 dense local; do
      d=runs/issue25/out/retrieval128k-$w
      [ -d "$d" ] && want "retrieval128k-$w" || continue
      for f in "$d/retrieval128k-$w".md "$d/retrieval128k-$w".json "$d/retrieval128k-$w".png \
               "$d/retrieval128k-${w}_loss.png"; do  # not the checkpoint (.pt*: the model)
        [ -e "$f" ] && cp "$f" "benchmarks/results/retrieval_128k_h100_${date}_$w${f#"$d/retrieval128k-$w"}"
      done
      echo "retrieval128k-$w: $d"
    done
    d=runs/issue25/out/throughput
    if [ -d "$d" ] && want throughput; then
      cp "$d/train_throughput_1m_h100.md" "benchmarks/results/train_throughput_1m_h100_$date.md"
      cp "$d/train_throughput_1m_h100.json" "benchmarks/results/train_throughput_1m_h100_$date.json"
    fi
    ls -la benchmarks/results | grep "$date"
    ;;
  *)
    echo "unknown mode $mode" >&2; exit 2
    ;;
esac
