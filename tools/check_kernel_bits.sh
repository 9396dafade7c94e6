#!/usr/bin/env bash
# Builds tests/native/kernel_bits.cpp with the native kernels (no Python, no torch) and runs
# it: natively for x86-64 (every x86 ISA this CPU has; the others are skipped with the
# reason), and cross-compiled for aarch64 (g++-aarch64-linux-gnu, static) under
# qemu-aarch64 at SVE vector lengths of 128, 256 and 512 bits, where every aarch64 build
# (neon, neon_bf16, and the sve<bits>[_bf16] build of that length) must run and equal the
# scalar path bit for bit; plus short runs on emulated CPUs without SVE or BF16 (cortex-a57)
# and with 512-bit SVE but no BF16 (a64fx) that check what dispatch picks there.
# Before running, the kernel objects are disassembled: no fused multiply-add and no
# reciprocal (square-root) estimate may appear in any ISA build, and each object may export
# only its kernel_table getter.
# The ISA builds and their flags are read from setup.py, so this builds what pip builds.
# Usage: tools/check_kernel_bits.sh [x86|aarch64|all]   (default: all). Needs g++; for
# aarch64 also g++-aarch64-linux-gnu and qemu-user (Debian package names). Exit status 0
# only when every check passes.
set -euo pipefail
cd "$(dirname "$0")/.."
which_arch=${1:-all}
out=${KERNEL_BITS_BUILD:-build/kernel_bits}
jobs=$(nproc 2>/dev/null || echo 2)

# "name target_id flags..." per ISA build of setup.py for one architecture, then a line
# "common flags...". NOTE: setup.py is executed with setuptools and pybind11 stubbed out:
# only its tables of targets and flags are read.
isa_builds() {
    python3 - "$1" <<'EOF'
import sys, types
for name in ("setuptools", "setuptools.command", "setuptools.command.build_ext", "pybind11"):
    sys.modules[name] = types.ModuleType(name)
sys.modules["setuptools"].setup = lambda **kw: None
sys.modules["setuptools"].Extension = lambda *a, **kw: None
sys.modules["setuptools.command.build_ext"].build_ext = object
sys.modules["pybind11"].get_include = lambda: ""
g = {"__name__": "setup_tables"}
exec(compile(open("setup.py").read(), "setup.py", "exec"), g)
targets, ids = (g["X86_TARGETS"], g["TARGET_IDS"]) if sys.argv[1] == "x86" else \
               (g["AARCH64_TARGETS"], g["AARCH64_TARGET_IDS"])
for name, flags in targets.items():
    print(name, ids[name], *flags)
print("common", *g["COMMON_FLAGS"])
EOF
}

# build ARCH CXX: objects of every ISA build plus the driver, linked into $out/ARCH/kernel_bits.
build() {
    local arch=$1 cxx=$2 dir=$out/$1 common extra=()
    mkdir -p "$dir"
    common=$(isa_builds "$arch" | sed -n 's/^common //p')
    local objs=() pids=()
    while read -r name id flags; do
        [ "$name" = common ] && continue
        # shellcheck disable=SC2086
        $cxx $common $flags -DCPU_OFFLOAD_TARGET="$id" -c csrc/kernels/isa_target.cpp -o "$dir/isa_$name.o" &
        pids+=($!)
        objs+=("$dir/isa_$name.o")
        if [ ${#pids[@]} -ge "$jobs" ]; then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
    done < <(isa_builds "$arch")
    for src in csrc/dispatch.cpp csrc/pool.cpp csrc/batch.cpp tests/native/kernel_bits.cpp; do
        # shellcheck disable=SC2086
        $cxx $common -c "$src" -o "$dir/$(basename "$src" .cpp).o" &
        pids+=($!)
        objs+=("$dir/$(basename "$src" .cpp).o")
        if [ ${#pids[@]} -ge "$jobs" ]; then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
    done
    if [ "$arch" = aarch64 ]; then
        # shellcheck disable=SC2086
        $cxx $common -march=armv8.2-a+sve -c tests/native/sve_probe.cpp -o "$dir/sve_probe.o"
        objs+=("$dir/sve_probe.o")
        extra=(-static)  # qemu-aarch64 then needs no aarch64 libraries
    fi
    for p in "${pids[@]}"; do wait "$p"; done
    $cxx "${objs[@]}" -pthread "${extra[@]}" -o "$dir/kernel_bits"
}

# no_fused OBJDUMP PATTERN OBJECTS...: fails if a fused or estimated instruction appears.
no_fused() {
    local objdump=$1 pattern=$2 hits
    shift 2
    hits=$("$objdump" -d --no-show-raw-insn "$@" | grep -E "$pattern" || true)
    if [ -n "$hits" ]; then
        echo "FAIL: fused multiply-add or estimate instructions in the kernel builds:"
        echo "$hits" | head -20
        return 1
    fi
    echo "disassembly: no fused multiply-add, no reciprocal estimate in $# kernel objects"
}

# only_getter NM OBJECTS...: each ISA object must define one global symbol, its table getter,
# and no weak ones: a weak (COMDAT) inline function compiled for a wider ISA could be the
# copy the linker keeps for every caller, and fault on a CPU without that ISA.
only_getter() {
    local nm=$1 o bad=0
    shift
    for o in "$@"; do
        if [ "$("$nm" -g --defined-only "$o" | grep -cv ' T .*kernel_table_')" != 0 ]; then
            echo "FAIL: $o defines more than its kernel_table getter:"
            "$nm" -C -g --defined-only "$o" | head -10
            bad=1
        fi
    done
    [ $bad = 0 ] && echo "symbols: each of $# kernel objects defines only its kernel_table getter"
    return $bad
}

status=0
if [ "$which_arch" = x86 ] || [ "$which_arch" = all ]; then
    if [ "$(uname -m)" = x86_64 ]; then
        echo "== x86-64 (native)"
        t0=$SECONDS
        build x86 "${CXX:-g++}"
        no_fused objdump '\s(v?f(n)?m(add|sub)[0-9a-z]*|vfmaddsub[0-9a-z]*|vfmsubadd[0-9a-z]*|v?rcp[0-9a-z]*|v?rsqrt[0-9a-z]*)\s' \
            "$out"/x86/isa_*.o || status=1
        only_getter nm "$out"/x86/isa_*.o || status=1
        echo "built in $((SECONDS - t0)) s"
        t0=$SECONDS
        "$out/x86/kernel_bits" --require=scalar || status=1
        echo "ran in $((SECONDS - t0)) s"
    else
        echo "== x86-64: skipped (this machine is $(uname -m))"
    fi
fi
if [ "$which_arch" = aarch64 ] || [ "$which_arch" = all ]; then
    echo "== aarch64 (cross build, qemu-aarch64)"
    t0=$SECONDS
    build aarch64 aarch64-linux-gnu-g++
    no_fused aarch64-linux-gnu-objdump '\s(f(n)?m(la|ls|ad|sb|add|sub)|bfml[a-z]*|frecp[esx]|frsqrt[es])\s' \
        "$out"/aarch64/isa_*.o || status=1
    only_getter aarch64-linux-gnu-nm "$out"/aarch64/isa_*.o || status=1
    echo "built in $((SECONDS - t0)) s"
    bin=$out/aarch64/kernel_bits
    qemu=${QEMU_AARCH64:-qemu-aarch64}
    # NOTE: qemu-user's "max" CPU has SVE (up to 2048 bits) and BF16; the property
    # sve-default-vector-length (in bytes) sets the length the process starts with, and
    # the driver prints svcntb() and fails unless it is the one asked for.
    # NOTE: scalar, neon and neon_bf16 do not depend on the SVE length: they run in the
    # 128-bit pass only; the 256- and 512-bit passes run the SVE builds of their length.
    for bits in 128 256 512; do
        echo "-- SVE vector length $bits bits"
        t1=$SECONDS
        isas=sve$bits,sve${bits}_bf16
        [ $bits = 128 ] && isas=scalar,neon,neon_bf16,$isas
        pick=sve${bits}_bf16
        [ $bits = 128 ] && pick=neon_bf16
        "$qemu" -cpu "max,sve-default-vector-length=$((bits / 8))" "$bin" --expect-sve-bits=$bits \
            --only=$isas --require=$isas --expect-pick=$pick || status=1
        echo "ran in $((SECONDS - t1)) s"
    done
    echo "-- dispatch on cortex-a57 (ARMv8.0: no SVE, no BF16)"
    "$qemu" -cpu cortex-a57 "$bin" --quick --expect-sve-bits=0 --require=scalar,neon --expect-pick=neon || status=1
    echo "-- dispatch on a64fx (512-bit SVE, no BF16)"
    "$qemu" -cpu a64fx "$bin" --quick --expect-sve-bits=512 --require=scalar,neon,sve512 --expect-pick=sve512 || status=1
fi
if [ $status -eq 0 ]; then echo "check_kernel_bits: PASS"; else echo "check_kernel_bits: FAIL"; fi
exit $status
