#!/usr/bin/env bash
# pip_install_check: `pip install --no-build-isolation .` (the README's way) builds the package
# against the interpreter's torch, and the installed copy imports and installs on the simulated
# device. Installs into a scratch --target, not into the environment. Skipped (exit 0) when the
# interpreter lacks scikit-build-core (the offline GPU machines).
#   tests/pip_install_check.sh <python> <source dir> <scratch dir>
set -euo pipefail
python=$1 src=$2 scratch=$3
if ! "$python" -c "import scikit_build_core" 2>/dev/null; then
  echo "SKIPPED: $python has no scikit-build-core"
  exit 0
fi
rm -rf "$scratch"
"$python" -m pip install -q --no-build-isolation --no-deps --target "$scratch/site" "$src"
cd "$scratch"
PYTHONPATH="$scratch/site" "$python" -c '
import spillway
assert spillway.__file__.startswith("'"$scratch"'/site"), spillway.__file__
spillway.install(backend="sim", budget="64MiB")
assert spillway.get_budget() == 64 << 20
print("pip install: ok,", spillway.__file__)'
