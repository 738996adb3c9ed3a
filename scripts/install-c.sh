#!/bin/sh
# Installs oxccl's C API: PREFIX/lib/liboxccl.so and liboxccl.a, PREFIX/include/oxccl.h, and
# PREFIX/lib/pkgconfig/oxccl.pc. Then:
#   export PKG_CONFIG_PATH=PREFIX/lib/pkgconfig
#   cc example.c $(pkg-config --cflags --libs oxccl) -Wl,-rpath,$(pkg-config --variable=libdir oxccl)
# Statically: PREFIX/lib/liboxccl.a followed by oxccl.pc's Libs.private.
#
# Usage: scripts/install-c.sh PREFIX [--profile PROFILE] [--target-dir DIR] [--no-build]
#   --profile     cargo profile to build and install (default: release)
#   --target-dir  cargo's target directory (default: $CARGO_TARGET_DIR, else ./target)
#   --no-build    install what is built already
set -eu
usage() { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[ $# -ge 1 ] || usage
prefix=$1; shift
profile=release
target=${CARGO_TARGET_DIR:-}
build=1
while [ $# -gt 0 ]; do
  case $1 in
    --profile) profile=$2; shift 2 ;;
    --target-dir) target=$2; shift 2 ;;
    --no-build) build=0; shift ;;
    *) usage ;;
  esac
done
root=$(cd "$(dirname "$0")/.." && pwd)
[ -n "$target" ] || target=$root/target
case $profile in dev|test) dir=debug ;; bench) dir=release ;; *) dir=$profile ;; esac
if [ $build = 1 ]; then
  (cd "$root" && cargo build --profile "$profile" --target-dir "$target" -p oxccl-c)
fi
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/crates/oxccl-c/Cargo.toml" | head -n 1)
mkdir -p "$prefix/lib/pkgconfig" "$prefix/include"
prefix=$(cd "$prefix" && pwd)
cp "$target/$dir/liboxccl.so" "$target/$dir/liboxccl.a" "$prefix/lib/"
cp "$root/crates/oxccl-c/include/oxccl.h" "$prefix/include/"
# Static linking needs what the Rust standard library links (and dlopen, with which the ofi
# provider, when built in, loads libfabric).
private="-lpthread -ldl -lm"
cat > "$prefix/lib/pkgconfig/oxccl.pc" <<PC
prefix=$prefix
libdir=\${prefix}/lib
includedir=\${prefix}/include

Name: oxccl
Description: Collective communication over the oxccl verbs (C API, shaped like NCCL)
Version: $version
Cflags: -I\${includedir}
Libs: -L\${libdir} -loxccl
Libs.private: $private
PC
echo "installed oxccl $version ($profile) in $prefix"
