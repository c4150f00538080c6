#!/usr/bin/env bash
# `make images-test`: build the drafter, gateway and verifier-cpu images of deploy/docker/Dockerfile
# with a real container engine, run the three roles from them with compose (deploy/compose.yaml,
# the tiny pair, without the observability profile), and generate through the gateway: the greedy
# output with speculation (gamma 4, drafts accepted) must equal the target's own (gamma 0, plain
# decoding by the same verifier), and carry the target's logprobs, one per token (the verifier-cpu
# image has no C++ compiler: nothing it serves may compile). Prints each image's size and build
# time (deploy/README.md "Images").
#
# Not part of `make test` (tens of minutes, a container engine, gigabytes of images). Settings:
#   ENGINE=podman|docker            default: podman if installed
#   COMPOSE="docker compose"        default: podman-compose for podman, `docker compose` for docker
#   BASE=IMAGE                      the Python base (PYTHON_IMAGE); default: the Dockerfile's own
#                                   (Docker Hub). BASE=local builds one from Debian's packages first
#                                   (deploy/docker/build-base.sh, with EXTRA_CA_CERTS passed on)
#   TORCH_CPU_INDEX=URL             where the CPU torch wheel comes from (default: the Dockerfile's);
#   TORCH_WHEELS=DIR                or a folder holding it, served here as an index on 127.0.0.1
#   CONTAINERS_CONF=FILE            podman settings; default deploy/docker/containers-sandbox.conf
#                                   (sandboxed machines such as gVisor need it)
set -euo pipefail
cd "$(dirname "$0")/../.."

ENGINE=${ENGINE:-$(command -v podman > /dev/null && echo podman || echo docker)}
if [ "$ENGINE" = podman ]; then
  export CONTAINERS_CONF=${CONTAINERS_CONF:-$PWD/deploy/docker/containers-sandbox.conf}
  COMPOSE=${COMPOSE:-podman-compose}
  sep=_
  # BuildKit finds the ignore file by the Dockerfile's name; OCI images drop HEALTHCHECK: docker format
  ignore=(--ignorefile deploy/docker/Dockerfile.dockerignore --format docker)
else
  ignore=()
  COMPOSE=${COMPOSE:-docker compose}
  sep=-
fi
TAG=${SPECDEC_VERSION:-0.1.0}
PROJECT=specdec-images-test
NET=${PROJECT}_default
args=()
if [ "${BASE:-}" = local ]; then
  BASE=localhost/specdec-python:3.11-bookworm
  "$ENGINE" image inspect "$BASE" > /dev/null 2>&1 || ENGINE=$ENGINE deploy/docker/build-base.sh "$BASE"
fi
[ -z "${BASE:-}" ] || args+=(--build-arg "PYTHON_IMAGE=$BASE")

index_pid=
cleanup() {
  $COMPOSE -f deploy/compose.yaml -p "$PROJECT" down -v > /dev/null 2>&1 || true
  [ -z "$index_pid" ] || kill "$index_pid" 2> /dev/null || true
}
trap cleanup EXIT
if [ -n "${TORCH_WHEELS:-}" ]; then  # a PEP 503 index of the folder's torch wheels, for the builds
  index=$(mktemp -d)
  mkdir -p "$index/simple/torch"
  for wheel in "$TORCH_WHEELS"/torch-*.whl; do
    ln -s "$(realpath "$wheel")" "$index/simple/torch/"
    name=$(basename "$wheel")
    echo "<a href=\"${name//+/%2B}\">$name</a>" >> "$index/simple/torch/index.html"
  done
  port=${TORCH_INDEX_PORT:-18766}
  python3 -m http.server "$port" --bind 127.0.0.1 --directory "$index" > /dev/null 2>&1 &
  index_pid=$!
  TORCH_CPU_INDEX=http://127.0.0.1:$port/simple
fi
[ -z "${TORCH_CPU_INDEX:-}" ] || args+=(--build-arg "TORCH_CPU_INDEX=$TORCH_CPU_INDEX")

report=()
for target in gateway drafter verifier-cpu; do
  start=$(date +%s)
  "$ENGINE" build --network host -f deploy/docker/Dockerfile "${ignore[@]}" \
    --target "$target" "${args[@]}" -t "specdec/$target:$TAG" . > "/tmp/images-test-$target.log" 2>&1 \
    || { tail -30 "/tmp/images-test-$target.log"; echo "images-test: building $target failed" >&2; exit 1; }
  size=$("$ENGINE" image inspect --format '{{.Size}}' "specdec/$target:$TAG")
  report+=("$(printf '%-13s %6d MB  built in %4d s' "$target" $((size / 1000000)) $(( $(date +%s) - start )))")
  echo "${report[-1]}"
done

# the three roles (and the one-shot `models`, which builds the tiny pair into the volume)
# the draft that agrees with the target (alpha 1): every round speculates, and the output must still be exact
export MODEL_PAIR=tiny VERIFIER_MODEL=tiny/target DRAFTER_MODEL=tiny/draft-same TOKENIZER=tiny/target
export OTEL_TRACES_EXPORTER=none SPECDEC_VERSION=$TAG VERIFIER_THREADS=${VERIFIER_THREADS:-1}
# an API key, as in production (and podman-compose 1.0.3 leaves `${SPECDEC_API_KEYS:-}` unexpanded)
export SPECDEC_API_KEYS=sk-images-test
$COMPOSE -f deploy/compose.yaml -p "$PROJECT" up -d --no-build models verifier drafter gateway > /tmp/images-test-compose.log 2>&1 \
  || { tail -30 /tmp/images-test-compose.log; exit 1; }

client() {  # `specdec generate` in the gateway image, on the stack's network
  "$ENGINE" run --rm --network "$NET" "specdec/gateway:$TAG" generate --address "gateway:50051" \
    --api-key "$SPECDEC_API_KEYS" "$@" 2> /dev/null
}
deadline=$(( $(date +%s) + ${READY_TIMEOUT_S:-900} ))
until client --token-ids 5,6,7,8 --max-tokens 1 --timeout 30 --json > /dev/null 2>&1; do
  if [ "$(date +%s)" -gt "$deadline" ]; then
    for s in models verifier drafter gateway; do "$ENGINE" logs --tail 20 "${PROJECT}${sep}${s}${sep}1" 2>&1 | sed "s/^/$s: /"; done
    echo "images-test: the gateway did not serve within ${READY_TIMEOUT_S:-900} s" >&2
    exit 1
  fi
  sleep 10
done

spec=(--token-ids 5,6,7,8,9,10 --max-tokens 48 --ignore-eos --json)
plain=$(client "${spec[@]}" --gamma 0)
speculative=$(client "${spec[@]}" --gamma 4 --logprobs 2)
python3 - "$plain" "$speculative" <<'EOF'
import json, sys
plain, spec = (json.loads(a) for a in sys.argv[1:3])
drafted, accepted = (int(spec["stats"].get(k, 0)) for k in ("drafted_tokens", "accepted_tokens"))
print(f"gamma 0: {len(plain['token_ids'])} tokens; gamma 4: {len(spec['token_ids'])} tokens, "
      f"{drafted} drafted, {accepted} accepted")
assert len(plain["token_ids"]) == 48 and accepted > 0, "no draft was accepted: no speculation happened"
assert spec["token_ids"] == plain["token_ids"], "speculative output differs from the target's own"
assert len(spec.get("logprobs", [])) == 48 and all(lp["rank"] >= 1 for lp in spec["logprobs"]), "no logprobs"
print("exact: the speculative output equals the target's own, token for token, with its logprobs")
EOF
printf '%s\n' "images:" "${report[@]}"
