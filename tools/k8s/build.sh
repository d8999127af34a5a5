#!/usr/bin/env bash
# Builds the real-controller tier's control plane from Go modules: kube-apiserver, kube-controller-manager,
# kube-scheduler (k8s.io/kubernetes), etcd, the JobSet controller and kwok, at the versions tools/k8s/go.mod pins,
# Argo's workflow-controller at ARGO_VERSION, whose module also holds the CRDs the tier applies (read from the
# module cache, never copied), and Shopify's toxiproxy-server at TOXIPROXY_VERSION (a TCP proxy whose faults the
# chaos tests set: latency, reset, timeout, bandwidth; tests/k8s/toxiproxy.py), and the `argo` CLI at ARGO_VERSION
# (what users submit, watch and stop runs with; the tier drives the shipped workflows with it).
#
# Idempotent: the binaries go to $JAXREC_K8S_CACHE/<key>/bin (default ~/.cache/jaxrec-k8s), where <key> is the
# sha256 of go.mod, go.sum, this script and `go version`. A hit prints the directory and returns at once.
# The bin directory is the last line of stdout; everything else goes to stderr.
#
#   tools/k8s/build.sh               build, or reuse a complete build
#   tools/k8s/build.sh --print-dir   print the directory of a complete build; exit 1 (building nothing) if none
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache_root="${JAXREC_K8S_CACHE:-$HOME/.cache/jaxrec-k8s}"
# Argo is not part of the tools module (its k8s 0.33 dependencies would be raised to 0.36 there); the newest
# version the module proxy serves. docs/DEPLOY.md installs v4.1.2 on clusters.
ARGO_VERSION=v4.0.5
# The commit ARGO_VERSION tags (github.com/argoproj/argo-workflows, `git rev-parse v4.0.5^{commit}`): stamped into
# the CLI so that `argo version` says v4.0.5 (the module proxy serves no VCS origin to read it from).
ARGO_COMMIT=0ab1452144d8f4d57c50b37ce50dad218868e950
# toxiproxy is not part of the tools module either (its own go.mod and go.sum); the newest version the module
# proxy serves. Built from github.com/Shopify/toxiproxy/v2/cmd/server, installed as toxiproxy-server.
TOXIPROXY_VERSION=v2.5.0
export GOTOOLCHAIN=local GOFLAGS=-mod=mod CGO_ENABLED=0

command -v go >/dev/null || { echo "build.sh: no 'go' on PATH; the real-controller tier needs Go 1.26 (go.dev/doc/install)" >&2; exit 2; }
key="$( { cat "$here/go.mod" "$here/go.sum" "$here/build.sh"; go version; } | sha256sum | cut -c1-16)"
bin="$cache_root/$key/bin"
names=(kube-apiserver kube-controller-manager kube-scheduler etcd jobset kwok workflow-controller toxiproxy-server argo)
complete() {
  for n in "${names[@]}"; do [ -x "$bin/$n" ] || return 1; done
  [ -f "$bin/modules.json" ] || return 1
  # The module cache may have been cleaned since: the tier reads CRDs and webhooks from it.
  python3 -c 'import json, os, sys; sys.exit(not all(os.path.isdir(d) for d in json.load(open(sys.argv[1])).values()))' "$bin/modules.json"
}
if complete; then
  echo "build.sh: cache hit $bin" >&2
  echo "$bin"; exit 0
fi
if [ "${1:-}" = "--print-dir" ]; then
  echo "build.sh: no complete build for this go.mod, go.sum, script and Go ($bin)" >&2
  exit 1
fi

# A cold build needs about 2 GB of module downloads, 5 GB of build cache and 0.5 GB of binaries.
need_gb="${JAXREC_K8S_NEED_GB:-8}"
for d in "$cache_root" "$(go env GOCACHE)" "$(go env GOMODCACHE)"; do
  mkdir -p "$d"
  free_kb="$(df -Pk "$d" | awk 'NR == 2 {print $4}')"
  if [ "$free_kb" -lt $((need_gb * 1024 * 1024)) ]; then
    echo "build.sh: $((free_kb / 1024)) MiB free on the file system of $d; the control-plane build needs ${need_gb} GiB (set GOCACHE/GOMODCACHE/JAXREC_K8S_CACHE elsewhere or free space)" >&2
    exit 3
  fi
done

k8s_version="$(awk '$1 == "k8s.io/kubernetes" {print $2}' "$here/go.mod")"
minor="${k8s_version#v1.}"; minor="${minor%%.*}"
# Without these the API server reports v0.0.0-master (the values Kubernetes' own build stamps).
version_flags="-X k8s.io/component-base/version.gitVersion=${k8s_version} -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=${minor} -X k8s.io/component-base/version.gitTreeState=clean"
stage="$cache_root/$key/bin.partial.$$"
rm -rf "$stage"; mkdir -p "$stage"
trap 'rm -rf "$stage"' EXIT
cd "$here"
start=$(date +%s)
echo "build.sh: building kubernetes ${k8s_version}, etcd, jobset, kwok, argo ${ARGO_VERSION} (controller and CLI), toxiproxy ${TOXIPROXY_VERSION} into $bin (cold: tens of minutes on 2 cores)" >&2
go build -trimpath -ldflags "-s -w ${version_flags}" -o "$stage/" \
  k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kube-scheduler
go build -trimpath -ldflags "-s -w" -o "$stage/etcd" go.etcd.io/etcd/server/v3
go build -trimpath -ldflags "-s -w" -o "$stage/jobset" sigs.k8s.io/jobset
go build -trimpath -ldflags "-s -w" -o "$stage/kwok" sigs.k8s.io/kwok/cmd/kwok
# Its own `go install` (outside the tools module, with Argo's own go.mod and go.sum): cold about 6 min on 2 cores.
GOBIN="$stage" go install -trimpath -ldflags "-s -w" \
  "github.com/argoproj/argo-workflows/v4/cmd/workflow-controller@${ARGO_VERSION}"
# Likewise (cold well under a minute); `go install` names it after its directory (server). Version stamped as
# toxiproxy's .goreleaser.yml does (GET /version answers it).
GOBIN="$stage" go install -trimpath -ldflags "-s -w -X github.com/Shopify/toxiproxy/v2.Version=${TOXIPROXY_VERSION#v}" \
  "github.com/Shopify/toxiproxy/v2/cmd/server@${TOXIPROXY_VERSION}"
mv "$stage/server" "$stage/toxiproxy-server"
argo_dir="$(go mod download -json "github.com/argoproj/argo-workflows/v4@${ARGO_VERSION}" | python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])')"
# The CLI embeds the UI (ui/dist/app, go:embed) and the module cache is read-only: built from a writable copy with a
# placeholder page, as Argo's own Makefile does without a UI build. Version stamped as that Makefile stamps it.
argo_src="$stage/argo-src"
cp -r "$argo_dir" "$argo_src" && chmod -R u+w "$argo_src"
mkdir -p "$argo_src/ui/dist/app" && echo "Argo UI not built" > "$argo_src/ui/dist/app/index.html"
argo_pkg=github.com/argoproj/argo-workflows/v4
(cd "$argo_src" && go build -trimpath -ldflags "-s -w -X ${argo_pkg}.version=${ARGO_VERSION} \
  -X ${argo_pkg}.gitTag=${ARGO_VERSION} -X ${argo_pkg}.gitCommit=${ARGO_COMMIT} -X ${argo_pkg}.gitTreeState=clean" \
  -o "$stage/argo" ./cmd/argo)
rm -rf "$argo_src"
python3 - "$stage/modules.json" "$argo_dir" <<'PY'
import json, subprocess, sys
dirs = {m: subprocess.run(["go", "list", "-m", "-f", "{{.Dir}}", m], capture_output=True, text=True, check=True).stdout.strip()
        for m in ("k8s.io/kubernetes", "sigs.k8s.io/jobset", "sigs.k8s.io/kwok")}
dirs["github.com/argoproj/argo-workflows/v4"] = sys.argv[2]
json.dump(dirs, open(sys.argv[1], "w"), indent=1)
PY
rm -rf "$bin"; mv "$stage" "$bin"; trap - EXIT
# Older keys are other versions of this script or module: keep only the newest build.
for old in "$cache_root"/*/; do [ "${old%/}" = "$cache_root/$key" ] || rm -rf "$old"; done
echo "build.sh: built in $(( $(date +%s) - start )) s" >&2
echo "$bin"
