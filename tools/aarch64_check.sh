#!/usr/bin/env bash
# The aarch64 check (docs/install-a-box.md, "Checking aarch64 on an x86 machine"): an arm64
# Debian root filesystem under qemu-user, the pinned llama.cpp cross-built for the Pi 5
# and the Jetson Orin's CPU, edgebus installed in it without torch as docs/install-a-box.md
# tells a Pi, the suite's torch-free tests, then a 3-stage plant of the bundled GGUF
# under `edgebus up`, held token for token to llama.cpp run whole on the same CPU.
#
# Run as root on an x86_64 Debian/Ubuntu host:  sudo tools/aarch64_check.sh
# It installs the host tools it lacks (HOST_PACKAGES below) with apt-get.
# Environment (all optional):
#   EDGEBUS_ARM_CACHE  what a second run reuses: the root filesystem's tarball, the
#                      llama.cpp sdist and libraries, pip's cache (default
#                      /var/cache/edgebus-aarch64)
#   EDGEBUS_ARM_TESTS  the test files to run (default: TESTS below); "all" runs every
#                      test file, which takes hours under emulation
#   EDGEBUS_ARM_CPU    the emulated core (default cortex-a76)
#   EDGEBUS_ARM_LLAMAFILE  ON builds llama.cpp with llamafile's matrix kernels, as pip
#                      does by default (default OFF, as a box builds it)
#   EDGEBUS_ARM_REUSE_INSTALL=1  keep the previous run's root filesystem and its
#                      install, edgebus itself reinstalled from the checkout without
#                      its dependencies (for trying changes to edgebus only)
#   EDGEBUS_ARM_MIXED_PYTHON  an x86 python with edgebus installed: then a mixed plant
#                      too, x86 coordinator and stage-0 with aarch64 stages
#                      (tools/aarch64_mixed.py)
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${EDGEBUS_ARM_CACHE:-/var/cache/edgebus-aarch64}
SUITE=bookworm
# The Pi 5's Cortex-A76 and the Jetson Orin's Cortex-A78AE are both ARMv8.2-A with dot
# product and half-precision arithmetic, and neither has i8mm or SVE: llama.cpp compiles
# the same kernels for both, so one build serves the two boards.
ARM_ARCH=armv8.2-a+dotprod+fp16
# qemu has no Cortex-A78AE model (7.2 has cortex-a76 and neoverse-n1, the same ISA); the
# A76 is the Pi 5's core exactly and stands for the Orin's features too.
CPU=${EDGEBUS_ARM_CPU:-cortex-a76}
# llamafile's tinyBLAS computes a Q8_0 or Q4_0 product of 2 rows or more otherwise than
# one row at a time on ARM, so a box built with it cannot batch rows exactly
# (docs/row-exactness.md): the boxes build without it, as docs/install-a-box.md says, and
# so does the check. ON builds the pip default, to compare.
LLAMAFILE=${EDGEBUS_ARM_LLAMAFILE:-OFF}
# What a stage box runs, fast enough under emulation (a core ~20x slower than the host's,
# ~25 minutes for test_llamacpp's fast tests on a loaded 2-core host): a stage file holds
# its layers only, a chain of 3 stages gives the whole model's logits bit for bit, and
# the engine's weight placement keeps rows exact (tests/test_llamacpp_placement.py).
TESTS=${EDGEBUS_ARM_TESTS:-"tests/test_llamacpp.py tests/test_llamacpp_placement.py -k 'stage_file_holds or hidden_states_of_a_stage or llamacpp_placement'"}
# Packages the root filesystem needs: Python with venv and headers (edgebus compiles two
# small C files), a compiler for them and for llama-cpp-python's stub build, and the broker.
ROOTFS_PACKAGES=python3,python3-venv,python3-dev,gcc,g++,make,cmake,ca-certificates,mosquitto
# What the host needs, each package for the command beside it: qemu runs the arm64
# programs, binfmt-support hands them to it, debootstrap makes the root filesystem, the
# cross compilers and cmake build llama.cpp, patchelf points its libraries at each other,
# python3-pip fetches the sdist.
declare -A HOST_PACKAGES=(
    [qemu-aarch64-static]=qemu-user-static [update-binfmts]=binfmt-support
    [debootstrap]=debootstrap [aarch64-linux-gnu-gcc]=gcc-aarch64-linux-gnu
    [aarch64-linux-gnu-g++]=g++-aarch64-linux-gnu [cmake]=cmake [patchelf]=patchelf
)
# Another apt (a second helper, unattended upgrades) may hold dpkg's lock for a while.
APT_LOCK_WAIT_S=900

WORK=$CACHE/run
ROOTFS=$WORK/rootfs
TIMES=$WORK/times
PIN=$(sed -n 's/^PINNED = "\(.*\)"$/\1/p' "$REPO/node_agent/engines/llamacpp/library.py")
LIBS=$CACHE/llama.cpp-$PIN-$ARM_ARCH-llamafile-$LLAMAFILE
SDIST=$CACHE/sdist/llama_cpp_python-$PIN.tar.gz
ROOTFS_TAR=$CACHE/rootfs-$SUITE-arm64.tar
MOUNTS=()

# shellcheck source=tools/debian_check.sh
. "$REPO/tools/debian_check.sh"

cleanup() {
    unmount_all
    [[ -f $TIMES ]] && { log "times:"; cat "$TIMES" >&2; }
}
trap cleanup EXIT


host_tools() {
    [[ $(id -u) == 0 ]] || die "run as root (debootstrap, chroot, mounts)"
    local tool missing=()
    for tool in "${!HOST_PACKAGES[@]}"; do
        command -v "$tool" >/dev/null || missing+=("${HOST_PACKAGES[$tool]}")
    done
    python3 -m pip --version >/dev/null 2>&1 || missing+=(python3-pip)
    if ((${#missing[@]})); then
        log "installing ${missing[*]}"
        DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=$APT_LOCK_WAIT_S \
            update -qq || die "apt-get update"
        DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=$APT_LOCK_WAIT_S \
            install -y -qq "${missing[@]}" >"$WORK/apt.log" 2>&1 \
            || die "apt-get install ${missing[*]}: see $WORK/apt.log"
    fi
    [[ -n $PIN ]] || die "no PINNED version in node_agent/engines/llamacpp/library.py"
    # A container may come without binfmt_misc: the kernel then cannot hand arm64
    # executables to qemu.
    [[ -e /proc/sys/fs/binfmt_misc/status ]] \
        || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
    [[ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]] || update-binfmts --enable qemu-aarch64
    # `-cpu help` exits 1 after its list.
    [[ $(qemu-aarch64-static -cpu help || true) =~ [[:space:]]$CPU([[:space:]]|$) ]] \
        || die "qemu has no CPU model $CPU"
}


rootfs() {
    if [[ ${EDGEBUS_ARM_REUSE_INSTALL:-} == 1 && -x $ROOTFS/opt/edgebus/bin/edgebus ]]; then
        return
    fi
    debian_rootfs "$ROOTFS_TAR" "$ROOTFS" --arch=arm64 --include="$ROOTFS_PACKAGES" "$SUITE"
}

cross_build() {
    if [[ ! -f $SDIST ]]; then
        python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$PIN" \
            -d "$CACHE/sdist"
    fi
    [[ -f $LIBS/libllama.so ]] && { soname_links; return; }
    local src=$WORK/llama-src build=$WORK/llama-build
    rm -rf "$src" "$build" "$LIBS.part"
    mkdir -p "$src" "$LIBS.part"
    tar -C "$src" --strip-components=1 -xzf "$SDIST"
    cmake -S "$src/vendor/llama.cpp" -B "$build" -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_SYSTEM_NAME=Linux -DCMAKE_SYSTEM_PROCESSOR=aarch64 \
        -DCMAKE_C_COMPILER=aarch64-linux-gnu-gcc -DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++ \
        -DGGML_NATIVE=OFF -DGGML_CPU_ARM_ARCH="$ARM_ARCH" -DGGML_LLAMAFILE="$LLAMAFILE" \
        -DBUILD_SHARED_LIBS=ON \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_COMMON=OFF \
        >"$WORK/cmake.log" 2>&1 || die "cmake: see $WORK/cmake.log"
    cmake --build "$build" -j "$(nproc)" --target llama >>"$WORK/cmake.log" 2>&1 \
        || die "the cross build: see $WORK/cmake.log"
    # The libraries find each other beside themselves, wherever they are copied.
    find "$build" -name '*.so' -exec cp -L {} "$LIBS.part/" \;
    patchelf --set-rpath '$ORIGIN' "$LIBS.part"/*.so
    rm -rf "$src" "$build"
    mv "$LIBS.part" "$LIBS"
    soname_links
}

soname_links() {  # each library also under the name the others load it by (libggml.so.0)
    local lib soname
    for lib in "$LIBS"/*.so; do
        soname=$(patchelf --print-soname "$lib")
        [[ -z $soname || -e $LIBS/$soname ]] || ln -s "$(basename "$lib")" "$LIBS/$soname"
    done
}

bind() {  # bind SOURCE TARGET-IN-ROOTFS
    mkdir -p "$ROOTFS$2"
    mount --rbind "$1" "$ROOTFS$2"
    # Unmounting the copy must never unmount the host's own /dev or /sys.
    mount --make-rslave "$ROOTFS$2"
    MOUNTS+=("$ROOTFS$2")
}

enter() {
    mkdir -p "$CACHE/pip" "$CACHE/wheels" "$ROOTFS/proc" "$ROOTFS/check/src"
    mount -t proc proc "$ROOTFS/proc"
    MOUNTS+=("$ROOTFS/proc")
    bind /dev /dev
    bind /sys /sys
    bind "$CACHE" /check/cache
    cp /etc/resolv.conf "$ROOTFS/etc/resolv.conf"
    # pip inside trusts what the host trusts (a proxy's own CA, say).
    cp /etc/ssl/certs/ca-certificates.crt "$ROOTFS/etc/ssl/certs/host-ca.crt"
    # The project as a clean clone would have it: tracked and new files, nothing ignored
    # (no x86 build of the C helpers).
    git -C "$REPO" ls-files -z -co --exclude-standard \
        | tar -C "$REPO" --null --ignore-failed-read -T - -cf - | tar -C "$ROOTFS/check/src" -xf -
}

in_rootfs() {  # a command inside, on the emulated CPU
    "$WORK/in-rootfs" "$@"
}

write_in_rootfs() {  # as a command of its own, which tools/aarch64_mixed.py runs too
    cat >"$WORK/in-rootfs" <<END
#!/bin/sh
# Runs its arguments in $ROOTFS on an emulated $CPU (tools/aarch64_check.sh).
# qemu reads QEMU_CPU when the kernel hands it the first aarch64 program; env -i keeps it.
QEMU_CPU=$CPU exec chroot "$ROOTFS" /usr/bin/env -i QEMU_CPU=$CPU HOME=/root LANG=C.UTF-8 \\
    PATH=/opt/edgebus/bin:/usr/sbin:/usr/bin:/sbin:/bin \\
    PIP_CERT=/etc/ssl/certs/host-ca.crt SSL_CERT_FILE=/etc/ssl/certs/host-ca.crt \\
    PIP_CACHE_DIR=/check/cache/pip PIP_DISABLE_PIP_VERSION_CHECK=1 "\$@"
END
    chmod +x "$WORK/in-rootfs"
}

install_edgebus() {
    if [[ ${EDGEBUS_ARM_REUSE_INSTALL:-} != 1 || ! -x $ROOTFS/opt/edgebus/bin/edgebus ]]; then
        install_packages
    else  # the tests and the plant run the installed package, not the checkout
        in_rootfs pip install -q --no-deps --force-reinstall /check/src
    fi
    # llama-cpp-python's package holds no library of its own: the cross-built ones go into
    # llama_cpp/lib, where the package and the engine look for them.
    local lib
    # Found, not imported: llama_cpp loads its library at import.
    lib=$(in_rootfs python -c 'import importlib.util as u
print(u.find_spec("llama_cpp").submodule_search_locations[0])')/lib
    mkdir -p "$ROOTFS$lib"
    cp -a "$LIBS"/. "$ROOTFS$lib/"
    if in_rootfs python -c 'import torch' 2>/dev/null; then die "torch came in"; fi
}

install_packages() {
    in_rootfs python3 -m venv /opt/edgebus
    # llama-cpp-python's Python half: its build compiles no library here (that would take
    # hours under emulation); the cross-built ones go into llama_cpp/lib, where the
    # package and the engine look for them.
    if ! ls "$CACHE/wheels"/llama_cpp_python-"$PIN"-*aarch64*.whl >/dev/null 2>&1; then
        in_rootfs env CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" pip wheel -q --no-deps \
            --no-binary llama-cpp-python -w /check/cache/wheels \
            "/check/cache/sdist/$(basename "$SDIST")"
    fi
    in_rootfs sh -c "pip install -q /check/cache/wheels/llama_cpp_python-$PIN-*aarch64*.whl"
    # As docs/install-a-box.md tells a Pi, "A box without torch": the base package, with the
    # tools the suite needs on it (no torch either).
    in_rootfs pip install -q "/check/src[test-base]"
}

torch_free_tests() {
    local tests=$TESTS
    [[ $tests == all ]] && tests=tests
    # -P: the installed package, not the source tree's (whose C helpers are not built).
    in_rootfs sh -c "cd /check/src && python -P -m pytest -q -rs -p no:cacheprovider $tests"
}

plant() {
    in_rootfs python /check/src/tools/aarch64_plant.py
}

mixed_plant() {
    "$EDGEBUS_ARM_MIXED_PYTHON" "$REPO/tools/aarch64_mixed.py" --rootfs "$ROOTFS" \
        --in-rootfs "$WORK/in-rootfs"
}

mkdir -p "$WORK"
: >"$TIMES"
log "llama-cpp-python $PIN for $ARM_ARCH on $CPU; cache $CACHE"
step "host tools" host_tools
# The cross build runs on the host while debootstrap's second stage runs under qemu.
step "llama.cpp cross build" cross_build &
build=$!
step "root filesystem" rootfs
wait "$build" || die "the cross build"
enter
write_in_rootfs
step "install without torch" install_edgebus
step "torch-free tests" torch_free_tests
step "3-stage plant vs whole" plant
if [[ -n ${EDGEBUS_ARM_MIXED_PYTHON:-} ]]; then step "mixed x86/aarch64 plant" mixed_plant; fi
log "PASSED"
