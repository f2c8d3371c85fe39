#!/usr/bin/env bash
# Checks a GPU worker in two parts, cheapest first:
#   1. every trainer's "it learns" test (FR, DFA aligner, CAFace, FaceGCD, UIFace autoencoder and UNet) on the GPU in
#      32-true, bf16-mixed and 16-mixed: the same assertions as on the CPU (tests/conftest.py TRAIN_DEVICE); 32-true
#      first, so that a failure in mixed precision is told apart from one of the device;
#   2. the benchmarks gpu_trainers (bf16-mixed), fr112_bound, uiface112, fr112_stream, gpu_trainers_fp16,
#      gpu_trainers_fp32 and caface_paths,
#      each written to benchmarks/results.json and results.md as soon as it ends.
# Usage: benchmarks/gpu_check.sh [DIR]   (DIR receives each step's log and a copy of the results; default: no copy)
# PYTHON picks the interpreter (default python3). Exit status 1 when any step failed; every step runs regardless.
set -u
out=${1:-}
python=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
learns=(
  tests/unit/test_train_fr.py::test_loss_decreases_and_accuracy_beats_chance
  tests/unit/test_dfa.py::test_short_training_lowers_loss_and_beats_the_mean_shape
  tests/unit/test_caface.py::test_training_beats_averaging_for_every_seed
  tests/unit/test_discovery_recipe.py::test_training_beats_its_initial_features_on_held_out_images
  tests/unit/test_train_generator.py::test_loss_decreases_on_a_tiny_dataset
  tests/unit/test_train_generator.py::test_resume_after_an_epoch_equals_an_uninterrupted_run
  tests/unit/test_train_generator.py::test_autoencoder_reconstructs_held_out_faces_better_than_the_mean_face
)
status=0

step() {  # step NAME COMMAND...: run it, its output to DIR/NAME.log too, and copy the results after it
  local name=$1
  shift
  echo "== $name: $*"
  if [ -n "$out" ]; then
    "$@" 2>&1 | tee "$out/$name.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
    cp benchmarks/results.json benchmarks/results.md "$out/"
  else
    "$@" || status=1
  fi
}

learns() {  # learns PRECISION
  FACEOPS_TEST_ACCELERATOR=gpu FACEOPS_TEST_PRECISION=$1 "$python" -m pytest -q -p no:cacheprovider "${learns[@]}"
}

step learns_fp32 learns 32-true
step learns_bf16 learns bf16-mixed
step bench_bf16 "$python" -m benchmarks gpu_trainers
step fr112_bound "$python" -m benchmarks fr112_bound
step uiface112 "$python" -m benchmarks uiface112
step fr112_stream "$python" -m benchmarks fr112_stream
step learns_fp16 learns 16-mixed
step bench_fp16 "$python" -m benchmarks gpu_trainers_fp16
step bench_fp32 "$python" -m benchmarks gpu_trainers_fp32
step caface_paths "$python" -m benchmarks caface_paths
exit $status
