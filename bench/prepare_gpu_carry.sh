#!/usr/bin/env bash
# prepare_gpu_carry.sh: copies the header-only dependencies that the GPU machine lacks into
# third_party_carry/include (git-ignored), so bench/gpu_suite.sh can build there offline.
#
#   bench/prepare_gpu_carry.sh [DEST]      # DEST defaults to <repo>/third_party_carry
#
# What it copies
# - Boost: the include closure of every boost header the repo's sources include plus every
#   boost/intrusive/*.hpp (so new Boost.Intrusive uses need no new carry), as the compiler here
#   resolves it; then, for each boost component in that closure (intrusive, move, config, ...),
#   the whole component directory, because other compilers select other headers (boost/config
#   picks a compiler file by macro). Plus boost/version.hpp, which CMake's FindBoost reads.
# - doctest: the whole doctest/ include directory.
# It then proves the copy is closed: the same translation unit compiled with -I DEST/include
# must take every boost header from DEST (g++ -H), and prints the size.
#
# Env: BOOST_INCLUDE, DOCTEST_INCLUDE (default /usr/include), CXX (default c++).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
dest=${1:-$repo/third_party_carry}
boost_src=${BOOST_INCLUDE:-/usr/include}
doctest_src=${DOCTEST_INCLUDE:-/usr/include}
cxx=${CXX:-c++}

[[ -f $boost_src/boost/version.hpp ]] || { echo "no Boost headers under $boost_src" >&2; exit 1; }
[[ -f $doctest_src/doctest/doctest.h ]] || { echo "no doctest headers under $doctest_src" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# 1. The roots: what the repo includes, and all of Boost.Intrusive.
{
  grep -rhoE '#include <boost/[^>]+>' "$repo" --include='*.hpp' --include='*.cpp' --include='*.h' \
       --include='*.cu' --include='*.cuh' --exclude-dir='third_party_carry' --exclude-dir='build*' || true
  for h in "$boost_src"/boost/intrusive/*.hpp; do echo "#include <${h#"$boost_src"/}>"; done
  echo '#include <boost/version.hpp>'
} | sort -u > "$work/roots.cpp"

# 2. Their closure, as this compiler resolves it.
"$cxx" -std=c++20 -M -I "$boost_src" "$work/roots.cpp" -o "$work/deps.mk"
tr ' \\' '\n\n' < "$work/deps.mk" | grep "^$boost_src/boost/" | sort -u > "$work/closure.txt"

# 3. Copy: whole component directories, and the top-level headers themselves.
rm -rf "$dest/include"
mkdir -p "$dest/include/boost"
while read -r file; do
  rel=${file#"$boost_src"/boost/}
  if [[ $rel == */* ]]; then
    component=${rel%%/*}
    [[ -d $dest/include/boost/$component ]] || cp -r "$boost_src/boost/$component" "$dest/include/boost/"
  else
    cp "$file" "$dest/include/boost/$rel"
  fi
done < "$work/closure.txt"
cp -r "$doctest_src/doctest" "$dest/include/"

# 4. Prove it is closed: every boost header must now come from the carry.
"$cxx" -std=c++20 -fsyntax-only -H -I "$dest/include" "$work/roots.cpp" 2> "$work/used.txt"
if grep -qE "^\.+ $boost_src/boost/" "$work/used.txt"; then
  echo "the carry is not closed; headers still taken from $boost_src:" >&2
  grep -E "^\.+ $boost_src/boost/" "$work/used.txt" | head -20 >&2
  exit 1
fi
echo '#include <doctest/doctest.h>' > "$work/doctest.cpp"
"$cxx" -std=c++20 -fsyntax-only -I "$dest/include" "$work/doctest.cpp"

boost_version=$(sed -n 's/^#define BOOST_LIB_VERSION "\(.*\)"/\1/p' "$boost_src/boost/version.hpp")
doctest_version=$(sed -n 's/^#define DOCTEST_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\).*/\2/p' \
                  "$doctest_src/doctest/doctest.h" | paste -sd.)
{
  echo "Prepared by bench/prepare_gpu_carry.sh on $(date -u +%Y-%m-%dT%H:%M:%SZ) with $("$cxx" --version | head -1)"
  echo "boost $boost_version from $boost_src: $(wc -l < "$work/closure.txt") headers in the closure;" \
       "components: $(ls "$dest/include/boost" | tr '\n' ' ')"
  echo "doctest $doctest_version from $doctest_src"
} > "$dest/MANIFEST.txt"

size=$(du -sh "$dest" | cut -f1)
packed=$(tar -C "$dest" -czf - . | wc -c)
echo "third_party_carry ready at $dest: $size on disk, $((packed / 1024)) KiB gzipped"
cat "$dest/MANIFEST.txt"
