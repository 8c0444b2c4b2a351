#!/bin/sh
# Build and sign every recipe in the mounted recipes folder into the mounted model repository.
#
# Runs as the factory service's command (network_mode: none). One recipe failing stops the
# run with its exit code; models built before it stay in the repository, signed.
# The paths are the container's mounts; the FACTORY_* variables exist so a test can point
# them elsewhere.
set -eu

recipes_dir=${FACTORY_RECIPES_DIR:-/workspace/recipes}
repository=${FACTORY_REPOSITORY:-/workspace/model_repository}
key=${FACTORY_SIGNING_KEY:-/run/secrets/signing_key}

fail() {
    echo "factory: $*" >&2
    exit 2
}

[ -r "$key" ] || fail "cannot read the signing key $key. Fix: set SIGNING_KEY_FILE in .env to your private key (model-factory keygen writes one) and make it readable by FACTORY_USER."
[ -d "$recipes_dir" ] || fail "$recipes_dir is not mounted. Fix: create ./recipes (or set RECIPES_DIR in .env)."
[ -d "$repository" ] && [ -w "$repository" ] || fail "$repository is missing or not writable. Fix: create ./model_repository (or set MODEL_REPOSITORY in .env) owned by FACTORY_USER."

# Certificate mode (an in-house CA): FACTORY_CERT_CHAIN names a PEM with the signing
# certificate and its intermediates (docs/deployment.md shows the compose override).
set --
if [ -n "${FACTORY_CERT_CHAIN:-}" ]; then
    [ -r "$FACTORY_CERT_CHAIN" ] || fail "cannot read the certificate chain $FACTORY_CERT_CHAIN. Fix: check the signing_chain secret in docker-compose.override.yml."
    set -- --cert-chain "$FACTORY_CERT_CHAIN"
fi

found=0
for recipe in "$recipes_dir"/*.toml; do
    [ -e "$recipe" ] || continue
    found=$((found + 1))
    echo "factory: building $recipe into $repository"
    model-factory build "$recipe" --repository "$repository" --key "$key" "$@"
done
[ "$found" -gt 0 ] || fail "no recipes (*.toml) in $recipes_dir. Fix: put your recipes (and the model folders they name) in ./recipes."
echo "factory: built and signed $found recipe(s) into $repository"
