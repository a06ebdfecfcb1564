#!/usr/bin/env bash
# Debian/Ubuntu libraries that make dflash-mac fast or testable on Linux, installed with apt
# where this shell may (root); one line each when it cannot. Used by `make run` (openblas)
# and .ci/run (all three). Args: openblas, tcmalloc, tmux.
set -uo pipefail
[ "$(uname -s)" = Linux ] || exit 0
have() {
  case "$1" in
    openblas) ls /usr/lib/*-linux-gnu/libopenblas.so.0 >/dev/null 2>&1 ;;
    tcmalloc) ls /usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4 >/dev/null 2>&1 ;;
    tmux) command -v tmux >/dev/null 2>&1 ;;
  esac
}
package() {
  case "$1" in
    openblas) echo libopenblas0-pthread ;;  # MLX's CPU fp32 matmuls, ~2x the decode speed
    tcmalloc) echo libtcmalloc-minimal4 ;;  # the suite's allocator (Makefile: test)
    tmux) echo tmux ;;  # the chat end-to-end test's terminal
  esac
}
updated=0
for lib in "$@"; do
  have "$lib" && continue
  pkg=$(package "$lib")
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "note: $pkg is not installed; install it with: sudo apt-get install $pkg"
    continue
  fi
  echo "installing $pkg (apt-get)"
  if [ "$updated" = 0 ]; then apt-get update -qq >/dev/null 2>&1; updated=1; fi
  apt-get install -y -qq "$pkg" >/dev/null 2>&1 \
    || echo "warning: could not install $pkg; install it with: sudo apt-get install $pkg"
done
exit 0
