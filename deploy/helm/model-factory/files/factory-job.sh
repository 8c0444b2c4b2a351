#!/bin/sh
# One index of a factory Job: build one recipe for this Job's GPU product, sign it, verify it in a
# staging folder, move it into <root>/<product>/trt-<version>/ with renames, and end with verify.
# The model folder it replaces is kept in <root>/.previous/<product>/trt-<version>/ (one
# generation); FACTORY_ACTION=rollback swaps every kept folder back (run it again to undo).
#
# The Job runs with no network (a deny-all NetworkPolicy) and the signing key from a read-only
# Secret. The staging folder sits on the same volume as the repository, so each model folder is
# swapped in with a rename: a serving pod that starts meanwhile sees the old signed model or the
# new one, never a half-written or unsigned one. The FACTORY_* variables are set by the Job
# (templates/factory-jobs.yaml); a test runs this script with a stand-in model-factory.
set -eu

fail() {
    echo "factory-job: $*" >&2
    exit 2
}

index=${JOB_COMPLETION_INDEX:?not an Indexed Job (JOB_COMPLETION_INDEX unset)}
root=${FACTORY_REPOSITORY_ROOT:?}
product=${FACTORY_GPU_PRODUCT:?}
trt=${FACTORY_TENSORRT_VERSION:?}
key=${FACTORY_SIGNING_KEY:?}
policy=${FACTORY_POLICY:?}
recipes_dir=${FACTORY_RECIPES_DIR:?}
dest="$root/$product/trt-$trt"
previous="$root/.previous/$product/trt-$trt"

if [ "${FACTORY_ACTION:-build}" = rollback ]; then
    [ -d "$previous" ] || fail "nothing to roll back: $previous does not exist (no build has replaced a model yet)"
    swapped=0
    for kept in "$previous"/*/; do
        [ -d "$kept" ] || continue
        name=$(basename "$kept")
        if [ -e "$dest/$name" ]; then
            mv "$dest/$name" "$previous/.swap-$name"
        fi
        mv "$kept" "$dest/$name"
        if [ -e "$previous/.swap-$name" ]; then
            mv "$previous/.swap-$name" "$previous/$name"
        fi
        swapped=$((swapped + 1))
        echo "factory-job: rolled $name back in $dest"
    done
    [ "$swapped" -gt 0 ] || fail "nothing to roll back in $previous"
    model-factory verify --no-release --policy "$policy" --json "$dest"
    echo "factory-job: rolled back $swapped model(s) in $dest"
    exit 0
fi
[ "${FACTORY_ACTION:-build}" = build ] || fail "FACTORY_ACTION=$FACTORY_ACTION: use build or rollback"

# shellcheck disable=SC2086  # the recipe list is space-separated on purpose
set -- ${FACTORY_RECIPES:?}
[ "$index" -lt "$#" ] || fail "index $index but only $# recipe(s) in FACTORY_RECIPES. Fix: completions must equal the number of recipes"
shift "$index"
recipe_file=$1
recipe="$recipes_dir/$recipe_file"
[ -r "$recipe" ] || fail "cannot read recipe $recipe. Fix: add $recipe_file to the recipes ConfigMap"
[ -r "$key" ] || fail "cannot read the signing key $key. Fix: check factory.signingKeySecret"

work="$root/.staging/$product/trt-$trt/${recipe_file%.toml}-${HOSTNAME:-$$}"
staging="$work/repository"
rm -rf "$work"
mkdir -p "$staging" "$dest" "$previous"

set -- --key "$key"
if [ -n "${FACTORY_CERT_CHAIN:-}" ]; then
    [ -r "$FACTORY_CERT_CHAIN" ] || fail "cannot read the certificate chain $FACTORY_CERT_CHAIN"
    set -- "$@" --cert-chain "$FACTORY_CERT_CHAIN"
fi

echo "factory-job: building $recipe_file for $product (TensorRT $trt) in $staging"
model-factory build "$recipe" --repository "$staging" "$@"
# The serving pods' own policy: what passes here is what they will load. Signatures only
# (--no-release): with signed releases, a release listing this build is published afterwards,
# with the offline targets key (docs/releases.md).
model-factory verify --no-release --policy "$policy" "$staging"

moved=0
for model in "$staging"/*/; do
    [ -d "$model" ] || continue
    name=$(basename "$model")
    if [ -e "$dest/$name" ]; then
        rm -rf "$previous/$name"
        mv "$dest/$name" "$previous/$name"
    fi
    mv "$model" "$dest/$name"
    moved=$((moved + 1))
    echo "factory-job: $name -> $dest/$name"
done
[ "$moved" -gt 0 ] || fail "model-factory build wrote no model into $staging"
rm -rf "$work"

model-factory verify --no-release --policy "$policy" --json "$dest"
echo "factory-job: $recipe_file built, signed and verified in $dest"
