#!/usr/bin/env bash
# One GPU verification call (the device machine; run from the repository root, $OUT set):
#   bash scripts/gpu_check.sh tests     verify + the CUDA tests + the N = 131072 bench
#   bash scripts/gpu_check.sh sp-x2     (nvidia-h200-x2) sequence parallelism on NCCL: bench_sequence_parallel.py
#                                       (its correctness check first) and train_sp_recipe.py (2 GPUs vs 1)
#   bash scripts/gpu_check.sh overhead  benchmarks/bench_overhead.py (issue 23) + bench_varlen.py (issue 22)
#   bash scripts/gpu_check.sh final     verify beside the CUDA tests (3 workers), then
#                                       bench_overhead.py --no-e2e and profile_host.py on an idle GPU
#   bash scripts/gpu_check.sh direct    issue 23's direct launch (on by default since 2026-11-25): the CUDA
#                                       tests of the decode plans and of every Triton path with it ON
#                                       (bit-for-bit against Triton's own launch), then the same-process
#                                       A/B benchmarks/ab_decode.py and the host profile
#   bash scripts/gpu_check.sh first     the CUDA tests as shipped, then the direct-launch subset ON
#   bash scripts/gpu_check.sh measure   verify, the N = 131072 bench, ab_decode.py, host profile (ON)
#   bash scripts/gpu_check.sh close     the CUDA tests, then ab_decode.py and bench_overhead.py --no-e2e
#                                       (the last call of a session: re-verify, re-measure issue 23)
#   bash scripts/gpu_check.sh suite     the whole CUDA test suite alone (-v, $CUDA_TEST_TIMEOUT 540 s, $WORKERS 4)
#   bash scripts/gpu_check.sh mem       benchmarks/mem_account.py at N = 2M, causal and not, fresh
#                                       processes (issue 24 item 3)
#   bash scripts/gpu_check.sh profile   where the time goes: profile_host.py --gpu-time (issue 23: host vs GPU
#                                       per call), profile_varlen.py (issue 22: causal varlen per launch
#                                       and block-config variants), then the CUDA tests named in
#                                       $PROFILE_TESTS (default: the plan / varlen / decode files)
#   bash scripts/gpu_check.sh varlen    issue 22 item 2: the varlen CUDA tests ($VARLEN_TESTS, default the
#                                       varlen / plan / packed-model files; varlen-ab: tests/test_triton_varlen.py
#                                       only), then profile_varlen.py on $ALT_SRC (another src/ tree carried
#                                       under runs/, if set: an A/B on one machine), profile_varlen.py
#                                       (per launch, $VARLEN_CONFIGS variants, the API vs the direct launches;
#                                       $PROFILE=0: skip) and bench_varlen.py ($BENCH=0: skip) on this tree;
#                                       with $ALT_SRC and BENCH_AB=1 also bench_varlen.py --ratio-only
#                                       ($ROUNDS rounds, default 9) on both trees, twice, alternating;
#                                       TESTS_LAST=1: the tests after the measurements (DEADLINE=epoch s: they
#                                       stop 25 s before it); ALT_PROFILE=0: no profile of $ALT_SRC
#   bash scripts/gpu_check.sh rotary    issue 23 item 5: CUDA tests of the fused rotary kernel, generate and
#                                       compile, then benchmarks/ab_rotary.py (kernel vs torch code, base steps)
#   bash scripts/gpu_check.sh step      issue 23 item 5: benchmarks/profile_step.py (one eager, one compiled and one
#                                       dense-SDPA LongNet base step profiled at 8K x 4 and 16K x 2: kernels per
#                                       category, eager by origin, host vs GPU time; no tests): eager = the defaults
#                                       (fused loss, CE and LayerNorm kernels), eager plain = without them
#   bash scripts/gpu_check.sh subset    a short re-verification: the interpreter check as this Triton answers it
#                                       (TRITON_INTERPRET unset, =1, =true), `verify`, then the CUDA tests of the
#                                       files in $SUBSET_TESTS (default: the front door, decode, varlen, HF and
#                                       train-plan files; timeout $SUBSET_TIMEOUT 240 s)
#   bash scripts/gpu_check.sh ncu       issue 24: Nsight Compute over benchmarks/ncu_kernels.py (the fused fwd+bwd at the
#                                       headline shape, then dense flash fwd+bwd at N = 16384; not causal, and causal with
#                                       NCU_CAUSAL=1): speed of light, launch, occupancy, warp state, scheduler, compute and
#                                       memory sections per kernel (--clock-control none), then `verify --dtype bf16`
#   bash scripts/gpu_check.sh verify    `verify` alone (one process per dtype, 330 s; 104 s cold on
#                                       2026-11-27), then bench_layernorm_rows.py alone
#   bash scripts/gpu_check.sh defaults after the fused-loss / LayerNorm defaults: verify, their CUDA tests,
#                                       bench_layernorm_rows.py, profile_step.py eager vs eager plain
#   bash scripts/gpu_check.sh decode    issue 23 item 6: CUDA tests of the rotary kernel, the decode step, generate
#                                       and the device guard, then bench_decode.py --no-latency (generate vs dense)
#                                       with --decode graph, then eager
#   bash scripts/gpu_check.sh decode2   issue 23 item 6: generate vs dense (fastest of 3 runs per length), graph and
#                                       eager, then profile_decode_step.py (where the eager step's time goes)
#   bash scripts/gpu_check.sh gqa       issue 24 target 2: benchmarks/bench_gqa.py only (the fused kernel with
#                                       kv heads 16/4/1 at the headline shape, causal and not, fwd and fwd+bwd,
#                                       same-run dense SDPA; each GQA / MQA row's % of dense over MHA's; no tests)
#   bash scripts/gpu_check.sh fuzz      issue 24 item 5: scripts/fuzz.py on CUDA, the Triton impl against the float64
#                                       reference (fwd, LSE, dq/dk/dv), $FUZZ_WORKERS (12) processes with a compile pool
#                                       of $FUZZ_POOL (4) templates each: up to $FUZZ_EXAMPLES (5000) dense cases in
#                                       $FUZZ_MINUTES (4; timeout $FUZZ_TIMEOUT 290 s), then up to $FUZZ_VARLEN_EXAMPLES
#                                       (5000) --varlen cases in $FUZZ_VARLEN_MINUTES (3; timeout 220 s): <= 8.7 min in
#                                       all. Expected ~2-3 min each (estimate, not yet measured: the slowest worker
#                                       compiles ~31 dense / ~26 varlen binaries (mean 24 / 15) at ~3-4 s each, then
#                                       ~10-50 ms a case); the binaries go to their own cache dir (random
#                                       specialisations: not carried back)
#   bash scripts/gpu_check.sh fuzz-gluon issue 24: scripts/fuzz.py --gluon on an sm_90 GPU: random configurations that
#                                       take the Gluon forward and backward (bf16/fp16, D 64/128, N <= 4096, partial
#                                       tiles, GQA/MQA, causal and not, split heads) against the float64 reference,
#                                       judged as tests/test_gluon_*.py judge them (<= 2x the error with both Gluon
#                                       switches off + 1e-3), each case an ERROR where the Gluon kernels did not launch;
#                                       $FUZZ_GLUON_WORKERS (12) processes, compile pool of $FUZZ_GLUON_POOL (2)
#                                       templates each, up to $FUZZ_GLUON_EXAMPLES (5000) cases in $FUZZ_GLUON_MINUTES
#                                       (6; timeout $FUZZ_GLUON_TIMEOUT 450 s): <= 8 min in all. Not yet run (estimate:
#                                       ~20-30 binaries per worker, Gluon ones of unknown compile time; exit 2 and
#                                       nothing fuzzed where Gluon cannot run); own cache dir, as `fuzz`
#   bash scripts/gpu_check.sh varlen-configs  issue 22: profile_varlen.py with dK/dV block-config variants
#                                       ($VARLEN_CONFIGS, default: default,dkdv32x64,dkdv32x64s3,dkdv64s1;
#                                       each compiles ~6 binaries: a call of its own), causal
#                                       ($CAUSAL=no for the other); kernel_resources.py says their spills
#   bash scripts/gpu_check.sh measure2  issues 22 + 23 on one warm machine: profile_host.py --gpu-time, ab_decode.py
#                                       (decode and training rows, same-run dense), profile_varlen.py,
#                                       bench_varlen.py (no tests: run `close` or `first` for those)
#   bash scripts/gpu_check.sh tune-dkdv benchmarks/tune_triton.py --kernels dkdv (issue 24: the dK/dV
#                                       kernel's block configs at D = 128, N = 131072), then the
#                                       per-kernel profile of the headline shape
#   bash scripts/gpu_check.sh gluon     issue 24: benchmarks/gluon_dilated_fwd.py --check --bench (the Gluon TMA + wgmma +
#                                       warp-specialised per-branch forward prototype against the float64 reference,
#                                       then its time per branch beside the library's Triton forward and cuDNN), then
#                                       Nsight Compute over cuDNN's dense fwd+bwd (ncu_kernels.py --dense-only --backend cudnn)
#   bash scripts/gpu_check.sh gluon-int issue 24: the Gluon forward inside the library: the CUDA suite (-n 4; $CUDA_TESTS, default
#                                       tests; $CUDA_TEST_TIMEOUT 400 s), `verify`,
#                                       then the headline bench (N = 131072, causal and not) with the Gluon forward on
#                                       and off (DILATED_ATTENTION_GLUON_FWD=0), same-run dense SDPA
#   bash scripts/gpu_check.sh gluon-lib-bwd issue 24: the library's Gluon backward: pytest -m cuda
#                                       tests/test_gluon_bwd.py tests/test_gluon_fwd.py, then the headline bench with
#                                       the Gluon backward (on by default since 2026-11-28; same-run dense SDPA), then benchmarks/gluon_floor.py
#                                       (small calls, Gluon forward vs Triton: the MIN_ROWS floor)
#   bash scripts/gpu_check.sh gluon-on issue 24, both Gluon kernels on: gluon_floor.py --profile (host time of a small
#                                       Gluon call), gluon_floor.py --bwd at $FLOOR_SIZES, then benchmarks/sweep.py
#                                       ($SWEEP_ROWS, $SWEEP_BUDGET s, results $SWEEP_NAME.{md,json,png})
#   bash scripts/gpu_check.sh gluon-final issue 24: the Gluon CUDA tests, then sweep rows $SWEEP_ROWS ($SWEEP_BUDGET s)
#   bash scripts/gpu_check.sh gluon-next issue 24, what the 2026-11-29 session wrote without device time: the Gluon
#                                       backward for short last segments (gluon_bwd.TAIL_SEGMENTS, on since they passed) and batch > 1
#                                       with them, forward and backward (gluon_fwd.TAIL_BATCHES, on): their CUDA
#                                       tests (with the backward's even and uneven ones), then fuzz.py --gluon --gluon-bwd-tail (5,000
#                                       cases, the generator now with w % r != 0 and N % w != 0)
#   bash scripts/gpu_check.sh gluon-next-bench  the two sweep rows TAIL_SEGMENTS would take, with and without
#                                       --gluon-bwd-tail, then gluon_ab.py on the d128 rows with 1024-row blocks
#   bash scripts/gpu_check.sh gluon-split issue 24: gluon_bwd.SPLIT_PHASES (written 2026-11-29 without device time):
#                                       its CUDA test (same bits as one phase, lower peak; the CPU tests compare both modes
#                                       with the float64 reference through the emulated kernels), then
#                                       sweep rows with and without --gluon-split-phases (fwd+bwd time, peak, mem ratio)
#   bash scripts/gpu_check.sh tail-batch issue 24: sweep row b4-24k-tail-gqa-causal (batch 4 with a short last segment)
#                                       as shipped (gluon_fwd.TAIL_BATCHES: each entry launched apart) and with
#                                       --gluon-even-only (the Triton kernels): TAIL_BATCHES' speed, never measured
#   bash scripts/gpu_check.sh split-ab  issue 24: benchmarks/split_ab.py over $SPLIT_ROWS (gluon_bwd.SPLIT_PHASES off / on,
#                                       interleaved in one process, $SPLIT_ROUNDS (5) rounds: does 1.25x peak instead
#                                       of 1.50x cost time? One run per arm in separate calls could not say, 2026-11-29),
#                                       then fuzz.py --gluon --gluon-split-phases ($FUZZ_SPLIT_EXAMPLES 5000, 2.5 min)
#   bash scripts/gpu_check.sh tune-8br  issue 24: benchmarks/tune_triton.py --row $TUNE_ROW (8br-paper-d64-fp16-causal,
#                                       the one sweep row under the floors: its short d64 causal blocks run the Triton
#                                       kernels) over the D 64 candidates, $TUNE_SECONDS (420) s of candidates
#   bash scripts/gpu_check.sh cuda-s27  the CUDA tests of tests/test_gluon_varlen.py (the library's Gluon varlen forward,
#                                       its switch forced on) and tests/test_gluon_bwd.py (SPLIT_PHASES on): not run since
#                                       they changed (2026-11-29); timeout $CUDA_TEST_TIMEOUT 540 s (44 varlen cases compile)
#   bash scripts/gpu_check.sh varlen-bwd issue 22 item 2b: the CUDA tests of tests/test_gluon_varlen.py (the Gluon varlen
#                                       forward and backward, both switches forced on; $CUDA_TEST_TIMEOUT 360 s) then
#                                       benchmarks/varlen_switch_ab.py --switch backward ($AB_TIMEOUT 200 s; $SWITCH_AB_ARGS,
#                                       e.g. "--cases issue-128k-16x128,gqa32x8-64k-mean4096 --rounds 3")
#   bash scripts/gpu_check.sh profile-varlen  benchmarks/profile_varlen.py --configs default, not causal then causal
#   bash scripts/gpu_check.sh s30      issue 22 item 2b, the host-descriptor varlen kernels (gluon_varlen.HOST_DESCRIPTORS): the
#                                       CUDA tests of tests/test_gluon_varlen.py ($CUDA_TEST_TIMEOUT 330 s), then
#                                       varlen_switch_ab.py --switch host-desc ($AB_TIMEOUT 200 s; $SWITCH_AB_ARGS)
#   bash scripts/gpu_check.sh s31      the CUDA tests of tests/test_gluon_varlen.py (the split launches of
#                                       gluon_varlen.HOST_DESCRIPTORS_UNCHECKED included), then bench_varlen.py with that switch on
#   bash scripts/gpu_check.sh fuzz-gluon-varlen  scripts/fuzz.py --gluon --varlen: the Gluon varlen kernels over random packed
#                                       batches against the float64 reference per document (not yet run)
#   bash scripts/gpu_check.sh s32a     the CUDA tests of s32 beside fuzz-gluon-varlen (cold cache; correctness only)
#   bash scripts/gpu_check.sh s32b     the fill-only A/B of s32, then bench_varlen.py --set FILL_UNCOVERED_ONLY=1
#   bash scripts/gpu_check.sh short-d64 issue 24: triton_launch.SHORT_D64's CUDA tests, then split_ab.py --switch
#                                       triton_launch.SHORT_D64 over short-block head-dim-64 rows (the 8br row)
#   bash scripts/gpu_check.sh s36a     benchmarks/pdl_race_probe.py in 3 concurrent processes, then the causal Gluon
#                                       vs_reference tests at -n 8 (2026-11-30: the suite's failures were CUDA OOM)
#   bash scripts/gpu_check.sh next-s35 gluon_fwd.PDL through the direct launcher's attribute: its CUDA tests, then the
#                                       end-to-end compiled rows twice (issue 23 5b)
#   bash scripts/gpu_check.sh s34a     gluon_fwd.PDL: its CUDA tests (same bits), then split_ab.py --switch gluon_fwd.PDL
#                                       on LongNet-base's attention calls (8K x 4, 16K x 2) and two sweep rows
#   bash scripts/gpu_check.sh next-5b  issue 23 5b: TMA_CACHE interleaved A/B at 16K x 2, then the compiled e2e rows
#   bash scripts/gpu_check.sh s33a     the compile tests, then profile_step.py at 16K x 2: idle broken down, host cProfile
#   bash scripts/gpu_check.sh s32c     the kernels-as-ops compile tests + the fill-only default's tests, then e2e compiled rows
#   bash scripts/gpu_check.sh s32      gluon_varlen.FILL_UNCOVERED_ONLY: CUDA tests with device offsets (its same-bits test too),
#                                       then varlen_switch_ab.py --switch fill-only (issue batch, 512-token mix)
#   bash scripts/gpu_check.sh s31c     the CUDA tests of test_gluon_varlen.py with device offsets, then varlen_switch_ab.py
#                                       --switch unchecked on 256-1024-token mixes (the gates under the split)
#   bash scripts/gpu_check.sh s31b     varlen_switch_ab.py --switch unchecked (issue batch), then bench_overhead.py with its
#                                       end-to-end rows (issue 23)
#   bash scripts/gpu_check.sh s30-gates the same CUDA tests, then varlen_switch_ab.py --switch backward and forward with both
#                                       mean-document gates lifted, on 256- and 512-token mixes
#   bash scripts/gpu_check.sh s29      bench_varlen.py, then varlen_switch_ab.py --switch both --min-mean-doc 0 over four batches
#                                       with a mean document of 512-4096 rows (where MIN_MEAN_DOC belongs)
#   bash scripts/gpu_check.sh s28      benchmarks/varlen_switch_ab.py (gluon_varlen.VARLEN_FORWARD on / off over six packed
#                                       batches; its column "Gluon launches" shows which the gates send to Gluon), timeout
#                                       $AB_TIMEOUT 300 (440 s with a cold cache on an H200), then the CUDA tests of
#                                       tests/test_gluon_bwd.py minus the node ids in runs/passed_bwd.txt ($CUDA_TEST_TIMEOUT 220)
#   bash scripts/gpu_check.sh varlen-proto issue 22 item 2b: benchmarks/gluon_varlen.py --check --bench (the Gluon kernels,
#                                       forward and backward, over packed documents, one launch per branch, descriptors made on the
#                                       device; a barrier or descriptor mistake hangs, hence its own timeout $PROTO_TIMEOUT
#                                       420 s). $PROTO_ARGS replaces "--check --bench": 16 check cases took 300 s (compiling)
#                                       on an H200 2026-11-29; next: PROTO_ARGS="--check --dtypes float16 --bench --ceiling --profile"
#   bash scripts/gpu_check.sh ceiling   issue 24: benchmarks/block_ceiling.py --per-branch over $CEIL_ROWS (each row's
#                                       blocks on dense SDPA: the most a segment-then-dilate kernel can reach, beside
#                                       the library and dense SDPA on the whole row)
#   bash scripts/gpu_check.sh gluon-ab   issue 24: benchmarks/gluon_ab.py over $AB_ROWS (Gluon or Triton per direction,
#                                       same process: which kernels a call should take; D64_MIN_BLOCK's data)
#   bash scripts/gpu_check.sh gluon-bwd issue 24: benchmarks/gluon_dilated_bwd.py --check --quick, then $GLUON_BWD_ARGS (--bench) (the Gluon dK/dV and dQ
#                                       prototype against the float64 reference, then per branch beside the library's
#                                       Triton backward and cuDNN)
#   bash scripts/gpu_check.sh merge-cache FILES_AT   (here, not on the device) runs/triton_cache.tgz.part*
#                                       and a call's new entries (FILES_AT/triton_cache.tgz.part*) into
#                                       new runs/ parts, the oldest entries dropped until they fit
# Logs and results files go to $OUT. Uses the image's python3 with PYTHONPATH=src (no install).
# Triton's compile cache travels between calls: a call restores runs/triton_cache.tgz.part*
# (carry those paths) and leaves the entries it compiled itself (not the restored ones) in
# $OUT/triton_cache.tgz.partNN (15 MiB parts, at most CACHE_PARTS_MAX=4 of them, and only if
# the results leave room under the 8 files a call returns; SAVE_CACHE=0: none); `merge-cache`
# folds them into runs/ here, so that the next machine starts warm (kernels whose source
# changed compile again). 2026-11-27: a whole cache had grown past 4 parts and stopped coming
# back, and every call recompiled the edited kernels (60-150 s of its time). 2026-11-29 (thirty-first
# session): a call's new entries came to 8 parts and were dropped again. The archives now hold what a
# cache hit loads (Triton 3.6 compiler.CompiledKernel: the metadata json and the cubin, with the group
# file and the launchers' .so) and leave out the intermediate IR (.llir, .ptx, .ttgir, .ttir,
# .source): 477 MB of entries went from 43 to 10.5 MB compressed. A tool that reads ck.asm["ptx"] or
# ["ttgir"] (benchmarks/probe_warp_specialize.py, gluon_dilated_bwd.py --sass) on a restored entry
# would miss them: give it TRITON_CACHE_DIR of its own, or CACHE_KEEP_IR=1 to archive them.
set -uo pipefail
if [ "${CACHE_KEEP_IR:-0}" = 1 ]; then
  CACHE_TAR_EXCLUDES=()
else
  CACHE_TAR_EXCLUDES=(--exclude='*.llir' --exclude='*.ptx' --exclude='*.ttgir' --exclude='*.ttir' --exclude='*.source')
fi
if [ "${1:-}" = merge-cache ]; then
  new=${2:?usage: bash scripts/gpu_check.sh merge-cache FILES_AT}
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  mkdir -p "$tmp/c"
  for src in runs "$new"; do  # the call's entries last: they replace older copies
    if ls "$src"/triton_cache.tgz.part* >/dev/null 2>&1; then cat "$src"/triton_cache.tgz.part* | tar -xz -C "$tmp/c"; fi
  done
  # 3 parts by default: a call carries at most 64 MiB (tracked files + carried paths); with ~7 MiB
  # tracked, 4 parts (60 MiB) stopped fitting on 2026-11-27 (thirteenth session)
  max=${CACHE_MAX_BYTES:-$(( ${CACHE_PARTS_MAX:-3} * 15 * 1024 * 1024 ))}
  while :; do
    tar -cz "${CACHE_TAR_EXCLUDES[@]}" -C "$tmp/c" . > "$tmp/all.tgz"
    size=$(stat -c %s "$tmp/all.tgz"); n=$(find "$tmp/c" -mindepth 1 -maxdepth 1 | wc -l)
    [ "$size" -le "$max" ] && break
    drop=$(( n / 10 + 1 ))  # the oldest tenth of the entries (modification time)
    find "$tmp/c" -mindepth 1 -maxdepth 1 -printf '%T@ %p\n' | sort -n | head -n "$drop" | cut -d' ' -f2- \
      | while read -r d; do rm -rf "$d"; done
    echo "merge-cache: $size bytes > $max: dropped the $drop oldest of $n entries"
  done
  rm -f runs/triton_cache.tgz.part*
  mkdir -p runs; split -b 15m -d -a 2 "$tmp/all.tgz" runs/triton_cache.tgz.part
  echo "merge-cache: $n entries, $size bytes in $(ls runs/triton_cache.tgz.part* | wc -l) parts under runs/"
  exit 0
fi
export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-out}; mkdir -p "$OUT"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/da_triton_cache}
mkdir -p "$TRITON_CACHE_DIR"
if ls runs/triton_cache.tgz.part* >/dev/null 2>&1; then
  cat runs/triton_cache.tgz.part* | tar -xz -C "$TRITON_CACHE_DIR" && echo "triton cache restored: $(ls "$TRITON_CACHE_DIR" | wc -l) entries"
fi
CACHE_MARK=$(mktemp); sleep 1  # entries modified after this: compiled by this call
save_cache() {  # split in 15 MiB parts (a device call returns files of <= 16 MiB, 8 at most)
  [ "${SAVE_CACHE:-1}" = 1 ] || return 0
  local fresh; fresh=$(cd "$TRITON_CACHE_DIR" && find . -mindepth 1 -maxdepth 1 -newer "$CACHE_MARK")
  [ -n "$fresh" ] || { echo "triton cache: nothing compiled by this call"; return 0; }
  # (restored entries keep their archived times: tar sets them after extracting)
  (cd "$TRITON_CACHE_DIR" && printf '%s\n' $fresh | tar -cz "${CACHE_TAR_EXCLUDES[@]}" -T -) 2>/dev/null | split -b 15m -d -a 2 - "$OUT/triton_cache.tgz.part"
  local n; n=$(ls "$OUT"/triton_cache.tgz.part* 2>/dev/null | wc -l)
  if [ "$n" -gt "${CACHE_PARTS_MAX:-4}" ]; then rm -f "$OUT"/triton_cache.tgz.part*; echo "triton cache too big to return ($n parts)"; return 0; fi
  # a call returns at most 8 files: the results first (2026-11-26 a varlen call lost varlen.md
  # to the cache's 4 parts)
  local all; all=$(find "$OUT" -type f | wc -l)
  if [ "$all" -gt 8 ]; then rm -f "$OUT"/triton_cache.tgz.part*; echo "triton cache not returned: $((all - n)) result files + $n parts > 8"; fi
}
trap save_cache EXIT
python3 -c "import torch, triton, platform; print('torch', torch.__version__, 'triton', triton.__version__, 'python', platform.python_version(), torch.cuda.get_device_name())" | tee "$OUT/env.txt"
# scripts/fuzz.py --gluon --varlen on CUDA into $OUT/fuzz_gluon_varlen.txt ($1: default workers); modes
# fuzz-gluon-varlen and s32a
fuzz_gluon_varlen() {
  timeout "${FUZZ_GLUON_TIMEOUT:-450}" env TRITON_CACHE_DIR=/tmp/da_fuzz_gluon_varlen_cache OMP_NUM_THREADS=1 \
    python3 scripts/fuzz.py --gluon --varlen --impl triton --device cuda --workers "${FUZZ_GLUON_WORKERS:-$1}" \
    --pool "${FUZZ_GLUON_POOL:-2}" --examples "${FUZZ_GLUON_VARLEN_EXAMPLES:-2000}" \
    --minutes "${FUZZ_GLUON_VARLEN_MINUTES:-6}" --every 100 > "$OUT/fuzz_gluon_varlen.txt" 2>&1
  echo "fuzz rc=$?" >> "$OUT/fuzz_gluon_varlen.txt"
}

case "${1:-tests}" in
  first)
    timeout "${CUDA_TEST_TIMEOUT:-330}" python3 -m pytest -q -m cuda tests -n 4 -p no:cacheprovider -rfE --durations=10 > "$OUT/cuda_tests.txt" 2>&1
    echo "pytest rc=$?" >> "$OUT/cuda_tests.txt"
    DILATED_ATTENTION_DIRECT_LAUNCH=1 timeout "${DIRECT_TEST_TIMEOUT:-180}" python3 -m pytest -q -m cuda -n 4 -p no:cacheprovider -rfE \
      tests/test_decode_plan.py tests/test_decode.py tests/test_decode_edges.py tests/test_overhead.py \
      tests/test_triton.py tests/test_triton_determinism.py tests/test_triton_varlen.py > "$OUT/cuda_tests_direct.txt" 2>&1
    echo "pytest rc=$?" >> "$OUT/cuda_tests_direct.txt"
    tail -25 "$OUT/cuda_tests.txt"; tail -15 "$OUT/cuda_tests_direct.txt"
    ;;
  subset)
    for v in unset 1 true; do
      if [ "$v" = unset ]; then e="env -u TRITON_INTERPRET"; else e="env TRITON_INTERPRET=$v"; fi
      $e python3 -c "from dilated_attention.kernels import triton_import, select; print('TRITON_INTERPRET=$v: triton_import.INTERPRET =', triton_import.INTERPRET, ' select.interpreting() =', select.interpreting())"
    done 2>&1 | tee "$OUT/interpret_probe.txt"
    timeout "${VERIFY_TIMEOUT:-200}" python3 -m dilated_attention verify > "$OUT/verify.txt" 2>&1; echo "verify rc=$?" >> "$OUT/verify.txt"
    # shellcheck disable=SC2086
    timeout "${SUBSET_TIMEOUT:-240}" python3 -m pytest -v -m cuda -n 4 -p no:cacheprovider -rfE --durations=8 \
      ${SUBSET_TESTS:-tests/test_frontdoor.py tests/test_decode.py tests/test_decode_edges.py tests/test_decode_host.py tests/test_decode_plan.py tests/test_decode_fast.py tests/test_varlen.py tests/test_triton_varlen.py tests/test_hf.py tests/test_train_plan.py tests/test_empty_inputs.py tests/test_triton_memory.py tests/test_ring.py} > "$OUT/cuda_tests.txt" 2>&1
    echo "pytest rc=$? ($(grep -c ' PASSED ' "$OUT/cuda_tests.txt") PASSED, $(grep -c ' FAILED ' "$OUT/cuda_tests.txt") FAILED lines)" >> "$OUT/cuda_tests.txt"
    tail -24 "$OUT/verify.txt"; grep -E " FAILED |passed|failed|error|rc=" "$OUT/cuda_tests.txt" | tail -20
    ;;
  ncu)
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    echo "ncu: ${NCU:-not found}"; [ -n "$NCU" ] && "$NCU" --version | tail -1
    secs="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis"
    cases="no"; [ "${NCU_CAUSAL:-0}" = 1 ] && cases="no yes"
    for c in $cases; do
      flag=""; [ "$c" = yes ] && flag=--causal
      # shellcheck disable=SC2086
      timeout "${NCU_TIMEOUT:-240}" "$NCU" --profile-from-start off --clock-control none --kernel-name regex:'dilated_|flash' \
        $secs python3 benchmarks/ncu_kernels.py $flag > "$OUT/ncu_causal_$c.txt" 2>&1
      echo "ncu (causal=$c) rc=$?" >> "$OUT/ncu_causal_$c.txt"
      grep -E "^  [a-zA-Z_].*\(|Duration|Registers Per Thread|Achieved Occupancy|Compute \(SM\) Throughput|rc=" "$OUT/ncu_causal_$c.txt" | head -80
    done
    timeout "${VERIFY_TIMEOUT:-150}" python3 -m dilated_attention verify --dtype bf16 > "$OUT/verify.txt" 2>&1; echo "verify rc=$?" >> "$OUT/verify.txt"
    tail -4 "$OUT/verify.txt"
    ;;
  gluon)
    timeout "${GLUON_TIMEOUT:-330}" python3 benchmarks/gluon_dilated_fwd.py --check --bench --out "$OUT/gluon_fwd.md" > "$OUT/gluon_fwd.txt" 2>&1
    echo "gluon rc=$?" >> "$OUT/gluon_fwd.txt"
    if [ "${GLUON_NCU:-1}" = 1 ]; then
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      secs="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section ComputeWorkloadAnalysis"
      # shellcheck disable=SC2086
      timeout "${NCU_TIMEOUT:-150}" "$NCU" --profile-from-start off --clock-control none $secs \
        python3 benchmarks/ncu_kernels.py --dense-only --backend cudnn > "$OUT/ncu_cudnn.txt" 2>&1
      echo "ncu cudnn rc=$?" >> "$OUT/ncu_cudnn.txt"
      grep -E "^  [a-zA-Z_].*\(|Duration|Registers Per Thread|Achieved Occupancy|Compute \(SM\) Throughput|rc=" "$OUT/ncu_cudnn.txt" | head -40
    fi
    grep -E "PASS|FAIL|rc=|^\|" "$OUT/gluon_fwd.txt" | tail -70
    ;;
  gluon-int)
    # shellcheck disable=SC2086
    timeout "${CUDA_TEST_TIMEOUT:-400}" python3 -m pytest -v -m cuda ${CUDA_TESTS:-tests} -n 4 -p no:cacheprovider -rfE --durations=8 > "$OUT/cuda_tests.txt" 2>&1
    echo "pytest rc=$? ($(grep -c ' PASSED ' "$OUT/cuda_tests.txt") PASSED, $(grep -c ' FAILED ' "$OUT/cuda_tests.txt") FAILED lines)" >> "$OUT/cuda_tests.txt"
    timeout "${VERIFY_TIMEOUT:-120}" python3 -m dilated_attention verify --dtype bf16 > "$OUT/verify.txt" 2>&1; echo "verify rc=$?" >> "$OUT/verify.txt"
    timeout 100 python3 -m dilated_attention bench --seqlens 131072 --causal false true --markdown "$OUT/bench_gluon_on.md" > "$OUT/bench_on.txt" 2>&1
    echo "bench on rc=$?" >> "$OUT/bench_on.txt"
    DILATED_ATTENTION_GLUON_FWD=0 timeout 100 python3 -m dilated_attention bench --seqlens 131072 --causal false true --markdown "$OUT/bench_gluon_off.md" >> "$OUT/bench_on.txt" 2>&1
    echo "bench off rc=$?" >> "$OUT/bench_on.txt"
    grep -E "FAILED|Error|rc=" "$OUT/cuda_tests.txt" | tail -25; tail -4 "$OUT/verify.txt"; grep -E "^\||rc=" "$OUT/bench_on.txt" | tail -20
    ;;
  gluon-lib-bwd)
    # the library's Gluon backward (switch off by default): its CUDA tests, then the headline bench with it on
    timeout "${CUDA_TEST_TIMEOUT:-260}" python3 -m pytest -v -m cuda tests/test_gluon_bwd.py tests/test_gluon_fwd.py -n 4 -p no:cacheprovider -rfE > "$OUT/cuda_tests.txt" 2>&1
    echo "pytest rc=$? ($(grep -c ' PASSED ' "$OUT/cuda_tests.txt") PASSED, $(grep -c ' FAILED ' "$OUT/cuda_tests.txt") FAILED lines)" >> "$OUT/cuda_tests.txt"
    timeout "${BENCH_TIMEOUT:-150}" python3 -m dilated_attention bench --seqlens 131072 --causal false true --markdown "$OUT/bench_gluon_bwd_on.md" > "$OUT/bench.txt" 2>&1
    echo "bench (Gluon fwd + bwd) rc=$?" >> "$OUT/bench.txt"
    timeout "${FLOOR_TIMEOUT:-120}" python3 benchmarks/gluon_floor.py --out "$OUT/gluon_floor.md" > "$OUT/floor.txt" 2>&1
    echo "gluon_floor rc=$?" >> "$OUT/floor.txt"
    grep -E "FAILED|Error|rc=" "$OUT/cuda_tests.txt" | tail -25; grep -E "^\||rc=" "$OUT/bench.txt" | tail -10; grep -E "^\||rc=" "$OUT/floor.txt"
    ;;
  gluon-on)
    # issue 24 with both Gluon kernels on by default: where a small Gluon call's host time goes (cProfile,
    # gluon and triton arms, fwd+bwd), the floor A/B with the Gluon backward at $FLOOR_SIZES, then the
    # sweep (rows $SWEEP_ROWS, all by default; no row starts after $SWEEP_BUDGET s)
    timeout "${PROFILE_TIMEOUT:-90}" python3 benchmarks/gluon_floor.py --profile 30 --bwd > "$OUT/floor_profile.txt" 2>&1
    echo "profile rc=$?" >> "$OUT/floor_profile.txt"
    timeout "${FLOOR_TIMEOUT:-150}" python3 benchmarks/gluon_floor.py --bwd --rounds 2 --sizes "${FLOOR_SIZES:-2,3,4}" --out "$OUT/gluon_floor_bwd.md" > "$OUT/floor.txt" 2>&1
    echo "gluon_floor --bwd rc=$?" >> "$OUT/floor.txt"
    timeout "${SWEEP_TIMEOUT:-300}" python3 benchmarks/sweep.py --out "$OUT" --name "${SWEEP_NAME:-sweep_h200_gluon}" --budget-s "${SWEEP_BUDGET:-240}" --no-peers ${SWEEP_ROWS:+--rows "$SWEEP_ROWS"} > "$OUT/sweep.txt" 2>&1
    echo "sweep rc=$?" >> "$OUT/sweep.txt"
    grep -E "^## |tottime|rc=" "$OUT/floor_profile.txt" | head -20; grep -E "^\||rc=" "$OUT/floor.txt"; tail -30 "$OUT/sweep.txt"
    ;;
  gluon-final)
    # issue 24: the Gluon kernels' CUDA tests on the final code, then sweep rows ($SWEEP_ROWS, $SWEEP_BUDGET s)
    timeout "${CUDA_TEST_TIMEOUT:-240}" python3 -m pytest -v -m cuda tests/test_gluon_bwd.py tests/test_gluon_fwd.py -n 4 -p no:cacheprovider -rfE > "$OUT/cuda_tests.txt" 2>&1
    echo "pytest rc=$? ($(grep -c ' PASSED ' "$OUT/cuda_tests.txt") PASSED, $(grep -c ' FAILED ' "$OUT/cuda_tests.txt") FAILED lines)" >> "$OUT/cuda_tests.txt"
    timeout "${SWEEP_TIMEOUT:-320}" python3 benchmarks/sweep.py --out "$OUT" --name "${SWEEP_NAME:-sweep_h200_gluon_part2}" --budget-s "${SWEEP_BUDGET:-250}" --no-peers ${SWEEP_ROWS:+--rows "$SWEEP_ROWS"} > "$OUT/sweep.txt" 2>&1
    echo "sweep rc=$?" >> "$OUT/sweep.txt"
    grep -E "FAILED|Error|rc=|passed|failed" "$OUT/cuda_tests.txt" | tail -12; tail -30 "$OUT/sweep.txt"
    ;;
  gluon-next)
    # a cold machine compiles for minutes: -n 4 (-n 8 ran the float64 reference out of GPU memory
    # in 3 of 80 tests, 2026-11-29), the tail tests and the even and uneven ones
    timeout "${CUDA_TEST_TIMEOUT:-300}" python3 -m pytest -v -m cuda tests/test_gluon_bwd.py tests/test_gluon_fwd.py -k "tail or backward_vs_reference" -n 4 -p no:cacheprovider -rfE > "$OUT/cuda_tests.txt" 2>&1
    echo "pytest rc=$? ($(grep -c ' PASSED ' "$OUT/cuda_tests.txt") PASSED, $(grep -c ' FAILED ' "$OUT/cuda_tests.txt") FAILED lines)" >> "$OUT/cuda_tests.txt"
    timeout "${FUZZ_GLUON_TIMEOUT:-250}" env TRITON_CACHE_DIR=/tmp/da_fuzz_gluon_cache OMP_NUM_THREADS=1 \
      python3 scripts/fuzz.py --gluon --gluon-bwd-tail --impl triton --device cuda --workers 12 --pool 2 \
      --examples 5000 --minutes 3 --every 200 > "$OUT/fuzz_gluon.txt" 2>&1
    echo "fuzz rc=$?" >> "$OUT/fuzz_gluon.txt"
    grep -E "FAILED|rc=" "$OUT/cuda_tests.txt" | tail -8; grep -E "MISMATCH|ERROR" "$OUT/fuzz_gluon.txt" | head -5; tail -6 "$OUT/fuzz_gluon.txt"
    ;;
  gluon-next-bench)
    for arm in off on; do
      timeout 90 python3 benchmarks/sweep.py --out "$OUT" --name "sweep_tail_$arm" --budget-s 70 --no-peers --impls triton \
        $([ $arm = on ] && echo --gluon-bwd-tail) --rows n100000-causal,w%r-r64-n65536 > "$OUT/sweep_tail_$arm.txt" 2>&1
      echo "sweep $arm rc=$?" >> "$OUT/sweep_tail_$arm.txt"
    done
    timeout "${AB_TIMEOUT:-300}" python3 benchmarks/gluon_ab.py --budget-s 220 --rows b2-64k-7br-r64,8br-wN-32x8,paper-r6-12-causal-fp16 --out "$OUT/gluon_ab.md" > "$OUT/gluon_ab.txt" 2>&1
    echo "gluon_ab rc=$?" >> "$OUT/gluon_ab.txt"
    tail -n 5 "$OUT"/sweep_tail_*.txt; grep -E "^\||rc=" "$OUT/gluon_ab.txt" | tail -6
    ;;
  gluon-split)
    timeout "${CUDA_TEST_TIMEOUT:-300}" python3 -m pytest -v -m cuda tests/test_gluon_bwd.py -k "split_phases" -n 4 -p no:cacheprovider -rfE > "$OUT/cuda_tests.txt" 2>&1
    echo "pytest rc=$? ($(grep -c ' PASSED ' "$OUT/cuda_tests.txt") PASSED, $(grep -c ' FAILED ' "$OUT/cuda_tests.txt") FAILED lines)" >> "$OUT/cuda_tests.txt"
    for arm in off on; do
      timeout 150 python3 benchmarks/sweep.py --out "$OUT" --name "sweep_split_$arm" --budget-s 120 --no-peers --impls triton \
        $([ $arm = on ] && echo --gluon-split-phases) --rows "${SPLIT_ROWS:-headline,headline-causal,gqa32x8-causal,n100000-causal}" > "$OUT/sweep_split_$arm.txt" 2>&1
      echo "sweep $arm rc=$?" >> "$OUT/sweep_split_$arm.txt"
    done
    grep -E "FAILED|rc=" "$OUT/cuda_tests.txt" | tail -8; grep -h "| triton |\|rc=" "$OUT"/sweep_split_*.txt "$OUT"/sweep_split_*.md | tail -12
    ;;
  tail-batch)
    for arm in shipped even-only; do
      timeout 200 python3 benchmarks/sweep.py --out "$OUT" --name "sweep_tailbatch_$arm" --budget-s 150 --no-peers --impls triton \
        $([ $arm = even-only ] && echo --gluon-even-only) --rows b4-24k-tail-gqa-causal > "$OUT/sweep_tailbatch_$arm.txt" 2>&1
      echo "sweep $arm rc=$?" >> "$OUT/sweep_tailbatch_$arm.txt"
    done
    grep -h "| triton \|| dense \|rc=" "$OUT"/sweep_tailbatch_*.md "$OUT"/sweep_tailbatch_*.txt | tail -8
    ;;
  split-ab)
    timeout "${SPLIT_TIMEOUT:-400}" python3 benchmarks/split_ab.py --rounds "${SPLIT_ROUNDS:-5}" \
      --rows "${SPLIT_ROWS:-headline,headline-causal,gqa32x8-causal,n100000-causal}" --out "$OUT/split_ab.md" > "$OUT/split_ab.txt" 2>&1
    echo "split_ab rc=$?" >> "$OUT/split_ab.txt"
    timeout "${FUZZ_SPLIT_TIMEOUT:-200}" env TRITON_CACHE_DIR=/tmp/da_fuzz_gluon_cache OMP_NUM_THREADS=1 \
      python3 scripts/fuzz.py --gluon --gluon-split-phases --impl triton --device cuda --workers 12 --pool 2 \
      --examples "${FUZZ_SPLIT_EXAMPLES:-5000}" --minutes 2.5 --every 500 > "$OUT/fuzz_split.txt" 2>&1
    echo "fuzz rc=$?" >> "$OUT/fuzz_split.txt"
    grep -E "^\||rc=" "$OUT/split_ab.txt" | tail -8; grep -E "MISMATCH|ERROR" "$OUT/fuzz_split.txt" | head -5; tail -3 "$OUT/fuzz_split.txt"
    ;;
  tune-8br)
    timeout "${TUNE_TIMEOUT:-540}" python3 benchmarks/tune_triton.py --row "${TUNE_ROW:-8br-paper-d64-fp16-causal}" \
      --max-seconds "${TUNE_SECONDS:-420}" --out "$OUT/tune_8br.md" > "$OUT/tune_8br.txt" 2>&1
    echo "tune_triton rc=$?" >> "$OUT/tune_8br.txt"
    grep -E "^\||best per kernel|rc=" "$OUT/tune_8br.txt" | tail -40
    ;;
  cuda-s27)
    # the CUDA tests that the session of 2026-11-29 (twenty-seventh) could not run: the Gluon
    # backward's with SPLIT_PHASES on (its launch counts now per kernel) and the library's Gluon
    # varlen forward (tests/test_gluon_varlen.py: gluon_varlen.VARLEN_FORWARD forced on)
    timeout "${CUDA_TEST_TIMEOUT:-540}" python3 -m pytest -v -m cuda tests/test_gluon_varlen.py tests/test_gluon_bwd.py \
      -n 4 -p no:cacheprovider -rfE > "$OUT/cuda_tests.txt" 2>&1
    echo "pytest rc=$?" >> "$OUT/cuda_tests.txt"
    grep -E "^(FAILED|ERROR)|passed|failed|rc=" "$OUT/cuda_tests.txt" | tail -20
    ;;
  varlen-bwd)
    # issue 22 item 2b, the Gluon varlen backward (gluon_varlen.VARLEN_BACKWARD, on since these passed on an H200, 2026-11-29): the CUDA tests
    # of tests/test_gluon_varlen.py (50 since 2026-11-29: both switches on over 44 configurations, a Triton forward into the Gluon backward, the no-sync test; forward and backward against the float64
    # reference per document, Gluon calls counted, bits repeatable), then benchmarks/varlen_switch_ab.py --switch backward
    timeout "${CUDA_TEST_TIMEOUT:-360}" python3 -m pytest -v -m cuda tests/test_gluon_varlen.py -n 4 -p no:cacheprovider \
      -rfE > "$OUT/cuda_tests.txt" 2>&1
    echo "pytest rc=$?" >> "$OUT/cuda_tests.txt"
    timeout "${AB_TIMEOUT:-200}" python3 benchmarks/varlen_switch_ab.py --switch backward ${SWITCH_AB_ARGS:-} \
      --out "$OUT/varlen_switch_ab_bwd.md" > "$OUT/varlen_switch_ab_bwd.txt" 2>&1
    echo "varlen_switch_ab rc=$?" >> "$OUT/varlen_switch_ab_bwd.txt"
    grep -E "^(FAILED|ERROR)|passed|failed|rc=" "$OUT/cuda_tests.txt" | tail -12
    grep -E "^\|" "$OUT/varlen_switch_ab_bwd.md"; grep -E "rc=" "$OUT/varlen_switch_ab_bwd.txt"
    ;;
  s30)
    # the session of 2026-11-29 (thirtieth): the Gluon varlen kernels over host descriptors (no descriptor made per program):
    # their CUDA tests (both switches on; the random cases' totals send some branches to the device-descriptor kernels), then
    # their A/B against the device-made descriptors, the mean-document gates lifted
    timeout "${CUDA_TEST_TIMEOUT:-330}" python3 -m pytest -v -m cuda tests/test_gluon_varlen.py -n 4 -p no:cacheprovider \
      -rfE > "$OUT/cuda_tests.txt" 2>&1
    echo "pytest rc=$?" >> "$OUT/cuda_tests.txt"
    timeout "${AB_TIMEOUT:-200}" python3 benchmarks/varlen_switch_ab.py --switch host-desc --min-mean-doc 0 \
      --min-mean-doc-backward 0 ${SWITCH_AB_ARGS:---cases issue-128k-16x128,short-docs-64k-mean512 --rounds 2} \
      --out "$OUT/varlen_switch_ab_hd.md" > "$OUT/varlen_switch_ab_hd.txt" 2>&1
    echo "varlen_switch_ab rc=$?" >> "$OUT/varlen_switch_ab_hd.txt"
    grep -E "^(FAILED|ERROR)|passed|failed|rc=" "$OUT/cuda_tests.txt" | tail -12
    grep -E "^\|" "$OUT/varlen_switch_ab_hd.md"; grep -E "rc=" "$OUT/varlen_switch_ab_hd.txt"
    ;;
  s31)
    # next session (written 2026-11-29, thirtieth): the split launches of gluon_varlen.HOST_DESCRIPTORS_UNCHECKED (off, CPU-tested):
    # the CUDA tests of tests/test_gluon_varlen.py ($CUDA_TEST_TIMEOUT 360 s; the rows-past-the-documents test runs the split),
    # then bench_varlen.py with the switch on ($VARLEN_TIMEOUT 260 s): its row (a'), unchecked device offsets
    timeout "${CUDA_TEST_TIMEOUT:-360}" python3 -m pytest -v -m cuda tests/test_gluon_varlen.py -n 4 -p no:cacheprovider \
      -rfE > "$OUT/cuda_tests.txt" 2>&1
    echo "pytest rc=$?" >> "$OUT/cuda_tests.txt"
    timeout "${VARLEN_TIMEOUT:-260}" python3 -c "import runpy, sys; from dilated_attention.kernels import gluon_varlen as g; \
g.HOST_DESCRIPTORS_UNCHECKED = True; sys.argv = ['bench_varlen.py', '--out', '$OUT/varlen.md']; \
runpy.run_path('benchmarks/bench_varlen.py', run_name='__main__')" > "$OUT/varlen.txt" 2>&1
    echo "bench_varlen (HOST_DESCRIPTORS_UNCHECKED on) rc=$?" >> "$OUT/varlen.txt"
    grep -E "^(FAILED|ERROR)|passed|failed|rc=" "$OUT/cuda_tests.txt" | tail -12
    grep -E "^\|" "$OUT/varlen.md" | head -20; grep -E "^- causal|rc=" "$OUT/varlen.txt"
    ;;
  s31c|s32)
    # s31c (thirty-first session, last call, HOST_DESCRIPTORS_UNCHECKED on by default): the CUDA tests of
    # tests/test_gluon_varlen.py that hand over device offsets (random cases alternate host / device offsets, rows past the
    # documents, no-sync; $CUDA_TEST_TIMEOUT 230 s), then varlen_switch_ab.py --switch unchecked on 256- to 1024-token mixes
    # ($AB_TIMEOUT 230 s): on = the split under the host gates (Gluon), off = device descriptors under the DEVICE_DESC_ gates.
    # s32 (next session; written after that call): gluon_varlen.FILL_UNCOVERED_ONLY (off, CPU-tested): the same CUDA tests plus
    # its same-bits test, then varlen_switch_ab.py --switch fill-only on the issue batch and a 512-token mix (same bits
    # expected: max abs on-off 0). If both pass and it wins, turn it on and run bench_varlen (row (a')) next.
    if [ "$1" = s32 ]; then
      k_expr="random_cases or rows_past or synchronise or fill_uncovered"; sw=fill-only; ab="$OUT/varlen_switch_ab_fill_only"
      cases=${AB_CASES:-issue-128k-16x128,short-docs-64k-mean512}; rounds=${AB_ROUNDS:-3}
    else
      k_expr="random_cases or rows_past or synchronise"; sw=unchecked; ab="$OUT/varlen_switch_ab_unchecked_small"
      cases=${AB_CASES:-mean256-64k,short-docs-64k-mean512,mean1024-64k}; rounds=${AB_ROUNDS:-2}
    fi
    timeout "${CUDA_TEST_TIMEOUT:-230}" python3 -m pytest -v -m cuda tests/test_gluon_varlen.py -n 4 -p no:cacheprovider \
      -k "$k_expr" -rfE > "$OUT/cuda_tests.txt" 2>&1
    echo "pytest rc=$?" >> "$OUT/cuda_tests.txt"
    timeout "${AB_TIMEOUT:-230}" python3 benchmarks/varlen_switch_ab.py --switch "$sw" --cases "$cases" --rounds "$rounds" \
      --out "$ab.md" > "$ab.txt" 2>&1
    echo "varlen_switch_ab rc=$?" >> "$ab.txt"
    grep -E "^(FAILED|ERROR)|passed|failed|rc=" "$OUT/cuda_tests.txt" | tail -12
    grep -E "^\||rc=" "$ab.txt" | tail -10
    ;;
  s32a)
    # thirty-second session, first call (cold Triton cache): the CUDA tests of tests/test_gluon_varlen.py with device offsets
    # and the FILL_UNCOVERED_ONLY tests (-n 4, $CUDA_TEST_TIMEOUT 400 s) beside the first GPU fuzz of the Gluon varlen
    # kernels (fuzz-gluon-varlen with $FUZZ_GLUON_WORKERS 10; odd-seeded device-offset cases run FILL_UNCOVERED_ONLY on):
    # both correctness only, so they share the GPU and the 16 cores
    timeout "${CUDA_TEST_TIMEOUT:-400}" python3 -m pytest -v -m cuda tests/test_gluon_varlen.py -n 4 -p no:cacheprovider \
      -k "random_cases or rows_past or synchronise or fill_uncovered" -rfE > "$OUT/cuda_tests.txt" 2>&1 &
    tests_pid=$!
    fuzz_gluon_varlen 10
    wait "$tests_pid"; echo "pytest rc=$?" >> "$OUT/cuda_tests.txt"
    grep -E "^(FAILED|ERROR)|passed|failed|rc=" "$OUT/cuda_tests.txt" | tail -12
    grep -E "MISMATCH|ERROR|FAILED|cannot run" "$OUT/fuzz_gluon_varlen.txt" | head -8
    tail -8 "$OUT/fuzz_gluon_varlen.txt"
    ;;
  s32b)
    # thirty-second session, second call: varlen_switch_ab.py --switch fill-only (device offsets in both arms; same bits
    # expected) on the issue batch and a 512-token mix ($AB_TIMEOUT 250 s), then bench_varlen.py with FILL_UNCOVERED_ONLY
    # on (row (a'); $VARLEN_TIMEOUT 300 s)
    timeout "${AB_TIMEOUT:-250}" python3 benchmarks/varlen_switch_ab.py --switch fill-only \
      --cases "${AB_CASES:-issue-128k-16x128,short-docs-64k-mean512}" --rounds "${AB_ROUNDS:-3}" \
      --out "$OUT/varlen_switch_ab_fill_only.md" > "$OUT/varlen_switch_ab_fill_only.txt" 2>&1
    echo "varlen_switch_ab rc=$?" >> "$OUT/varlen_switch_ab_fill_only.txt"
    timeout "${VARLEN_TIMEOUT:-300}" python3 benchmarks/bench_varlen.py --set FILL_UNCOVERED_ONLY=1 --out "$OUT/varlen.md" \
      > "$OUT/varlen.txt" 2>&1
    echo "bench_varlen rc=$?" >> "$OUT/varlen.txt"
    grep -E "^\||rc=" "$OUT/varlen_switch_ab_fill_only.txt" | tail -10
    grep -E "^\||^- causal|rc=" "$OUT/varlen.txt" | tail -16
    ;;
  s32c)
    # thirty-second session, last call: the models' kernels as custom ops in compiled graphs (tests/test_compile_kernels.py,
    # the compile tests of the rotary / LayerNorm / model files) beside the FILL_UNCOVERED_ONLY default's CUDA tests
    # (-n 4, $CUDA_TEST_TIMEOUT 240 s), then issue 23's end-to-end rows compiled only ($OVERHEAD_TIMEOUT 280 s)
    timeout "${CUDA_TEST_TIMEOUT:-240}" python3 -m pytest -v -n 4 -p no:cacheprovider -rfE \
      tests/test_compile_kernels.py tests/test_compile_model.py tests/test_rotary_fused.py tests/test_triton_layernorm.py \
      tests/test_gluon_varlen.py -k "compile or fill_uncovered or synchronise or rows_past" > "$OUT/cuda_tests.txt" 2>&1
    echo "pytest rc=$?" >> "$OUT/cuda_tests.txt"
    timeout "${OVERHEAD_TIMEOUT:-280}" python3 benchmarks/bench_overhead.py --only-e2e --e2e-modes "${E2E_MODES:-compile}" \
      --e2e-lengths "${E2E_LENGTHS:-8192,16384}" --out "$OUT/overhead_e2e.md" > "$OUT/overhead_e2e.txt" 2>&1
    echo "bench_overhead rc=$?" >> "$OUT/overhead_e2e.txt"
    grep -E "^(FAILED|ERROR)|passed|failed|rc=" "$OUT/cuda_tests.txt" | tail -12
    grep -E "^\||rc=" "$OUT/overhead_e2e.txt" | tail -8
    ;;
  short-d64)
    # written in the thirty-sixth session for the next one (issue 24 item 2, the one sweep row under its floors on the
    # H200, 8br-paper-d64-fp16-causal): triton_launch.SHORT_D64 (64-row query tiles for head dim <= 64 where every block
    # is shorter than gluon_fwd.D64_MIN_BLOCK; off). Its CUDA tests (against the fp32 torch path; the short configs ran)
    # with the tune tests beside them ($CUDA_TEST_TIMEOUT 200 s), then benchmarks/split_ab.py --switch
    # triton_launch.SHORT_D64 over the sweep row and three A/B rows of that kind ($AB_TIMEOUT 300 s). If it wins: set
    # SHORT_D64 = True, then `python3 benchmarks/sweep.py --rows 8br-paper-d64-fp16-causal --no-peers --out $OUT
    # --name ...` for the row's ratios to same-run dense
    timeout "${CUDA_TEST_TIMEOUT:-200}" python3 -m pytest -v -n 2 -p no:cacheprovider -rfE --tb=short -m cuda \
      tests/test_triton.py -k "short_d64 or vs_torch_path" > "$OUT/cuda_tests.txt" 2>&1
    echo "pytest rc=$?" >> "$OUT/cuda_tests.txt"
    timeout "${AB_TIMEOUT:-300}" python3 benchmarks/split_ab.py --switch triton_launch.SHORT_D64 --direction both \
      --rounds "${AB_ROUNDS:-5}" --rows "${AB_ROWS:-8br-paper-d64-fp16-causal,8br-paper-d64-fp16,b8-16k-d64-w512-causal,b8-16k-d64-w512,b4-32k-gqa-d64-w1k-causal}" \
      --out "$OUT/short_d64_ab.md" > "$OUT/short_d64_ab.txt" 2>&1
    echo "split_ab rc=$?" >> "$OUT/short_d64_ab.txt"
    grep -E "^(FAILED|ERROR)|passed|failed|rc=" "$OUT/cuda_tests.txt" | tail -10
    grep -E "^\||rc=" "$OUT/short_d64_ab.md" "$OUT/short_d64_ab.txt" | tail -16
    ;;
  s36a)
    # thirty-sixth session: the whole CUDA suite (8 workers) failed 12 causal Gluon-vs-reference tests in runs on a few
    # workers. benchmarks/pdl_race_probe.py in 3 concurrent processes (contention as in the suite: does a result change
    # between repetitions with dependent launches, and not without?), then the causal vs_reference tests with -n 8 and
    # their failure messages ($PROBE_TIMEOUT 240 s, $CUDA_TEST_TIMEOUT 240 s)
    for i in 1 2 3; do
      PYTHONPATH=src:tests timeout "${PROBE_TIMEOUT:-240}" python3 benchmarks/pdl_race_probe.py --reps "${PROBE_REPS:-12}" \
        --seed "$i" > "$OUT/probe_$i.txt" 2>&1 &
    done
    wait
    timeout "${CUDA_TEST_TIMEOUT:-240}" python3 -m pytest -q -n 8 -p no:cacheprovider -rfE --tb=short -m cuda \
      tests/test_gluon_fwd.py tests/test_gluon_bwd.py -k "vs_reference and True" > "$OUT/cuda_tests.txt" 2>&1
    echo "pytest rc=$?" >> "$OUT/cuda_tests.txt"
    cat "$OUT"/probe_*.txt | grep -E "^\| [a-z]|distinct result|Error|rror:" | sort | uniq | head -60
    grep -E "^(FAILED|ERROR)|assert|passed|failed|rc=" "$OUT/cuda_tests.txt" | tail -30
    ;;
  sp-x2)
    # written in the thirty-fifth session (needs nvidia-h200-x2): sequence parallelism on NCCL, which only gloo has run
    # since the cross-rank descriptors travel padded with a kind (2026-11-30) and train frees its group: the SP
    # benchmark's correctness check and one weak-scaling row, then the 2-GPU training recipe against one GPU
    export NCCL_NVLS_ENABLE=0
    timeout "${SP_TIMEOUT:-300}" python3 -m torch.distributed.run --standalone --nproc_per_node=2 \
      benchmarks/bench_sequence_parallel.py --out "$OUT/sp_h200x2.md" > "$OUT/sp_bench.txt" 2>&1
    echo "bench_sequence_parallel rc=$?" >> "$OUT/sp_bench.txt"
    timeout "${RECIPE_TIMEOUT:-240}" python3 benchmarks/train_sp_recipe.py --out "$OUT/train_sp_h200x2.md" \
      > "$OUT/train_sp.txt" 2>&1
    echo "train_sp_recipe rc=$?" >> "$OUT/train_sp.txt"
    grep -hE "rc=|PASS|FAIL|terminate|Error" "$OUT/sp_bench.txt" "$OUT/train_sp.txt" | tail -12
    ;;
  next-s35)
    # written in the thirty-fourth session for the next one: gluon_fwd.PDL's launches now pass the attribute to the direct
    # launcher of the one binary (the session measured it with binaries compiled with Triton's launch_pdl): its CUDA tests
    # first (same bits three times over; each kernel's launcher was given the attribute; -n 2, $CUDA_TEST_TIMEOUT 240 s),
    # then the end-to-end compiled rows twice, to firm up issue 23 5b at 16K x 2 ($OVERHEAD_TIMEOUT 200 s each)
    timeout "${CUDA_TEST_TIMEOUT:-240}" python3 -m pytest -v -n 2 -p no:cacheprovider -rfE -m cuda \
      tests/test_gluon_bwd.py tests/test_gluon_fwd.py -k "dependent or direct_launches" > "$OUT/cuda_tests.txt" 2>&1
    echo "pytest rc=$?" >> "$OUT/cuda_tests.txt"
    for i in 1 2; do
      timeout "${OVERHEAD_TIMEOUT:-200}" python3 benchmarks/bench_overhead.py --only-e2e --e2e-modes compile \
        --e2e-lengths 8192,16384 --out "$OUT/overhead_e2e_$i.md" > "$OUT/overhead_e2e_$i.txt" 2>&1
      echo "bench_overhead rc=$?" >> "$OUT/overhead_e2e_$i.txt"
    done
    grep -E "^(FAILED|ERROR)|passed|failed|rc=" "$OUT/cuda_tests.txt" | tail -8
    grep -hE "^\| e2e|rc=" "$OUT"/overhead_e2e_*.txt
    ;;
  s34a)
    # thirty-fourth session, first call: gluon_fwd.PDL (programmatic dependent launches between a call's Gluon launches).
    # Its CUDA tests (same bits on / off, three times; the dependent launches happened) with the direct-launch and split-
    # phase tests beside it (the backward's rows are now built once for both phases; -n 2, $CUDA_TEST_TIMEOUT 300 s),
    # then benchmarks/split_ab.py --switch gluon_fwd.PDL on LongNet-base's attention calls and two sweep rows
    # ($AB_TIMEOUT 200 s)
    timeout "${CUDA_TEST_TIMEOUT:-300}" python3 -m pytest -v -n 2 -p no:cacheprovider -rfE -m cuda \
      tests/test_gluon_bwd.py -k "dependent or direct_launches or split_phases" > "$OUT/cuda_tests.txt" 2>&1
    echo "pytest rc=$?" >> "$OUT/cuda_tests.txt"
    timeout "${AB_TIMEOUT:-200}" python3 benchmarks/split_ab.py --switch gluon_fwd.PDL --direction both \
      --rounds "${AB_ROUNDS:-5}" --rows "${AB_ROWS:-base-b2-16k-d64-causal,base-b4-8k-d64-causal,headline-causal,b8-16k-4br-causal}" \
      --out "$OUT/pdl_ab.md" > "$OUT/pdl_ab.txt" 2>&1
    echo "split_ab rc=$?" >> "$OUT/pdl_ab.txt"
    grep -E "^(FAILED|ERROR)|passed|failed|rc=" "$OUT/cuda_tests.txt" | tail -14
    grep -E "^\||rc=" "$OUT/pdl_ab.md" "$OUT/pdl_ab.txt" | tail -12
    ;;
  s34b)
    # thirty-fourth session, second call (gluon_fwd.PDL now on by default): the CUDA tests of test_gluon_bwd.py (every
    # Gluon forward / backward against the reference, with dependent launches; -n 4, $CUDA_TEST_TIMEOUT 300 s), then
    # profile_step.py at 16K x 2, the compiled model with PDL on and off, interleaved ($PROFILE_TIMEOUT 200 s)
    timeout "${CUDA_TEST_TIMEOUT:-300}" python3 -m pytest -q -n 4 -p no:cacheprovider -rfE -m cuda \
      tests/test_gluon_bwd.py > "$OUT/cuda_tests.txt" 2>&1
    echo "pytest rc=$?" >> "$OUT/cuda_tests.txt"
    timeout "${PROFILE_TIMEOUT:-200}" python3 benchmarks/profile_step.py --shapes "${PROFILE_SHAPES:-16384}" --no-plain --no-dense \
      --compiled-ab gluon_fwd.PDL=0 --ab-rounds "${AB_ROUNDS:-4}" --out "$OUT/profile_step_pdl_ab.md" > "$OUT/profile_step_pdl_ab.txt" 2>&1
    echo "profile_step rc=$?" >> "$OUT/profile_step_pdl_ab.txt"
    grep -E "^(FAILED|ERROR)|passed|failed|rc=" "$OUT/cuda_tests.txt" | tail -14
    grep -A10 "^| round" "$OUT/profile_step_pdl_ab.md"; grep -A5 "^| tokens" "$OUT/profile_step_pdl_ab.md"; tail -2 "$OUT/profile_step_pdl_ab.txt"
    ;;
  s34c)
    # thirty-fourth session, third call: issue 23 5b's end-to-end compiled rows with gluon_fwd.PDL on ($OVERHEAD_TIMEOUT
    # 330 s), then the PDL CUDA tests the first call's timeout cut ($CUDA_TEST_TIMEOUT 150 s)
    timeout "${OVERHEAD_TIMEOUT:-330}" python3 benchmarks/bench_overhead.py --only-e2e --e2e-modes compile \
      --e2e-lengths 8192,16384 --out "$OUT/overhead_e2e.md" > "$OUT/overhead_e2e.txt" 2>&1
    echo "bench_overhead rc=$?" >> "$OUT/overhead_e2e.txt"
    timeout "${CUDA_TEST_TIMEOUT:-150}" python3 -m pytest -v -n 2 -p no:cacheprovider -rfE -m cuda \
      tests/test_gluon_bwd.py tests/test_gluon_fwd.py -k "dependent or direct_launches" > "$OUT/cuda_tests.txt" 2>&1
    echo "pytest rc=$?" >> "$OUT/cuda_tests.txt"
    grep -E "^\||rc=" "$OUT/overhead_e2e.txt" | tail -8
    grep -E "^(FAILED|ERROR)|passed|failed|rc=" "$OUT/cuda_tests.txt" | tail -8
    ;;
  s34d)
    # thirty-fourth session, last call: the Gluon forward's and the Gluon varlen kernels' CUDA tests with gluon_fwd.PDL on
    # (-n 4, $CUDA_TEST_TIMEOUT 250 s), then a short GPU fuzz of the Gluon kernels against the float64 reference
    # ($FUZZ_GLUON_MINUTES 1.5, timeout 180 s)
    timeout "${CUDA_TEST_TIMEOUT:-250}" python3 -m pytest -q -n 4 -p no:cacheprovider -rfE -m cuda \
      tests/test_gluon_fwd.py tests/test_gluon_varlen.py > "$OUT/cuda_tests.txt" 2>&1
    echo "pytest rc=$?" >> "$OUT/cuda_tests.txt"
    timeout "${FUZZ_GLUON_TIMEOUT:-180}" env OMP_NUM_THREADS=1 \
      python3 scripts/fuzz.py --gluon --impl triton --device cuda --workers "${FUZZ_GLUON_WORKERS:-12}" \
      --pool "${FUZZ_GLUON_POOL:-2}" --examples "${FUZZ_GLUON_EXAMPLES:-5000}" --minutes "${FUZZ_GLUON_MINUTES:-1.5}" \
      --every 50 > "$OUT/fuzz_gluon.txt" 2>&1
    echo "fuzz rc=$?" >> "$OUT/fuzz_gluon.txt"
    grep -E "^(FAILED|ERROR)|passed|failed|rc=" "$OUT/cuda_tests.txt" | tail -10
    grep -E "MISMATCH|ERROR|FAILED|cannot run" "$OUT/fuzz_gluon.txt" | head -8; tail -5 "$OUT/fuzz_gluon.txt"
    ;;
  s33a)
    # thirty-third session, first call: the compile tests of the models' kernels as custom ops (their call sites moved
    # after the last GPU call; no -m cuda: the rotary / LayerNorm compile tests are not cuda-marked; $CUDA_TEST_TIMEOUT
    # 240 s), then profile_step.py at 16K x 2 with the idle broken down, the dense model compiled too, and cProfile of
    # the compiled and eager steps' host Python ($PROFILE_TIMEOUT 330 s)
    timeout "${CUDA_TEST_TIMEOUT:-240}" python3 -m pytest -v -n 4 -p no:cacheprovider -rfE \
      tests/test_compile_kernels.py tests/test_compile_model.py tests/test_rotary_fused.py tests/test_triton_layernorm.py \
      -k "compile or constant" > "$OUT/cuda_tests.txt" 2>&1
    echo "pytest rc=$?" >> "$OUT/cuda_tests.txt"
    timeout "${PROFILE_TIMEOUT:-330}" python3 benchmarks/profile_step.py --shapes "${PROFILE_SHAPES:-16384}" --no-plain \
      --dense-compile --cprofile "${CPROFILE_ARMS:-compiled,eager}" --out "$OUT/profile_step.md" > "$OUT/profile_step.txt" 2>&1
    echo "profile_step rc=$?" >> "$OUT/profile_step.txt"
    grep -E "^(FAILED|ERROR)|passed|failed|rc=" "$OUT/cuda_tests.txt" | tail -12
    grep -A8 "^| tokens" "$OUT/profile_step.md"; grep -A7 "^| arm | span" "$OUT/profile_step.md"; tail -3 "$OUT/profile_step.txt"
    ;;
  s33b)
    # thirty-third session, second call: the Gluon launches' light descriptors (gluon_fwd.LIGHT_DESCRIPTORS, on) and
    # their direct launches (gluon_fwd.DIRECT_LAUNCH, turned on here with --set): the direct-launch CUDA tests (same bits,
    # -n 2, $CUDA_TEST_TIMEOUT 200 s), then profile_step.py at 8K x 4 and 16K x 2 with the compiled model run a second
    # time with both off ($PROFILE_TIMEOUT 400 s)
    timeout "${CUDA_TEST_TIMEOUT:-200}" python3 -m pytest -v -n 2 -p no:cacheprovider -rfE -m cuda \
      tests/test_gluon_bwd.py tests/test_gluon_fwd.py -k "direct or light" > "$OUT/cuda_tests.txt" 2>&1
    echo "pytest rc=$?" >> "$OUT/cuda_tests.txt"
    timeout "${PROFILE_TIMEOUT:-400}" python3 benchmarks/profile_step.py --shapes "${PROFILE_SHAPES:-8192,16384}" --no-plain \
      --dense-compile --set gluon_fwd.DIRECT_LAUNCH=1 --compiled-ab gluon_fwd.DIRECT_LAUNCH=0,gluon_fwd.LIGHT_DESCRIPTORS=0 \
      --cprofile "${CPROFILE_ARMS:-compiled}" --out "$OUT/profile_step.md" > "$OUT/profile_step.txt" 2>&1
    echo "profile_step rc=$?" >> "$OUT/profile_step.txt"
    grep -E "^(FAILED|ERROR)|passed|failed|rc=" "$OUT/cuda_tests.txt" | tail -12
    grep -A12 "^| tokens" "$OUT/profile_step.md"; grep -A6 "^| arm | forward" "$OUT/profile_step.md"; tail -3 "$OUT/profile_step.txt"
    ;;
  s33c)
    # thirty-third session, third call: the CUDA tests that the session's host-side changes touch (Gluon launches direct
    # with light descriptors by default; the rotary kernel through DirectKernel; LayerNorm backward trims; -n 4,
    # $CUDA_TEST_TIMEOUT 210 s), then issue 23's end-to-end rows, compiled and eager, with return_logits=False
    # ($OVERHEAD_TIMEOUT 360 s)
    timeout "${CUDA_TEST_TIMEOUT:-210}" python3 -m pytest -v -n 4 -p no:cacheprovider -rfE tests/test_gluon_fwd.py \
      tests/test_gluon_bwd.py tests/test_rotary_fused.py tests/test_triton_layernorm.py tests/test_gluon_varlen.py -k \
      "forward_vs_reference or backward_vs_reference or direct or light or cuda_realistic or varlen_forward_random or rows_past or synchronise" \
      > "$OUT/cuda_tests.txt" 2>&1
    echo "pytest rc=$?" >> "$OUT/cuda_tests.txt"
    timeout "${OVERHEAD_TIMEOUT:-360}" python3 benchmarks/bench_overhead.py --only-e2e --e2e-modes "${E2E_MODES:-compile,eager}" \
      --e2e-lengths "${E2E_LENGTHS:-8192,16384}" --out "$OUT/overhead_e2e.md" > "$OUT/overhead_e2e.txt" 2>&1
    echo "bench_overhead rc=$?" >> "$OUT/overhead_e2e.txt"
    grep -E "^(FAILED|ERROR)|passed|failed|rc=" "$OUT/cuda_tests.txt" | tail -12
    grep -E "^\||rc=" "$OUT/overhead_e2e.txt" | tail -10
    ;;
  s33d)
    # thirty-third session, last call: the CUDA tests s33c did not reach (the Gluon backward against the reference with
    # direct launches on by default, the varlen CUDA tests, the rotary and LayerNorm ones, the kernels-as-ops compile
    # tests; -n 4, $CUDA_TEST_TIMEOUT 330 s) beside a GPU fuzz of the Gluon varlen kernels (their host-descriptor
    # launches are direct now; $FUZZ_GLUON_VARLEN_EXAMPLES 600, 8 workers)
    ( timeout "${CUDA_TEST_TIMEOUT:-330}" python3 -m pytest -v -n 4 -p no:cacheprovider -rfE tests/test_gluon_bwd.py \
        tests/test_rotary_fused.py tests/test_triton_layernorm.py tests/test_gluon_varlen.py -m cuda \
        -k "backward_vs_reference or direct or cuda_ or random_cases or rows_past or synchronise or fill_uncovered"
      echo "pytest (cuda-marked) rc=$?"
      timeout 150 python3 -m pytest -v -n 4 -p no:cacheprovider -rfE tests/test_compile_kernels.py tests/test_compile_model.py \
        -k "compile or constant"
      echo "pytest (compile) rc=$?" ) > "$OUT/cuda_tests.txt" 2>&1 &
    tests_pid=$!
    FUZZ_GLUON_VARLEN_EXAMPLES=${FUZZ_GLUON_VARLEN_EXAMPLES:-600} FUZZ_GLUON_VARLEN_MINUTES=4 FUZZ_GLUON_TIMEOUT=320 \
      fuzz_gluon_varlen 8
    wait "$tests_pid"; echo "pytest rc=$?" >> "$OUT/cuda_tests.txt"
    grep -E "^(FAILED|ERROR)|passed|failed|rc=" "$OUT/cuda_tests.txt" | tail -12
    grep -E "MISMATCH|ERROR|FAILED|cannot run" "$OUT/fuzz_gluon_varlen.txt" | head -8
    tail -6 "$OUT/fuzz_gluon_varlen.txt"
    ;;
  s33e)
    # thirty-third session, short last call: gluon_fwd.TMA_CACHE (CUtensorMaps encoded once per address; off): its
    # same-bits test ($CUDA_TEST_TIMEOUT 90 s), then profile_step.py at 16K x 2, the compiled model with the cache on and
    # off, same process ($PROFILE_TIMEOUT 170 s)
    timeout "${CUDA_TEST_TIMEOUT:-90}" python3 -m pytest -v -n 4 -p no:cacheprovider -rfE -m cuda tests/test_gluon_bwd.py \
      -k "direct_launches" > "$OUT/cuda_tests.txt" 2>&1
    echo "pytest rc=$?" >> "$OUT/cuda_tests.txt"
    timeout "${PROFILE_TIMEOUT:-170}" python3 benchmarks/profile_step.py --shapes 16384 --no-plain --no-dense \
      --set gluon_fwd.TMA_CACHE=1 --compiled-ab gluon_fwd.TMA_CACHE=0 --out "$OUT/profile_step.md" > "$OUT/profile_step.txt" 2>&1
    echo "profile_step rc=$?" >> "$OUT/profile_step.txt"
    grep -E "^(FAILED|ERROR)|passed|failed|rc=" "$OUT/cuda_tests.txt" | tail -8
    grep -A5 "^| tokens" "$OUT/profile_step.md"; grep -A4 "^| arm | forward" "$OUT/profile_step.md"; tail -2 "$OUT/profile_step.txt"
    ;;
  next-5b)
    # written in the thirty-third session for the next one (issue 23 item 5b): gluon_fwd.TMA_CACHE interleaved against
    # off at 16K x 2 (6 rounds of 10 steps each way, same compiled model; $PROFILE_TIMEOUT 240 s), then the end-to-end
    # compiled rows again at both shapes, to firm up 8K x 4's 1.204x ($OVERHEAD_TIMEOUT 300 s)
    timeout "${PROFILE_TIMEOUT:-240}" python3 benchmarks/profile_step.py --shapes 16384 --no-plain --no-dense \
      --set gluon_fwd.TMA_CACHE=1 --compiled-ab gluon_fwd.TMA_CACHE=0 --ab-rounds "${AB_ROUNDS:-6}" \
      --out "$OUT/profile_step_tma_ab.md" > "$OUT/profile_step_tma_ab.txt" 2>&1
    echo "profile_step rc=$?" >> "$OUT/profile_step_tma_ab.txt"
    timeout "${OVERHEAD_TIMEOUT:-300}" python3 benchmarks/bench_overhead.py --only-e2e --e2e-modes compile \
      --e2e-lengths 8192,16384 --out "$OUT/overhead_e2e.md" > "$OUT/overhead_e2e.txt" 2>&1
    echo "bench_overhead rc=$?" >> "$OUT/overhead_e2e.txt"
    grep -A10 "^| round" "$OUT/profile_step_tma_ab.md"; tail -2 "$OUT/profile_step_tma_ab.txt"
    grep -E "^\||rc=" "$OUT/overhead_e2e.txt" | tail -6
    ;;
  s31b)
    # thirty-first session, second call: varlen_switch_ab.py --switch unchecked on the issue batch (device offsets in both arms:
    # HOST_DESCRIPTORS_UNCHECKED's split launches on / off; $AB_TIMEOUT 240 s), then issue 23's bench_overhead.py with its
    # end-to-end rows ($OVERHEAD_TIMEOUT 320 s; never yet run with them on an H200)
    timeout "${AB_TIMEOUT:-240}" python3 benchmarks/varlen_switch_ab.py --switch unchecked --cases issue-128k-16x128 \
      --rounds "${AB_ROUNDS:-3}" --out "$OUT/varlen_switch_ab_unchecked.md" > "$OUT/varlen_switch_ab_unchecked.txt" 2>&1
    echo "varlen_switch_ab rc=$?" >> "$OUT/varlen_switch_ab_unchecked.txt"
    timeout "${OVERHEAD_TIMEOUT:-320}" python3 benchmarks/bench_overhead.py --out "$OUT/overhead.md" > "$OUT/overhead.txt" 2>&1
    echo "bench_overhead rc=$?" >> "$OUT/overhead.txt"
    grep -E "^\||rc=" "$OUT/varlen_switch_ab_unchecked.md" "$OUT/varlen_switch_ab_unchecked.txt" | tail -8
    grep -E "^\||rc=" "$OUT/overhead.md" "$OUT/overhead.txt" | tail -40
    ;;
  s30-gates)
    # thirtieth session, second part: the CUDA tests of tests/test_gluon_varlen.py again ($CUDA_TEST_TIMEOUT 330 s), then the
    # mean-document gates over host descriptors: the backward's switch with MIN_MEAN_DOC_BACKWARD lifted, the forward's with
    # MIN_MEAN_DOC lifted, on 256- and 512-token mixes ($AB_TIMEOUT 120 s each)
    timeout "${CUDA_TEST_TIMEOUT:-330}" python3 -m pytest -v -m cuda tests/test_gluon_varlen.py -n 4 -p no:cacheprovider \
      -rfE > "$OUT/cuda_tests.txt" 2>&1
    echo "pytest rc=$?" >> "$OUT/cuda_tests.txt"
    for sw in backward forward; do
      timeout "${AB_TIMEOUT:-120}" python3 benchmarks/varlen_switch_ab.py --switch $sw --min-mean-doc-backward 0 \
        --min-mean-doc 0 --cases short-docs-64k-mean512,mean256-64k --rounds 2 \
        --out "$OUT/varlen_switch_ab_$sw.md" > "$OUT/varlen_switch_ab_$sw.txt" 2>&1
      echo "varlen_switch_ab rc=$?" >> "$OUT/varlen_switch_ab_$sw.txt"
    done
    grep -E "^(FAILED|ERROR)|passed|failed|rc=" "$OUT/cuda_tests.txt" | tail -12
    for sw in backward forward; do grep -E "^\|" "$OUT/varlen_switch_ab_$sw.md"; grep -E "rc=" "$OUT/varlen_switch_ab_$sw.txt"; done
    ;;
  s29)
    # the session of 2026-11-29 (twenty-ninth), both Gluon varlen switches on by default: bench_varlen.py (issue 22 item 2b,
    # $VARLEN_TIMEOUT 260), then benchmarks/varlen_switch_ab.py --switch both with the mean-document gate lifted
    # ($SWITCH_AB_ARGS; $AB_TIMEOUT 220): where between 512 and 4096 rows the gate gluon_varlen.MIN_MEAN_DOC belongs
    timeout "${VARLEN_TIMEOUT:-260}" python3 benchmarks/bench_varlen.py --out "$OUT/varlen.md" > "$OUT/varlen.txt" 2>&1
    echo "bench_varlen rc=$?" >> "$OUT/varlen.txt"
    timeout "${AB_TIMEOUT:-220}" python3 benchmarks/varlen_switch_ab.py --switch both --min-mean-doc 0 \
      ${SWITCH_AB_ARGS:---cases mean1024-64k,mean2048-64k,gqa32x8-64k-mean4096,short-docs-64k-mean512 --rounds 2} \
      --out "$OUT/varlen_switch_ab_both.md" > "$OUT/varlen_switch_ab_both.txt" 2>&1
    echo "varlen_switch_ab rc=$?" >> "$OUT/varlen_switch_ab_both.txt"
    grep -E "^\|" "$OUT/varlen.md" | head -20; grep -E "^- causal|rc=" "$OUT/varlen.txt" "$OUT/varlen.md"
    grep -E "^\|" "$OUT/varlen_switch_ab_both.md"; grep -E "rc=" "$OUT/varlen_switch_ab_both.txt"
    ;;
  profile-varlen)
    # issue 22 item 2b: where the packed step (both Gluon varlen switches on) loses to one sequence, per launch,
    # not causal and causal (benchmarks/profile_varlen.py --configs default; $PROFILE_TIMEOUT 170 s each)
    for c in no yes; do
      timeout "${PROFILE_TIMEOUT:-170}" python3 benchmarks/profile_varlen.py --configs default --causal $c \
        --out "$OUT/profile_varlen_causal_$c.md" > "$OUT/profile_varlen_causal_$c.txt" 2>&1
      echo "profile_varlen rc=$?" >> "$OUT/profile_varlen_causal_$c.txt"
      grep -E "^- total|^\| default|rc=" "$OUT/profile_varlen_causal_$c.txt" | head -12
    done
    ;;
  s28)
    # the session of 2026-11-29 (twenty-eighth): gluon_varlen.VARLEN_FORWARD on / off over six packed
    # batches (benchmarks/varlen_switch_ab.py), then the CUDA tests of tests/test_gluon_bwd.py that
    # cuda-s27 did not reach in its 540 s (those it passed: runs/passed_bwd.txt, deselected)
    timeout "${AB_TIMEOUT:-300}" python3 benchmarks/varlen_switch_ab.py ${SWITCH_AB_ARGS:-} --out "$OUT/varlen_switch_ab.md" \
      > "$OUT/varlen_switch_ab.txt" 2>&1
    echo "varlen_switch_ab rc=$?" >> "$OUT/varlen_switch_ab.txt"
    timeout "${CUDA_TEST_TIMEOUT:-220}" python3 -c '
import os, sys, pytest
f = "runs/passed_bwd.txt"  # node ids to skip, one per line (absent: every CUDA test of the file)
done = [x.strip() for x in open(f) if x.strip()] if os.path.exists(f) else []
sys.exit(pytest.main(["-v", "-m", "cuda", "tests/test_gluon_bwd.py", "-n", "4", "-p", "no:cacheprovider", "-rfE",
                      *["--deselect=" + x for x in done]]))' > "$OUT/cuda_tests.txt" 2>&1
    echo "pytest rc=$?" >> "$OUT/cuda_tests.txt"
    grep -E "^\|" "$OUT/varlen_switch_ab.md"; grep -E "rc=" "$OUT/varlen_switch_ab.txt"
    grep -E "^(FAILED|ERROR)|passed|failed|deselected|rc=" "$OUT/cuda_tests.txt" | tail -12
    ;;
  varlen-proto)
    timeout "${PROTO_TIMEOUT:-420}" python3 benchmarks/gluon_varlen.py ${PROTO_ARGS:---check --bench} --out "$OUT/gluon_varlen.md" > "$OUT/gluon_varlen.txt" 2>&1
    echo "gluon_varlen rc=$?" >> "$OUT/gluon_varlen.txt"
    grep -E "^\||rc=|Error" "$OUT/gluon_varlen.txt" | tail -30
    ;;
  ceiling)
    timeout "${CEIL_TIMEOUT:-400}" python3 benchmarks/block_ceiling.py --per-branch --budget-s "${CEIL_BUDGET:-300}" \
      --rows "${CEIL_ROWS:-8br-paper-d64-fp16-causal,paper-r6-12-causal-fp16,b8-16k-mqa-d64-w8k,headline-causal,headline}" \
      --out "$OUT/block_ceiling.md" > "$OUT/block_ceiling.txt" 2>&1
    echo "block_ceiling rc=$?" >> "$OUT/block_ceiling.txt"
    grep -E "^\| .* \| fwd|rc=|sum of branches" "$OUT/block_ceiling.txt" | tail -24
    ;;
  gluon-ab)
    # 2026-11-29: the rows of results/gluon_ab_h200_2026-11-29.md, cold ~60 s a row (compiles)
    timeout "${AB_TIMEOUT:-470}" python3 benchmarks/gluon_ab.py --budget-s "${AB_BUDGET:-400}" --rows "${AB_ROWS:-8br-paper-d64-fp16-causal,b4-32k-r3-12-d64-fp16,b2-128k-16x8-d64-fp16,b8-16k-mqa-d64-w8k,512k-mqa-d64-causal,headline-causal,paper-r6-12-causal-fp16}" --out "$OUT/gluon_ab.md" > "$OUT/gluon_ab.txt" 2>&1
    echo "gluon_ab rc=$?" >> "$OUT/gluon_ab.txt"
    grep -E "^\||rc=" "$OUT/gluon_ab.txt" | tail -14
    ;;
  gluon-bwd)
    # a barrier mistake hangs: the quick check (12 cases) first, under its own timeout
    timeout "${QUICK_TIMEOUT:-150}" python3 benchmarks/gluon_dilated_bwd.py --check --quick --out "$OUT/gluon_bwd_quick.md" > "$OUT/gluon_bwd.txt" 2>&1
    echo "gluon-bwd quick check rc=$?" >> "$OUT/gluon_bwd.txt"
    timeout "${GLUON_TIMEOUT:-330}" python3 benchmarks/gluon_dilated_bwd.py ${GLUON_BWD_ARGS:---bench} --out "$OUT/gluon_bwd.md" >> "$OUT/gluon_bwd.txt" 2>&1
    echo "gluon-bwd ${GLUON_BWD_ARGS:---bench} rc=$?" >> "$OUT/gluon_bwd.txt"
    grep -E "FAIL|rc=|^\|" "$OUT/gluon_bwd.txt" | grep -v "^| PASS" | tail -40; echo "PASS lines: $(grep -c '^| PASS' "$OUT/gluon_bwd.txt")"
    ;;
  measure)
    timeout "${VERIFY_TIMEOUT:-200}" python3 -m dilated_attention verify > "$OUT/verify.txt" 2>&1; echo "verify rc=$?" >> "$OUT/verify.txt"
    timeout 100 python3 -m dilated_attention bench --seqlens 131072 --causal false true --markdown "$OUT/bench_131072.md" > "$OUT/bench_131072.txt" 2>&1
    timeout "${AB_TIMEOUT:-180}" python3 benchmarks/ab_decode.py --out "$OUT/ab_decode.md" > "$OUT/ab_decode.txt" 2>&1
    echo "ab_decode rc=$?" >> "$OUT/ab_decode.txt"
    DILATED_ATTENTION_DIRECT_LAUNCH=1 timeout 60 python3 benchmarks/profile_host.py --calls 200 --top 30 > "$OUT/profile_host_direct.txt" 2>&1
    tail -14 "$OUT/verify.txt"; tail -8 "$OUT/bench_131072.txt"; grep -E "^\||plans with launchers|rc=" "$OUT/ab_decode.txt" | tail -30
    ;;
  close)
    # -v: a suite cut by its timeout still names each test's result (2026-11-27: a cut -q run
    # showed 5 F's and no names); on a cold Triton cache the suite needs more than 330 s
    timeout "${CUDA_TEST_TIMEOUT:-330}" python3 -m pytest -v -m cuda tests -n 4 -p no:cacheprovider -rfE --durations=8 > "$OUT/cuda_tests.txt" 2>&1
    echo "pytest rc=$? ($(grep -c ' PASSED ' "$OUT/cuda_tests.txt") PASSED, $(grep -c ' FAILED ' "$OUT/cuda_tests.txt") FAILED lines)" >> "$OUT/cuda_tests.txt"
    timeout "${AB_TIMEOUT:-150}" python3 benchmarks/ab_decode.py --out "$OUT/ab_decode.md" > "$OUT/ab_decode.txt" 2>&1
    echo "ab_decode rc=$?" >> "$OUT/ab_decode.txt"
    timeout 70 python3 benchmarks/bench_overhead.py --no-e2e --out "$OUT/overhead.md" > "$OUT/overhead.txt" 2>&1
    echo "overhead rc=$?" >> "$OUT/overhead.txt"
    grep -E " FAILED |passed|failed|error|rc=" "$OUT/cuda_tests.txt" | tail -14; grep -E "^\\||rc=" "$OUT/ab_decode.txt" | tail -16; grep -E "^\\||rc=" "$OUT/overhead.txt"
    ;;
  suite)
    # the whole CUDA suite alone (a cold Triton cache compiles for minutes: 2026-11-27's `close`
    # was cut at 49% by 330 s), -v so that every result is named even if cut. Keep $WORKERS <= 4:
    # with 8 (2026-11-30) the float64 references of the batch-2 causal Gluon cases (1.8-3 GiB each)
    # ran 8 processes out of the H200's 140 GiB: 12 tests failed with CUDA out of memory, all of
    # which passed at -n 4. The suite takes longer than one call (560 s reached ~95% with 8
    # workers): split it by file over two calls
    timeout "${CUDA_TEST_TIMEOUT:-540}" python3 -m pytest -v -m cuda tests -n "${WORKERS:-4}" -p no:cacheprovider -rfE --durations=15 > "$OUT/cuda_tests.txt" 2>&1
    echo "pytest rc=$? ($(grep -c ' PASSED ' "$OUT/cuda_tests.txt") PASSED, $(grep -c ' FAILED ' "$OUT/cuda_tests.txt") FAILED lines)" >> "$OUT/cuda_tests.txt"
    grep -E " FAILED |passed|failed|error|rc=" "$OUT/cuda_tests.txt" | tail -30
    ;;
  mem)
    timeout "${MEM_TIMEOUT:-400}" python3 benchmarks/mem_account.py --device cuda --n 2097152 --fresh --causal both --out "$OUT/mem2m.md" > "$OUT/mem2m.txt" 2>&1
    echo "mem_account rc=$?" >> "$OUT/mem2m.txt"; tail -30 "$OUT/mem2m.txt"
    ;;
  tests)
    timeout 150 python3 -m dilated_attention verify 2>&1 | tee "$OUT/verify.txt" | tail -30
    timeout "${CUDA_TEST_TIMEOUT:-330}" python3 -m pytest -v -m cuda tests -n 4 -p no:cacheprovider -rfE --durations=15 > "$OUT/cuda_tests.txt" 2>&1
    echo "pytest rc=$? ($(grep -c ' PASSED ' "$OUT/cuda_tests.txt") PASSED, $(grep -c ' FAILED ' "$OUT/cuda_tests.txt") FAILED lines)" >> "$OUT/cuda_tests.txt"
    grep -E " FAILED |passed|failed|error|rc=" "$OUT/cuda_tests.txt" | tail -30
    timeout 100 python3 -m dilated_attention bench --seqlens 131072 --causal false true --markdown "$OUT/bench_131072.md" 2>&1 | tail -12
    ;;
  overhead)
    timeout "${OVERHEAD_TIMEOUT:-300}" python3 benchmarks/bench_overhead.py ${OVERHEAD_ARGS:-} --out "$OUT/overhead.md" 2>&1 | tee "$OUT/overhead.txt" | tail -20
    timeout "${VARLEN_TIMEOUT:-240}" python3 benchmarks/bench_varlen.py --out "$OUT/varlen.md" 2>&1 | tee "$OUT/varlen.txt" | tail -30
    ;;
  final)
    (timeout 300 python3 -m dilated_attention verify > "$OUT/verify.txt" 2>&1; echo "verify rc=$?" >> "$OUT/verify.txt") &
    timeout 330 python3 -m pytest -q -m cuda tests -n 3 -p no:cacheprovider -rfE --durations=10 > "$OUT/cuda_tests.txt" 2>&1
    echo "pytest rc=$?" >> "$OUT/cuda_tests.txt"
    wait
    timeout 90 python3 benchmarks/bench_overhead.py --no-e2e --iters 50 --out "$OUT/overhead.md" > "$OUT/overhead.txt" 2>&1
    timeout 60 python3 benchmarks/profile_host.py --calls 200 --top 35 > "$OUT/profile_host.txt" 2>&1
    tail -4 "$OUT/cuda_tests.txt"; tail -14 "$OUT/verify.txt"; grep "^|" "$OUT/overhead.txt"
    grep -A3 "function calls" "$OUT/profile_host.txt" | grep "function calls"
    ;;
  direct)
    # warm Triton's cache first (the first test run on a fresh machine compiles every kernel)
    DILATED_ATTENTION_DIRECT_LAUNCH=1 timeout "${DIRECT_TEST_TIMEOUT:-300}" python3 -m pytest -q -m cuda -n 4 -p no:cacheprovider -rfE \
      tests/test_decode_plan.py tests/test_decode.py tests/test_decode_edges.py tests/test_overhead.py \
      tests/test_triton.py tests/test_triton_determinism.py tests/test_triton_varlen.py > "$OUT/cuda_tests_direct.txt" 2>&1
    echo "pytest rc=$?" >> "$OUT/cuda_tests_direct.txt"
    timeout "${AB_TIMEOUT:-180}" python3 benchmarks/ab_decode.py --out "$OUT/ab_decode.md" > "$OUT/ab_decode.txt" 2>&1
    echo "ab_decode rc=$?" >> "$OUT/ab_decode.txt"
    DILATED_ATTENTION_DIRECT_LAUNCH=1 timeout 60 python3 benchmarks/profile_host.py --calls 200 --top 30 > "$OUT/profile_host_direct.txt" 2>&1
    tail -4 "$OUT/cuda_tests_direct.txt"; grep -E "^\||plans with launchers|rc=" "$OUT/ab_decode.txt" | tail -30
    ;;
  profile)
    timeout "${HOST_TIMEOUT:-120}" python3 benchmarks/profile_host.py --calls 200 --top 25 --gpu-time > "$OUT/profile_host.txt" 2>&1
    echo "profile_host rc=$?" >> "$OUT/profile_host.txt"
    timeout "${VARLEN_TIMEOUT:-200}" python3 benchmarks/profile_varlen.py --out "$OUT/profile_varlen.md" > "$OUT/profile_varlen.txt" 2>&1
    echo "profile_varlen rc=$?" >> "$OUT/profile_varlen.txt"
    timeout "${CUDA_TEST_TIMEOUT:-240}" python3 -m pytest -q -m cuda -n 4 -p no:cacheprovider -rfE \
      ${PROFILE_TESTS:-tests/test_decode_growing.py tests/test_decode_plan.py tests/test_train_plan.py tests/test_triton_varlen.py} \
      > "$OUT/cuda_tests.txt" 2>&1
    echo "pytest rc=$?" >> "$OUT/cuda_tests.txt"
    grep -A8 "^| call" "$OUT/profile_host.txt"; grep -E "rc=" "$OUT/profile_host.txt"
    grep -E "^- |^\| [a-z0-9]" "$OUT/profile_varlen.txt" | tail -24; tail -3 "$OUT/profile_varlen.txt"
    tail -6 "$OUT/cuda_tests.txt"
    ;;
  varlen|varlen-ab)
    if [ "$1" = varlen ]; then tests_default="tests/test_triton_varlen.py tests/test_triton_varlen_flat.py tests/test_train_plan.py tests/test_varlen.py tests/test_models_packed.py"
    else tests_default=tests/test_triton_varlen.py; fi
    varlen_tests() {  # -v: a run cut by the timeout still names the tests that passed (2026-11-27: -q left dots)
      local limit=${CUDA_TEST_TIMEOUT:-200}  # $DEADLINE (epoch s): stop the tests 25 s before it
      if [ -n "${DEADLINE:-}" ]; then limit=$(( DEADLINE - $(date +%s) - 25 )); [ "$limit" -gt 10 ] || limit=10; fi
      echo "varlen tests: timeout ${limit}s"
      timeout "$limit" python3 -m pytest -v -m cuda -n "${WORKERS:-4}" -p no:cacheprovider -rfE \
        ${VARLEN_TESTS:-$tests_default} > "$OUT/cuda_tests.txt" 2>&1
      echo "pytest rc=$? ($(grep -c ' PASSED ' "$OUT/cuda_tests.txt") PASSED lines)" >> "$OUT/cuda_tests.txt"
    }
    [ "${TESTS_LAST:-0}" = 1 ] || varlen_tests  # TESTS_LAST=1: the measurements first, the tests after them
    if [ -n "${ALT_SRC:-}" ] && [ "${ALT_PROFILE:-1}" = 1 ]; then  # the same profile on another src/ tree (carried under runs/)
      PYTHONPATH="$ALT_SRC" timeout "${ALT_TIMEOUT:-150}" python3 benchmarks/profile_varlen.py --configs default \
        --out "$OUT/profile_varlen_alt.md" > "$OUT/profile_varlen_alt.txt" 2>&1
      echo "profile_varlen (ALT_SRC=$ALT_SRC) rc=$?" >> "$OUT/profile_varlen_alt.txt"
    fi
    if [ "${PROFILE:-1}" = 1 ]; then
      timeout "${PROFILE_TIMEOUT:-180}" python3 benchmarks/profile_varlen.py --configs "${VARLEN_CONFIGS:-default}" \
        --out "$OUT/profile_varlen.md" > "$OUT/profile_varlen.txt" 2>&1
      echo "profile_varlen rc=$?" >> "$OUT/profile_varlen.txt"
    fi
    if [ "${BENCH:-1}" = 1 ]; then
      timeout "${VARLEN_TIMEOUT:-200}" python3 benchmarks/bench_varlen.py --out "$OUT/varlen.md" > "$OUT/varlen.txt" 2>&1
      echo "bench_varlen rc=$?" >> "$OUT/varlen.txt"
    fi
    if [ -n "${ALT_SRC:-}" ] && [ "${BENCH_AB:-0}" = 1 ]; then  # the ratio of both trees, alternating
      for i in 1 2; do
        for tree in "$ALT_SRC" src; do
          PYTHONPATH="$tree" timeout "${AB_BENCH_TIMEOUT:-150}" python3 benchmarks/bench_varlen.py --ratio-only \
            --rounds "${ROUNDS:-9}" --out /tmp/varlen_ab.md > /tmp/varlen_ab.txt 2>&1
          echo "run $i, tree $tree (rc=$?):" >> "$OUT/varlen_ab.txt"
          grep -E "^- causal|Error" /tmp/varlen_ab.txt >> "$OUT/varlen_ab.txt"
        done
      done
      cat "$OUT/varlen_ab.txt"
    fi
    [ "${TESTS_LAST:-0}" = 1 ] && varlen_tests
    tail -4 "$OUT/cuda_tests.txt"
    for f in "$OUT"/profile_varlen_alt.txt "$OUT"/profile_varlen.txt; do
      [ -e "$f" ] && { echo "== $f"; grep -E "^- |rc=|^\| default" "$f" | tail -16; }
    done
    [ -e "$OUT/varlen.txt" ] && grep -E "^\| (True|False)|^- causal|rc=" "$OUT/varlen.txt"
    ;;
  rotary)
    # issue 23 item 5: the fused rotary kernel (kernels/triton_rotary.py), CUDA tests of the
    # kernel, the models' generate (CUDA graphs with the kernel) and compile, with the kernel
    # switched on (the default since 2026-11-27: flags.ROTARY_DEFAULT; auto set here anyway), then the A/B
    DILATED_ATTENTION_FUSED_ROTARY=auto timeout "${CUDA_TEST_TIMEOUT:-240}" python3 -m pytest -v -m cuda -n "${WORKERS:-3}" -p no:cacheprovider -rfE \
      tests/test_rotary_fused.py tests/test_generate.py tests/test_compile_model.py > "$OUT/cuda_tests.txt" 2>&1
    echo "pytest rc=$? ($(grep -c ' PASSED ' "$OUT/cuda_tests.txt") PASSED lines)" >> "$OUT/cuda_tests.txt"
    timeout "${AB_TIMEOUT:-300}" python3 benchmarks/ab_rotary.py --out "$OUT/ab_rotary.md" > "$OUT/ab_rotary.txt" 2>&1
    echo "ab_rotary rc=$?" >> "$OUT/ab_rotary.txt"
    tail -4 "$OUT/cuda_tests.txt"; grep -E "^\||rc=" "$OUT/ab_rotary.txt" | tail -20
    ;;
  step)
    # issue 23 item 5: where the eager LongNet step loses to the compiled one (1.56x at 8K x 4 on
    # 2026-11-27): torch.profiler on one step per arm, the kernels per category side by side
    # (since 2026-11-27 the eager arm has the library's defaults: the fused loss with the Triton
    # cross-entropy kernel, the Triton LayerNorm; "eager plain" is the step without them)
    timeout "${STEP_TIMEOUT:-400}" python3 benchmarks/profile_step.py --out "$OUT/profile_step.md" > "$OUT/profile_step.txt" 2>&1
    echo "profile_step rc=$?" >> "$OUT/profile_step.txt"
    f="$OUT/profile_step.md"
    if [ -e "$f" ]; then
      sed -n '/^### Per category/,/^### Eager by origin/p' "$f" | grep "^|" | head -18
      sed -n '/^## Summary/,/^## N/p' "$f" | grep -E "^\||^- N"
    fi
    tail -2 "$OUT/profile_step.txt"
    ;;
  verify)
    # verify alone (cut twice beside other work: it compiles every impl x dtype x case first),
    # one process per dtype side by side (2026-11-27: both passed in 104 s on a cold machine),
    # then the LayerNorm's row crossover alone (LAYERNORM_AUTO_MIN_ROWS); progress lines of
    # verify go to verify_DTYPE.txt as each check ends
    for dt in bf16 fp16; do
      (timeout "${VERIFY_TIMEOUT:-330}" python3 -m dilated_attention verify --dtype $dt > "$OUT/verify_$dt.txt" 2>&1
       echo "verify $dt rc=$?" >> "$OUT/verify_$dt.txt") &
    done
    wait
    cat "$OUT/verify_bf16.txt" "$OUT/verify_fp16.txt" > "$OUT/verify.txt"; rm -f "$OUT"/verify_*.txt
    timeout "${LN_TIMEOUT:-120}" python3 benchmarks/bench_layernorm_rows.py --out "$OUT/layernorm_rows.md" > "$OUT/layernorm_rows.txt" 2>&1
    echo "bench_layernorm_rows rc=$?" >> "$OUT/layernorm_rows.txt"
    grep -E "FAIL|passed|FAILED|rc=" "$OUT/verify.txt" | tail -5; grep -c "^verify [0-9]" "$OUT/verify.txt"
    grep -E "^\||faster|rc=" "$OUT/layernorm_rows.txt" | tail -14
    ;;
  defaults)
    # after the 2026-11-27 defaults (fused loss + CE kernel, Triton LayerNorm on CUDA from 2048,
    # now 32768 rows): verify beside the CUDA tests they touch, the LayerNorm's row crossover, and the
    # eager step with the defaults against the step without them (no compile / dense: ~4 min)
    (timeout "${VERIFY_TIMEOUT:-170}" python3 -m dilated_attention verify > "$OUT/verify.txt" 2>&1; echo "verify rc=$?" >> "$OUT/verify.txt") &
    timeout "${CUDA_TEST_TIMEOUT:-170}" python3 -m pytest -v -m cuda -n 3 -p no:cacheprovider -rfE --durations=8 \
      tests/test_triton_layernorm.py tests/test_triton_ce.py tests/test_linear_ce.py tests/test_models.py \
      tests/test_generate.py tests/test_compile_model.py tests/test_train_fast.py ${EXTRA_TESTS:-} > "$OUT/cuda_tests.txt" 2>&1
    echo "pytest rc=$? ($(grep -c ' PASSED ' "$OUT/cuda_tests.txt") PASSED, $(grep -c ' FAILED ' "$OUT/cuda_tests.txt") FAILED lines)" >> "$OUT/cuda_tests.txt"
    wait
    timeout "${LN_TIMEOUT:-60}" python3 benchmarks/bench_layernorm_rows.py --out "$OUT/layernorm_rows.md" > "$OUT/layernorm_rows.txt" 2>&1
    echo "bench_layernorm_rows rc=$?" >> "$OUT/layernorm_rows.txt"
    timeout "${STEP_TIMEOUT:-120}" python3 benchmarks/profile_step.py --no-compile --no-dense --out "$OUT/profile_step.md" > "$OUT/profile_step.txt" 2>&1
    echo "profile_step rc=$?" >> "$OUT/profile_step.txt"
    grep -E " FAILED |passed|failed|rc=" "$OUT/cuda_tests.txt" | tail -12; tail -6 "$OUT/verify.txt"
    grep -E "^\||faster|rc=" "$OUT/layernorm_rows.txt" | tail -14
    sed -n '/^## Summary/,/^## N/p' "$OUT/profile_step.md" | grep -E "^\|"; tail -1 "$OUT/profile_step.txt"
    ;;
  decode)
    # issue 23 item 6 after the rotation's cache write (2026-11-27, rotary_into_cache: two fewer
    # kernels per layer and decode step): its CUDA tests (the kernel, the decode step's bits,
    # generate with CUDA graphs, the device guard), then generate's tokens/s against dense with
    # the step in a CUDA graph and eager (the 2026-11-26 figures: 1.36x at 32K graph, 1.09x at
    # 128K eager)
    timeout "${CUDA_TEST_TIMEOUT:-200}" python3 -m pytest -v -m cuda -n "${WORKERS:-3}" -p no:cacheprovider -rfE \
      tests/test_rotary_fused.py tests/test_decode_host.py tests/test_generate.py tests/test_device_guard.py > "$OUT/cuda_tests.txt" 2>&1
    echo "pytest rc=$? ($(grep -c ' PASSED ' "$OUT/cuda_tests.txt") PASSED lines)" >> "$OUT/cuda_tests.txt"
    for mode in graph eager; do
      timeout "${GEN_TIMEOUT:-150}" python3 benchmarks/bench_decode.py --no-latency --decode $mode --out "$OUT/generate_$mode.md" > "$OUT/generate_$mode.txt" 2>&1
      echo "bench_decode $mode rc=$?" >> "$OUT/generate_$mode.txt"
    done
    tail -4 "$OUT/cuda_tests.txt"; grep -hE "^\||rc=" "$OUT"/generate_*.txt | tail -16
    ;;
  decode2)
    # issue 23 item 6, the measurement made robust (2026-11-27, sixteenth session: one difference
    # of single generate runs gave 51x at 32K): bench_decode.py's generate rows now the fastest of
    # 3 alternated runs of 32 and 288 tokens, graph then eager; then profile_decode_step.py (the
    # eager step timed back to back / synchronised / host issue / as a graph, torch.profiler
    # kernels and runtime calls per step, cProfile), dilated and dense at 32K and 128K
    for mode in graph eager; do
      timeout "${GEN_TIMEOUT:-200}" python3 benchmarks/bench_decode.py --no-latency --decode $mode --out "$OUT/generate_$mode.md" > "$OUT/generate_$mode.txt" 2>&1
      echo "bench_decode $mode rc=$?" >> "$OUT/generate_$mode.txt"
    done
    timeout "${PDS_TIMEOUT:-200}" python3 benchmarks/profile_decode_step.py --out "$OUT/profile_decode_step.md" > "$OUT/profile_decode_step.txt" 2>&1
    echo "profile_decode_step rc=$?" >> "$OUT/profile_decode_step.txt"
    for mode in graph eager; do echo "== $mode"; grep -hE "^\||rc=" "$OUT/generate_$mode.txt" | tail -5; done
    grep -E "^\||rc=" "$OUT/profile_decode_step.txt" | tail -7
    ;;
  gqa)
    # issue 24 target 2: GQA / MQA rows within 10% of the MHA row (% of dense), headline shape
    timeout "${GQA_TIMEOUT:-300}" python3 benchmarks/bench_gqa.py --out "$OUT/bench_gqa.md" > "$OUT/bench_gqa.txt" 2>&1
    echo "bench_gqa rc=$?" >> "$OUT/bench_gqa.txt"
    grep -E "^\||rc=" "$OUT/bench_gqa.txt" | tail -24
    ;;
  fuzz)
    # issue 24 item 5 (>= 5,000 random configurations on the GPU against the float64 reference)
    # and the packed-documents fuzzer (issue 22): the Triton impl on CUDA, each until its count
    # or its time. Free draws compile ~1-6 binaries per configuration (~18 s per dense example on
    # 2026-11-27); the compile pool (scripts/fuzz.py's docstring) compiles each worker's
    # templates once and runs variants of them. Binaries into a cache dir of their own: they
    # are random specialisations that a later call would not reuse (the carried cache stays as is)
    fz=(env TRITON_CACHE_DIR=/tmp/da_fuzz_cache OMP_NUM_THREADS=1 python3 scripts/fuzz.py --impl triton --device cuda
        --workers "${FUZZ_WORKERS:-12}" --pool "${FUZZ_POOL:-4}")
    timeout "${FUZZ_TIMEOUT:-290}" "${fz[@]}" --examples "${FUZZ_EXAMPLES:-5000}" --minutes "${FUZZ_MINUTES:-4}" \
      --every 200 > "$OUT/fuzz_dense.txt" 2>&1
    echo "fuzz rc=$?" >> "$OUT/fuzz_dense.txt"
    timeout "${FUZZ_VARLEN_TIMEOUT:-220}" "${fz[@]}" --varlen --examples "${FUZZ_VARLEN_EXAMPLES:-5000}" \
      --minutes "${FUZZ_VARLEN_MINUTES:-3}" --every 200 > "$OUT/fuzz_varlen.txt" 2>&1
    echo "fuzz rc=$?" >> "$OUT/fuzz_varlen.txt"
    grep -E "MISMATCH|ERROR|FAILED" "$OUT/fuzz_dense.txt" "$OUT/fuzz_varlen.txt" | head -5
    tail -6 "$OUT/fuzz_dense.txt"; tail -6 "$OUT/fuzz_varlen.txt"
    ;;
  fuzz-gluon)
    # issue 24: the Gluon kernels (kernels/gluon_{fwd,bwd}.py) over >= 5,000 random configurations
    # (scripts/fuzz.py's docstring, tests/gluon_fuzz_cases.py): each case the float64 reference on
    # the GPU, impl="triton" with both Gluon switches off, then on (its Gluon launches counted: a
    # fall back to Triton is an ERROR). A Gluon case compiles ~3 Gluon and ~4 Triton binaries
    # per branch: a pool of 2 templates per worker, the rest variants. --minutes stops starting
    # cases; the timeout leaves 90 s for a template still compiling then
    timeout "${FUZZ_GLUON_TIMEOUT:-450}" env TRITON_CACHE_DIR=/tmp/da_fuzz_gluon_cache OMP_NUM_THREADS=1 \
      python3 scripts/fuzz.py --gluon --impl triton --device cuda --workers "${FUZZ_GLUON_WORKERS:-12}" \
      --pool "${FUZZ_GLUON_POOL:-2}" --examples "${FUZZ_GLUON_EXAMPLES:-5000}" --minutes "${FUZZ_GLUON_MINUTES:-6}" \
      --every 100 > "$OUT/fuzz_gluon.txt" 2>&1
    echo "fuzz rc=$?" >> "$OUT/fuzz_gluon.txt"
    grep -E "MISMATCH|ERROR|FAILED|cannot run" "$OUT/fuzz_gluon.txt" | head -8
    tail -8 "$OUT/fuzz_gluon.txt"
    ;;
  fuzz-gluon-varlen)
    # issue 22 / 24 (written 2026-11-29, thirty-first session, not yet run): the Gluon varlen kernels (kernels/gluon_varlen.py,
    # on by default on Hopper) over random packed batches (tests/gluon_varlen_fuzz_cases.py: host and device offsets, rows
    # past the documents holding NaN / inf, GQA / MQA, head dim 64 / 128, r = 1 first or not): each case the float64
    # reference per document, impl="triton" with the Gluon switches off, then on (a fall back to Triton is an ERROR).
    # $FUZZ_GLUON_VARLEN_EXAMPLES (2000) in $FUZZ_GLUON_VARLEN_MINUTES (6); a pool of 2 templates per worker
    fuzz_gluon_varlen 12
    grep -E "MISMATCH|ERROR|FAILED|cannot run" "$OUT/fuzz_gluon_varlen.txt" | head -8
    tail -8 "$OUT/fuzz_gluon_varlen.txt"
    ;;
  varlen-configs)
    timeout "${PROFILE_TIMEOUT:-540}" python3 benchmarks/profile_varlen.py --causal "${CAUSAL:-yes}" \
      --configs "${VARLEN_CONFIGS:-default,dkdv32x64,dkdv32x64s3,dkdv64s1}" --out "$OUT/profile_varlen_configs.md" \
      > "$OUT/profile_varlen_configs.txt" 2>&1
    echo "profile_varlen rc=$?" >> "$OUT/profile_varlen_configs.txt"
    grep -E "^- total|^\| (default|dkdv|dq|fwd|small)" "$OUT/profile_varlen_configs.txt" | head -20; grep -E "rc=" "$OUT/profile_varlen_configs.txt"
    ;;
  measure2)
    timeout "${HOST_TIMEOUT:-100}" python3 benchmarks/profile_host.py --calls 200 --top 25 --gpu-time > "$OUT/profile_host.txt" 2>&1
    echo "profile_host rc=$?" >> "$OUT/profile_host.txt"
    timeout "${AB_TIMEOUT:-200}" python3 benchmarks/ab_decode.py --out "$OUT/ab_decode.md" > "$OUT/ab_decode.txt" 2>&1
    echo "ab_decode rc=$?" >> "$OUT/ab_decode.txt"
    timeout "${PROFILE_TIMEOUT:-120}" python3 benchmarks/profile_varlen.py --configs default --out "$OUT/profile_varlen.md" > "$OUT/profile_varlen.txt" 2>&1
    echo "profile_varlen rc=$?" >> "$OUT/profile_varlen.txt"
    timeout "${VARLEN_TIMEOUT:-180}" python3 benchmarks/bench_varlen.py --out "$OUT/varlen.md" > "$OUT/varlen.txt" 2>&1
    echo "bench_varlen rc=$?" >> "$OUT/varlen.txt"
    grep -A6 "^| call" "$OUT/profile_host.txt"; grep -E "^\| (4096|32768|131072|1048576|train)|plans with launchers|rc=" "$OUT/ab_decode.txt"
    grep -E "^- total|rc=" "$OUT/profile_varlen.txt"; grep -E "^- causal|rc=" "$OUT/varlen.txt"
    ;;
  tune-dkdv)
    timeout "${TUNE_TIMEOUT:-450}" python3 benchmarks/tune_triton.py --kernels dkdv --max-seconds "${TUNE_SECONDS:-330}" \
      --out "$OUT/tune_dkdv.md" > "$OUT/tune_dkdv.txt" 2>&1
    echo "tune rc=$?" >> "$OUT/tune_dkdv.txt"
    timeout 90 python3 benchmarks/profile_impl.py --impl triton --n 131072 > "$OUT/profile_impl.txt" 2>&1
    grep -E "^\||best|rc=" "$OUT/tune_dkdv.txt" | tail -30; tail -20 "$OUT/profile_impl.txt"
    ;;
esac
