#!/usr/bin/env bash
# E2B's own published test suites against a real `locker serve` (docs/e2b.md, "E2B's own
# test suites"). Not part of CI: it needs a checkout of github.com/e2b-dev/E2B or of
# github.com/e2b-dev/code-interpreter (nothing of them is kept in this repository) and
# the registries (PyPI, npm).
#
#   tests/e2b/own_suites.sh CHECKOUT WORK_DIR [py|js|both|interp-py|interp-js|interp]
#                           [pytest/vitest args...]
#
# py, js, both: CHECKOUT is e2b-dev/E2B (its packages/python-sdk/tests and
# packages/js-sdk/tests). interp-py, interp-js, interp: CHECKOUT is e2b-dev/code-interpreter
# (its python/tests and js/tests; build the template first: `locker template build
# code-interpreter`). WORK_DIR: where the venvs, node_modules, the server's data dir and
# the reports go. LOCKER_BIN / LOCKER_AGENT_BIN: the binaries (default
# target/release). The Python suite runs with PyPI's newest `e2b` in place of the
# checkout's source tree; the JavaScript suite runs the checkout's tests under vitest 4
# with `../src` (the SDK's source, which the tests import) a module that re-exports npm's
# newest `e2b`: a test that imports one of the SDK's internal modules cannot run so.
set -euo pipefail

src=$(realpath "$1")
work=$(realpath -m "$2")
which=${3:-both}
shift $(($# < 3 ? $# : 3))
here=$(cd "$(dirname "$0")/../.." && pwd)
locker=${LOCKER_BIN:-$here/target/release/locker}
agent=${LOCKER_AGENT_BIN:-$here/target/x86_64-unknown-linux-gnu/release/locker-agent}
mkdir -p "$work"

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
key="e2b_$(head -c 20 /dev/urandom | od -An -tx1 | tr -d ' \n')"
rm -rf "$work/data"
LOCKER_API_KEY=$key LOCKER_AGENT_BIN=$agent "$locker" serve --listen "127.0.0.1:$port" \
    --data-dir "$work/data" --preview-domain localhost >"$work/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 100); do
    curl -sf "http://127.0.0.1:$port/healthz" >/dev/null && break
    sleep 0.2
done
export E2B_API_URL=http://127.0.0.1:$port E2B_SANDBOX_URL=http://127.0.0.1:$port E2B_API_KEY=$key
export E2B_DOMAIN=localhost:$port

# A vitest config in directory $1 for the files $2 matches but not $3 (quoted globs, comma
# separated): Node, 60 s per test, three workers.
vitest_config() {
    cat >"$1/vitest.config.mts" <<EOF
import { defineConfig } from 'vitest/config'
export default defineConfig({
  test: {
    include: [$2],
    exclude: [$3],
    globals: false,
    testTimeout: 60_000,
    hookTimeout: 60_000,
    environment: 'node',
    maxWorkers: 3,
  },
})
EOF
}

# Runs vitest in directory $1, its reports as $work/$2.{xml,txt}; the rest are its arguments.
run_vitest() {
    local dir=$1 name=$2
    shift 2
    (cd "$dir" && npx vitest run --reporter=default --reporter=junit \
        --outputFile.junit="$work/$name.xml" "$@" || true) | tee "$work/$name.txt"
}

if [[ $which == py || $which == both ]]; then
    if [[ ! -x $work/venv/bin/python ]]; then
        python3 -m venv "$work/venv"
        "$work/venv/bin/pip" install -q e2b pytest pytest-xdist pytest-asyncio pytest-timeout
    fi
    # The suite's conftest imports the SDK; the installed package stands in for the source
    # (`pytest`, not `python -m pytest`, which would put the source tree first on the path;
    # the suite's pytest.ini sets importlib mode). 120 s per test: the suite's 30 s is
    # short for a busy host.
    (cd "$src/packages/python-sdk" &&
        "$work/venv/bin/pytest" -p no:cacheprovider -q -n 3 --timeout 120 \
            --junitxml "$work/py.xml" tests/sync/sandbox_sync tests/sync/api_sync "$@" ||
        true) | tee "$work/py.txt"
fi

if [[ $which == js || $which == both ]]; then
    js=$work/js
    mkdir -p "$js"
    rm -rf "$js/tests"
    cp -r "$src/packages/js-sdk/tests" "$js/tests"
    mkdir -p "$js/src"
    # `../src` as the tests import it: the published package.
    printf "export * from 'e2b'\nexport { default } from 'e2b'\n" >"$js/src/index.ts"
    # `../src/errors.js`: the error classes, which the package exports too.
    printf "export * from 'e2b'\n" >"$js/src/errors.ts"
    vitest_config "$js" "'tests/sandbox/**/*.test.ts', 'tests/api/**/*.test.ts'" \
        "'tests/sandbox/git/**'"
    if [[ ! -d $js/node_modules/vitest ]]; then
        (cd "$js" && npm init -y >/dev/null &&
            npm install --no-audit --no-fund -s e2b vitest@4 msw dotenv >/dev/null)
    fi
    run_vitest "$js" js "$@"
fi

if [[ $which == interp-py || $which == interp ]]; then
    if [[ ! -x $work/venv-interp/bin/python ]]; then
        python3 -m venv "$work/venv-interp"
        "$work/venv-interp/bin/pip" install -q e2b-code-interpreter pytest pytest-xdist \
            pytest-asyncio pytest-timeout
    fi
    # PyPI's newest `e2b-code-interpreter` in place of the checkout's source (the suite's
    # pytest.ini sets importlib mode and two workers).
    (cd "$src/python" &&
        "$work/venv-interp/bin/pytest" -p no:cacheprovider -q --timeout 180 \
            --junitxml "$work/interp-py.xml" tests "$@" || true) | tee "$work/interp-py.txt"
fi

if [[ $which == interp-js || $which == interp ]]; then
    # The code interpreter's JavaScript tests import the SDK's own source (`../src`): that
    # is the package itself (over npm's `e2b`), so it runs as checked out.
    js=$work/interp-js
    rm -rf "$js"
    mkdir -p "$js"
    cp -r "$src/js/src" "$src/js/tests" "$js/"
    vitest_config "$js" "'tests/**/*.test.ts'" "'tests/runtimes/**'"
    if [[ ! -d $work/interp-node/node_modules/vitest ]]; then
        mkdir -p "$work/interp-node"
        (cd "$work/interp-node" && npm init -y >/dev/null &&
            npm install --no-audit --no-fund -s e2b vitest@4 dotenv >/dev/null)
    fi
    ln -sfn "$work/interp-node/node_modules" "$js/node_modules"
    run_vitest "$js" interp-js "$@"
fi
