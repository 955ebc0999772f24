#!/usr/bin/env bash
# The wgpu executor beyond the default driver (Mesa's lavapipe): on Google's SwiftShader (Vulkan),
# on wgpu's GL backend over Mesa's llvmpipe through EGL (no display), once under the Khronos
# validation layer with synchronization validation, and planned within each adapter class's
# limits (HICACHE_WGPU_LIMITS=metal|dx12|webgpu|downlevel). Each stack runs `check` (every cell,
# both profiles) and `fuzz`, every byte compared with the oracle.
#
#   scripts/wgpu-stacks.sh BIN [swiftshader|gl|validation|classes]...   (default: all four)
#
# Needs root or the packages already there: SwiftShader comes from Debian's chromium-common
# (unpacked, not installed), the validation layer from vulkan-validationlayers.
#
# Selecting a stack for any program: SwiftShader `VK_ICD_FILENAMES=/opt/chromium-common/usr/lib/
# chromium/vk_swiftshader_icd.json`; GL `WGPU_BACKEND=gl LIBGL_ALWAYS_SOFTWARE=1`. In a Python
# process that will import triton (torch's compiler), import it before wgpu opens GL: Mesa loads
# its GL driver with its LLVM visible to every later library, and triton's own LLVM then crashes
# on import (Vulkan's loader keeps lavapipe's LLVM to itself).
set -euo pipefail
bin="$1"
shift
stacks=("$@")
[ ${#stacks[@]} -gt 0 ] || stacks=(swiftshader gl validation classes)
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$work}"

step() { echo "== [${SECONDS}s] wgpu stack: $*"; }

# `check` and `fuzz` on the stack the environment selects (`info` must name it), then the Rust
# tests written for wgpu (`cargo test -- wgpu`: tiny windows and segments, padded pages, mapped
# and staged memory; built already by `cargo test`) unless HICACHE_STACK_RUST_TESTS=0.
run_stack() {
    local want="$1" seed="$2"
    "$bin" info | tee "$work/info.txt"
    grep -q "wgpu: available — .*$want" "$work/info.txt" || { echo "wgpu did not open on $want"; exit 1; }
    "$bin" check --backend wgpu --rounds 2 --seed "$seed"
    "$bin" check --backend wgpu --rounds 1 --seed "$((seed + 1))" --profile sglang
    "$bin" fuzz --backend wgpu --cases 300 --seed "$((seed + 2))"
    if [ "${HICACHE_STACK_RUST_TESTS:-1}" != 0 ]; then
        HICACHE_REQUIRE_WGPU=1 cargo test -q -- wgpu
    fi
}

for stack in "${stacks[@]}"; do
    case "$stack" in
    swiftshader)
        step "SwiftShader (Vulkan on the CPU, from Debian's chromium-common)"
        if [ ! -f /opt/chromium-common/usr/lib/chromium/vk_swiftshader_icd.json ]; then
            (cd "$work" && apt-get download -qq chromium-common >/dev/null 2>&1 && dpkg-deb -x chromium-common_*.deb /opt/chromium-common)
        fi
        VK_ICD_FILENAMES=/opt/chromium-common/usr/lib/chromium/vk_swiftshader_icd.json run_stack "SwiftShader" 31
        ;;
    gl)
        step "GL (wgpu's GLES backend on Mesa's llvmpipe, EGL without a display)"
        # LIBGL_ALWAYS_SOFTWARE: Mesa opens llvmpipe at once (else its first eglInitialize tries a
        # hardware driver, fails and wgpu logs that error before it opens llvmpipe).
        WGPU_BACKEND=gl LIBGL_ALWAYS_SOFTWARE=1 run_stack "(Gl," 41
        ;;
    validation)
        step "lavapipe under the Khronos validation layer (synchronization validation on); any error fails"
        if ! ls /usr/share/vulkan/explicit_layer.d/VkLayer_khronos_validation.json >/dev/null 2>&1; then
            apt-get install -y -qq --no-install-recommends vulkan-validationlayers >/dev/null
        fi
        # wgpu enables the layer and its synchronization validation for WGPU_VALIDATION=1 and
        # logs every message it reports (errors at ERROR). WGPU_DEBUG=0: no shader debug info;
        # Debian 12's layer (1.3.239) does not know the WGSL source language naga declares in it
        # and rejects every module for that alone.
        WGPU_DEBUG=0 WGPU_VALIDATION=1 VK_LOADER_DEBUG=layer "$bin" info > "$work/layers.txt" 2>&1
        grep -q 'Inserted device layer "VK_LAYER_KHRONOS_validation"' "$work/layers.txt" || { cat "$work/layers.txt"; echo "the validation layer did not load"; exit 1; }
        for args in "check --backend wgpu --rounds 1 --seed 51" "check --backend wgpu --rounds 1 --seed 52 --profile sglang" "fuzz --backend wgpu --cases 200 --seed 53"; do
            # shellcheck disable=SC2086
            WGPU_DEBUG=0 WGPU_VALIDATION=1 RUST_LOG="${RUST_LOG:-warn}" "$bin" $args 2>&1 | tee "$work/validation.txt"
            if grep -q " ERROR " "$work/validation.txt"; then
                echo "the validation layer reported errors (above)"
                exit 1
            fi
        done
        # The Rust tests written for wgpu, under the layer too: they log nowhere, so the layer
        # writes its errors to a file of its own (scripts/validation/vk_layer_settings.txt),
        # which must stay empty.
        if [ "${HICACHE_STACK_RUST_TESTS:-1}" != 0 ]; then
            rm -f vvl-errors.txt
            VK_LAYER_SETTINGS_PATH="$PWD/scripts/validation" WGPU_DEBUG=0 WGPU_VALIDATION=1 HICACHE_REQUIRE_WGPU=1 cargo test -q -- wgpu
            if [ -s vvl-errors.txt ]; then
                cat vvl-errors.txt
                echo "the validation layer reported errors in the Rust tests (above)"
                exit 1
            fi
            rm -f vvl-errors.txt
        fi
        ;;
    classes)
        for class in metal dx12 webgpu downlevel; do
            step "planned as a $class adapter (HICACHE_WGPU_LIMITS=$class) on lavapipe"
            HICACHE_WGPU_LIMITS="$class" "$bin" info | tee "$work/info.txt"
            grep -q "planned as a $class adapter" "$work/info.txt" || { echo "the $class class was not applied"; exit 1; }
            HICACHE_WGPU_LIMITS="$class" "$bin" check --backend wgpu --rounds 1 --seed 61
            HICACHE_WGPU_LIMITS="$class" "$bin" fuzz --backend wgpu --cases 100 --seed 62
        done
        ;;
    *)
        echo "unknown stack $stack (swiftshader, gl, validation, classes)"
        exit 2
        ;;
    esac
done
