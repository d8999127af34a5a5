#!/usr/bin/env bash
# Builds the Argo UI of argo-workflows ARGO_VERSION (the version tools/k8s/build.sh builds the controller and CLI
# from) and an `argo` binary that serves it (`argo server`), for the tier's browser test; prints that binary's path.
#
# Source: argo-workflows' `ui/` from the Go module (read-only there: copied), and argo-ui at the commit that
# `ui/package.json` pins (argo-ui is not on npm). argo-ui comes from the tarball named by ARGO_UI_TARBALL (a
# `git archive` of that commit: package.json, LICENSE, src/), and from GitHub's archive of the commit otherwise.
# Tools: node >= 20 (ui/package.json "engines"), yarn 1.22 run through npx (corepack cannot fetch yarn 1 offline),
# Go for the relink. `ui/.yarnrc` freezes the lockfile, so the argo-ui dependency is changed to the local copy in
# package.json and yarn.lock alike; every other lock entry stays as Argo pinned it.
#
# `--cached`: print the binary's path when it is built, else exit 4 saying so (the tier's UI test asks this way).
# Idempotent: the binary goes to $JAXREC_ARGO_UI_CACHE/<key>/argo (default ~/.cache/jaxrec-argo-ui), <key> hashing
# the Argo version, the argo-ui commit, node's major version, ui/yarn.lock and this script; a hit prints at once.
# Cold: about 3 to 4 minutes on 2 cores (yarn install about 45 s, webpack about 100 s at 2.7 GB of memory), yarn's
# download cache kept beside (about 0.9 GB). Exit 3 (with the reason) when a tool or the source is missing.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
k8s_build="$here/../k8s/build.sh"
ARGO_VERSION="$(sed -n 's/^ARGO_VERSION=//p' "$k8s_build")"
ARGO_COMMIT="$(sed -n 's/^ARGO_COMMIT=//p' "$k8s_build")"
YARN_VERSION=1.22.22
cache_root="${JAXREC_ARGO_UI_CACHE:-$HOME/.cache/jaxrec-argo-ui}"

missing() { echo "argo-ui/build.sh: $*" >&2; exit 3; }
command -v node >/dev/null || missing "no node on PATH (node >= 20: Debian's nodejs or nodejs.org)"
command -v npx >/dev/null || missing "no npx on PATH (npm, beside node)"
command -v go >/dev/null || missing "no go on PATH"
node_major="$(node -p 'process.versions.node.split(".")[0]')"
[ "$node_major" -ge 20 ] || missing "node $(node --version) is older than the UI's engines.node >=20"

export GOTOOLCHAIN=local GOFLAGS=-mod=mod CGO_ENABLED=0
argo_dir="$(cd "$here/../k8s" && go mod download -json "github.com/argoproj/argo-workflows/v4@${ARGO_VERSION}" \
  | python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])')"
ui_ref="$(python3 - "$argo_dir/ui/package.json" <<'PY'
import json, sys
dep = json.load(open(sys.argv[1]))["dependencies"]["argo-ui"]
print(dep.rsplit("#", 1)[1])
PY
)"
key="$( (echo "$ARGO_VERSION $ui_ref node$node_major yarn$YARN_VERSION"; cat "$argo_dir/ui/yarn.lock" "$0") \
  | sha256sum | cut -c1-16)"
out="$cache_root/$key"
if [ -x "$out/argo" ] && [ -f "$out/app/index.html" ]; then
  echo "argo-ui/build.sh: cache hit $out" >&2
  echo "$out/argo"
  exit 0
fi
if [ "${1:-}" = "--cached" ]; then
  echo "argo-ui/build.sh: not built for argo ${ARGO_VERSION} and argo-ui ${ui_ref:0:7} (run tools/argo-ui/build.sh)" >&2
  exit 4
fi

work="$(mktemp -d "${TMPDIR:-/tmp}/argo-ui.XXXXXX")"
trap 'rm -rf "$work"' EXIT
# complete DIR: whether DIR has argo-ui's package.json and every entry of its "files" (src and v2 at this ref).
complete() {
  python3 - "$1" <<'PY'
import json, sys
from pathlib import Path

root = Path(sys.argv[1])
if not (root / "package.json").is_file():
    sys.exit("argo-ui/build.sh: the argo-ui source has no package.json")
lacking = [f for f in json.loads((root / "package.json").read_text()).get("files", []) if not (root / f).exists()]
if lacking:
    sys.exit(f"argo-ui/build.sh: the argo-ui source lacks {', '.join(lacking)}, which its package.json ships")
PY
}
mkdir -p "$work/argo-ui"
source_ok=0
if [ -n "${ARGO_UI_TARBALL:-}" ]; then
  [ -f "$ARGO_UI_TARBALL" ] || missing "ARGO_UI_TARBALL=$ARGO_UI_TARBALL is not a file"
  tar -xzf "$ARGO_UI_TARBALL" -C "$work/argo-ui"
  if complete "$work/argo-ui"; then source_ok=1; else rm -rf "$work/argo-ui" && mkdir -p "$work/argo-ui"; fi
fi
if [ "$source_ok" = 0 ]; then
  url="https://codeload.github.com/argoproj/argo-ui/tar.gz/$ui_ref"
  echo "argo-ui/build.sh: fetching argo-ui $ui_ref from $url" >&2
  curl -fsSL --retry 3 --max-time 120 "$url" -o "$work/argo-ui.tgz" \
    || missing "no complete argo-ui source: ARGO_UI_TARBALL=${ARGO_UI_TARBALL:-(not set)}, and $url could not be fetched"
  tar -xzf "$work/argo-ui.tgz" -C "$work/argo-ui" --strip-components=1
  complete "$work/argo-ui" || missing "the argo-ui source from $url is incomplete"
fi

# The UI builds inside a writable copy of the whole module: webpack reads ../api/ (the OpenAPI and JSON schemas);
# the same copy, with the built app in place, is what the binary is linked from.
cp -r "$argo_dir" "$work/argo-src" && chmod -R u+w "$work/argo-src"
mv "$work/argo-ui" "$work/argo-src/argo-ui"
ui="$work/argo-src/ui"
python3 - "$ui" "$ui_ref" <<'PY'
import json, re, sys
from pathlib import Path

ui, ref = Path(sys.argv[1]), sys.argv[2]
pinned = f"git+https://github.com/argoproj/argo-ui.git#{ref}"
pkg = json.loads((ui / "package.json").read_text())
assert pkg["dependencies"]["argo-ui"] == pinned, pkg["dependencies"]["argo-ui"]
pkg["dependencies"]["argo-ui"] = "file:../argo-ui"
(ui / "package.json").write_text(json.dumps(pkg, indent=4) + "\n")
lock = (ui / "yarn.lock").read_text()
entry = f'"argo-ui@{pinned}":\n'
assert lock.count(entry) == 1, "yarn.lock has no single argo-ui entry"
lock = lock.replace(entry, '"argo-ui@file:../argo-ui":\n')
lock, n = re.subn(rf'\n  resolved "{re.escape(pinned)}"', "", lock)
assert n == 1, "yarn.lock: the argo-ui entry's resolved line"
(ui / "yarn.lock").write_text(lock)
PY

export YARN_CACHE_FOLDER="$cache_root/yarn-cache" npm_config_update_notifier=false
yarn=(npx --yes "yarn@${YARN_VERSION}")
echo "argo-ui/build.sh: yarn install, then webpack (argo ${ARGO_VERSION}, argo-ui ${ui_ref:0:7}, node ${node_major})" >&2
(cd "$ui" && "${yarn[@]}" install --non-interactive --frozen-lockfile --network-timeout 600000 >&2)
(cd "$ui" && VERSION="$ARGO_VERSION" "${yarn[@]}" build >&2)
find "$ui/dist/app" -name '*.map' -delete
[ -f "$ui/dist/app/index.html" ] || missing "the UI build made no dist/app/index.html"
rm -rf "$ui/node_modules"  # not part of the module: go build would walk it

# The CLI embeds ui/dist/app (go:embed), stamped as tools/k8s/build.sh stamps it.
stage="$cache_root/$key.partial.$$"
mkdir -p "$stage"
argo_pkg=github.com/argoproj/argo-workflows/v4
(cd "$work/argo-src" && go build -trimpath -ldflags "-s -w -X ${argo_pkg}.version=${ARGO_VERSION} \
  -X ${argo_pkg}.gitTag=${ARGO_VERSION} -X ${argo_pkg}.gitCommit=${ARGO_COMMIT} -X ${argo_pkg}.gitTreeState=clean" \
  -o "$stage/argo" ./cmd/argo)
cp -r "$ui/dist/app" "$stage/app"
rm -rf "$out" && mv "$stage" "$out"
for old in "$cache_root"/*/; do
  case "${old%/}" in "$out" | "$cache_root/yarn-cache") ;; *) rm -rf "$old" ;; esac
done
echo "$out/argo"
