#!/usr/bin/env bash
# One part of the test suite, as `make test` and `.ci/run` run it (docs/testing.md: what each part guards, its cost).
#   suite     everything not marked below, on PYTEST_WORKERS pytest-xdist workers (default 2; 0 = serial) taking
#             whole files (tests/conftest.py starts the longest files first), so one file's waits (process start-up,
#             Ray, vLLM) overlap the other's work. This is `make test`: <= 25 min on an idle 2-core machine.
#   slurm     -m slurm: a 3-node Slurm in network namespaces, real sbatch/scancel/requeue. Alone and serial: with a
#             worker beside it, a worker died once at the end of the 3-node requeue test (not explained, no OOM kill).
#   layouts   -m layouts: every shipped recipe's layout shrunk to toy width (tests/test_shipped_layouts.py), serial
#             (the 30B-A3B layout alone is 8 policy ranks).
#   long      -m long: end-to-end runs that cheaper tests of the suite overlap.
#   gpu_prep  -m gpu_prep: tools/gpu/gpu_check.sh run whole at tiny sizes.
# The session fixtures the parts share (the warmed-up tiny model) live in DA3PO_TEST_SHARED_DIR: the caller's
# (.ci/run makes one for all its parts) or a fresh one removed at the end. Per-test durations go to
# .pytest_cache/da3po/durations-PART.json for tools/dev/ci_time.py.
#
# usage: scripts/run_tests.sh PYTHON PART [pytest args...]
set -uo pipefail
py=${1:?usage: scripts/run_tests.sh PYTHON PART [pytest args...]}
part=${2:?usage: scripts/run_tests.sh PYTHON PART [pytest args...]}
shift 2
if [[ -z ${DA3PO_TEST_SHARED_DIR:-} ]]; then
  DA3PO_TEST_SHARED_DIR=$(mktemp -d "${TMPDIR:-/tmp}/da3po-tests.XXXXXX")
  trap 'rm -rf "$DA3PO_TEST_SHARED_DIR"' EXIT
fi
export DA3PO_TEST_SHARED_DIR OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# tests/_hermetic.py: the suite must leave the checkout as it found it -- strict: also its tracked and untracked
# files (a plain `pytest` run leaves those out, since the developer may be editing them).
export DA3PO_TEST_STRICT_CHECKOUT=${DA3PO_TEST_STRICT_CHECKOUT:-1}
export DA3PO_TEST_DURATIONS=${DA3PO_TEST_DURATIONS_DIR:-.pytest_cache/da3po}/durations-$part.json
workers=${PYTEST_WORKERS:-2}
case $part in
  suite) args=(-m "not slurm and not layouts and not long and not gpu_prep")
         [[ $workers == 0 ]] || args+=(-n "$workers" --dist loadfile --no-loadscope-reorder) ;;
  slurm) args=(-m slurm) ;;
  layouts) args=(-m layouts tests/test_shipped_layouts.py) ;;
  long) args=(-m long) ;;
  gpu_prep) args=(-m gpu_prep tests/test_gpu_check_script.py) ;;
  *) echo "usage: scripts/run_tests.sh PYTHON {suite|slurm|layouts|long|gpu_prep} [pytest args...]" >&2; exit 2 ;;
esac
start=$(date +%s)
echo "[tests] part $part: pytest ${args[*]} $*"
"$py" -m pytest "${args[@]}" "$@"
rc=$?
echo "[tests] part $part: exit $rc after $(($(date +%s) - start)) s"
exit $rc
