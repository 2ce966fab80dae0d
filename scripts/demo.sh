#!/usr/bin/env bash
# Install everything, then the main job on the embedded file:// store: mount, torch.save a model,
# wait until it is durable in the store, show status and the object, unmount.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh demo
. .venv/bin/activate

demo=${CKPTFS_DEMO_DIR:-/tmp/ckptfs-demo}
store=$demo/bucket mnt=$demo/checkpoints cache=$demo/cache
# A mount left by an earlier run, or the guard its unmount left on the bare directory, goes first.
if mountpoint -q "$mnt" 2>/dev/null; then
  ckptfs umount "$mnt" 2>/dev/null || ckptfs unguard "$mnt" 2>/dev/null || fusermount3 -u -z "$mnt"
  ckptfs unguard "$mnt" 2>/dev/null || true
fi
rm -rf "$demo"  # every run starts from an empty store and cache
mkdir -p "$store" "$mnt"

set -x
ckptfs mount "file://$store" "$mnt" --cache-dir "$cache" --upload-delay 1 --daemon
python - "$mnt/step_100.pt" <<'PY'
import sys, time, torch
torch.manual_seed(0)
layer = torch.nn.TransformerEncoderLayer(d_model=512, nhead=8, dim_feedforward=2048, batch_first=True)
model = torch.nn.TransformerEncoder(layer, num_layers=6)
start = time.perf_counter()
torch.save(model.state_dict(), sys.argv[1])
print(f"torch.save of {sum(p.numel() for p in model.parameters()):,} parameters returned in "
      f"{time.perf_counter() - start:.2f}s")
PY
python -c 'import os, sys; print("user.ckptfs.state =", os.getxattr(sys.argv[1], "user.ckptfs.state").decode())' "$mnt/step_100.pt"
ckptfs flush "$mnt" --timeout 60
ckptfs status "$mnt"
ls -l "$store"
cmp "$mnt/step_100.pt" "$store/step_100.pt"
ckptfs umount "$mnt"
ls "$mnt"  # the guard: writes into the bare directory fail until the next mount
set +x
echo "demo done: $store/step_100.pt is byte-identical to what torch.save wrote"
