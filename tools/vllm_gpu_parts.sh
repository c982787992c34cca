#!/usr/bin/env bash
# vllm_gpu_parts.sh (`make vllm-gpu-parts`, `make peer-parts`): cut a set of pinned wheels that the H200 image lacks into
# parts that each fit one command on the GPU machine (64 MiB per call, tree included), and print the call sequence.
# Two sets: `vllm` (the default: real vLLM 0.26.0, CUDA 13 build, and its import-time needs) and `quack` (QuACK 0.6.5
# and CUTLASS DSL 4.8.1 with the CUDA 13 library wheel, a peer of the linear_logp benchmark).
#
#   tools/vllm_gpu_parts.sh CHECKOUT [--set vllm|quack] [--slim] [--download] [--wheels DIR] [--vllm-wheel FILE] [--part-mib N]
#
#   CHECKOUT      the checkout whose tree travels with `run` (the parts go to CHECKOUT/build/<set>-gpu/partNN/)
#   --set NAME    which wheels: vllm (default) or quack; each set has its own parts folder, stash and site on the
#                 GPU machine (vllm: build/vllm-gpu, /tmp/vstash, /tmp/vsite; quack: build/quack-gpu, /tmp/qstash,
#                 /tmp/qsite/site-packages), so both can be installed on one warm machine
#   --slim        carry a reduced vLLM wheel (drops the FA2 kernels, the MoE kernels, the Rust frontend and the
#                 DeepGEMM/FMHA JIT headers; FA3 stored LZMA-compressed): ~2 calls instead of ~6. Dense models on
#                 Hopper only (FA3 attention; no MoE, no Rust frontend). Without it the PyPI wheel travels as is.
#   --download    fetch the set's pinned wheels below (and vllm==0.26.0 if missing) from PyPI into --wheels first
#   --wheels DIR  where the dependency wheels are (default CHECKOUT/build/<set>-gpu-wheels)
#   --vllm-wheel  the vLLM wheel (default: DIR/vllm-0.26.0-*.whl; set vllm only)
#   --part-mib N  part size in MiB (default: 60, lowered automatically so part + travelling tree <= 63 MiB)
#
# On the GPU machine each command runs `bash build/vllm-gpu/partNN/vstash.sh` with carry ["build/vllm-gpu/partNN"]: it copies
# the part into /tmp/vstash; the call that completes the set joins the split files (cat), checks sha256, runs
# `pip install --no-index --no-deps --no-compile --target /tmp/vsite` and touches /tmp/vsite/.vllm_gpu_ready.
# (Set quack: build/quack-gpu/partNN/vstash.sh, /tmp/qstash, /tmp/qsite/site-packages, its .quack_gpu_ready. CUTLASS
# DSL puts its `cutlass` package on sys.path through a .pth file, which a --target site does not run: PYTHONPATH needs
# <site>/nvidia_cutlass_dsl/dsl_packages too; the script prints the line. GPU_PARTS_STASH and GPU_PARTS_SITE, when
# set, replace the stash and site folders, and GPU_PARTS_PIP_ARGS is added to pip's install line: for checking a set's
# join and install away from the GPU machine, e.g. with "--python-version 3.12 --platform manylinux_2_28_x86_64".)
# The last call passes --final, so a set left incomplete by a machine that went cold fails (rc 3) instead of running.
# Files on the GPU machine survive only while the machine stays warm (30 s between commands): run the commands back to back,
# and put the real work into the last call (the script prints it). Needs python3, pip (for --download), sha256sum.
# Run vLLM there with VLLM_USE_FLASHINFER_SAMPLER=0: otherwise both samplers import flashinfer, which is not carried.
set -euo pipefail

VLLM_VERSION=0.26.0
# vLLM 0.26's import-time needs that the H200 image lacks (traced on CPU: importing the engine, worker, both model
# runners, Qwen3, FA backend and samplers, and LLM(...) up to GPU init); versions inside vLLM's own ranges.
PINS="pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 cachetools==7.3.3
cbor2==6.3.0 msgspec==0.23.0 pyzmq==27.3.0 openai==2.54.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1
openai-harmony==0.0.8 fastapi==0.136.3 starlette==1.10.0 partial-json-parser==0.2.1.1.post7 pybase64==1.5.1
llguidance==1.7.6 xgrammar==0.2.6 apache-tvm-ffi==0.1.10"

die() { echo "vllm_gpu_parts: $*" >&2; exit 1; }

[ $# -ge 1 ] || { sed -n 2,32p "$0"; exit 2; }   # the header above
CHECKOUT=$(cd "$1" && pwd) || die "no checkout $1"; shift
SET=vllm; WHEELS=""; VLLM_WHL=""; PART_MIB=60; SLIM=0; DOWNLOAD=0
while [ $# -gt 0 ]; do
  case "$1" in
    --set) SET=$2; shift ;;
    --slim) SLIM=1 ;;
    --download) DOWNLOAD=1 ;;
    --wheels) WHEELS=$2; shift ;;
    --vllm-wheel) VLLM_WHL=$2; shift ;;
    --part-mib) PART_MIB=$2; shift ;;
    *) die "unknown argument $1" ;;
  esac
  shift
done

# --- the set: its pins, where its parts go, and where the GPU machine stashes and installs them -------------------
# PYPATH: what PYTHONPATH needs on the GPU machine (the site, plus what the set's .pth files would have added)
case "$SET" in
  vllm)
    STASH_DIR=/tmp/vstash; SITE_DIR=/tmp/vsite; READY=.vllm_gpu_ready
    PYPATH=$SITE_DIR; RUN_ENV="VLLM_USE_FLASHINFER_SAMPLER=0"; LAST_RUN="<your vLLM run>"; LAST_CARRY="" ;;
  quack)
    # QuACK 0.6.5 requires nvidia-cutlass-dsl>=4.7, apache-tvm-ffi>=0.1.6,<0.2, torch-c-dlpack-ext, einops and torch
    # (no version). nvidia-cutlass-dsl 4.8.1 is a metapackage (a .pth file) over libs-base, which needs libs-core;
    # its cu13 extra adds libs-cu13 (the 92 MB MLIR/runtime build for CUDA 13; the cu12 build it also requires is
    # left out: with only cu13 present, cu13 is chosen). On the H200 image (Python 3.12, torch 2.11+cu130, driver
    # CUDA 13.0): einops, cuda-bindings, protobuf, typing-extensions, triton are there; torch 2.11 has the DLPack
    # exchange attribute itself, so torch-c-dlpack-ext (built for torch <= 2.9) is carried for completeness and
    # not loaded. apache-tvm-ffi 0.1.10 is the version vLLM's set carries.
    # The site's path must contain /site-packages/: QuACK keys each epilogue's compiled kernel on a fingerprint of
    # its fn and, recursively, of every global that fn reaches (quack/gemm_runtime/identity.py, semantic_value_key),
    # and stops at library code only by path (_is_extern_function: a file under .../site-packages/, .../dist-packages/
    # or the stdlib). Under a plain --target /tmp/qsite the walk entered CUTLASS DSL's dsl_user_op wrapper
    # (cutlass/_mlir_helpers/op.py) and failed at import on its ContextVar _LOC_TRANSFORMS (TypeError "... has no
    # fail-closed semantic key"); under /tmp/qsite/site-packages the same wheels compiled and ran on the H200.
    PINS="quack-kernels==0.6.5 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.10 torch-c-dlpack-ext==0.1.5"
    STASH_DIR=/tmp/qstash; SITE_DIR=/tmp/qsite/site-packages; READY=.quack_gpu_ready
    PYPATH=$SITE_DIR:$SITE_DIR/nvidia_cutlass_dsl/dsl_packages; RUN_ENV=""
    # `make bench-gpu` puts the site on the benchmarks' PYTHONPATH itself; build/wheels holds Liger's and CCE's wheels
    LAST_RUN="make bench-gpu OUT=\$OUT"; LAST_CARRY=', "build/wheels"'
    [ $SLIM = 0 ] && [ -z "$VLLM_WHL" ] || die "--slim and --vllm-wheel are for --set vllm" ;;
  *) die "unknown set $SET (vllm or quack)" ;;
esac
[ -n "$WHEELS" ] || WHEELS=$CHECKOUT/build/$SET-gpu-wheels
ENV_LINE="export PYTHONPATH=$PYPATH\${PYTHONPATH:+:\$PYTHONPATH}${RUN_ENV:+ $RUN_ENV}"
SHOW_ENV="export PYTHONPATH=$PYPATH${RUN_ENV:+ $RUN_ENV}"
[ $SET = vllm ] && LAST_RUN="$SHOW_ENV && $LAST_RUN"

PLATS="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
--platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
--platform manylinux_2_31_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64"
if [ $DOWNLOAD = 1 ]; then
  mkdir -p "$WHEELS"
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATS \
      -d "$WHEELS" $PINS || die "pip download of the pinned wheels failed"
  if [ $SET = vllm ] && ! ls "$WHEELS"/vllm-$VLLM_VERSION-*.whl >/dev/null 2>&1 && { [ -z "$VLLM_WHL" ] || [ ! -f "$VLLM_WHL" ]; }; then
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATS \
        -d "$WHEELS" vllm==$VLLM_VERSION || die "pip download of vllm==$VLLM_VERSION failed"
  fi
fi

# --- which files travel -----------------------------------------------------------------------------------------
if [ $SET = vllm ]; then
  if [ -z "$VLLM_WHL" ]; then
    VLLM_WHL=$(ls "$WHEELS"/vllm-$VLLM_VERSION-*.whl 2>/dev/null | head -1 || true)
    :
  fi
  [ -n "$VLLM_WHL" ] && [ -f "$VLLM_WHL" ] || die "no vllm-$VLLM_VERSION wheel (use --download or --vllm-wheel)"
fi
DEPS=()
for spec in $PINS; do
  n=${spec%%==*}; v=${spec#*==}
  pat=$(echo "$n" | tr 'A-Z-' 'a-z_')
  f=$(ls "$WHEELS" 2>/dev/null | awk -v p="$pat-$v-" 'tolower($0) ~ "^"p && /\.whl$/' | head -1)
  [ -n "$f" ] || die "missing wheel for $spec in $WHEELS (use --download)"
  DEPS+=("$WHEELS/$f")
done

OUTROOT="$CHECKOUT/build/$SET-gpu"
STAGE=$(mktemp -d /tmp/$SET-gpu-stage.XXXXXX)
trap 'rm -rf "$STAGE"' EXIT

if [ $SLIM = 1 ]; then
  SLIM_WHL="$STAGE/$(basename "$VLLM_WHL")"
  python3 - "$VLLM_WHL" "$SLIM_WHL" <<'PY'
import re, sys, zipfile
src, dst = sys.argv[1], sys.argv[2]
drop = re.compile(r"^vllm/(vllm_flash_attn/_vllm_fa2_C\.abi3\.so|_moe_C_stable_libtorch\.abi3\.so|vllm-rs"
                  r"|third_party/deep_gemm/include/.*|third_party/fmha_sm100/cutlass/.*"
                  r"|third_party/deep_gemm/_C\.cpython-3(10|11|13|14)-.*\.so)$")
lzma_members = {"vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"}   # 146 MB: 37 MiB deflated, ~8 MiB as LZMA
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as zout:
    dropped = [i.filename for i in zin.infolist() if drop.match(i.filename)]
    gone = set(dropped)
    for info in zin.infolist():
        if info.filename in gone:
            continue
        data = zin.read(info.filename)
        if info.filename.endswith(".dist-info/RECORD"):
            lines = data.decode().splitlines(keepends=True)
            data = "".join(l for l in lines if l.split(",", 1)[0] not in gone).encode()
        out = zipfile.ZipInfo(info.filename, date_time=info.date_time)
        out.external_attr = info.external_attr
        out.compress_type = zipfile.ZIP_LZMA if info.filename in lzma_members else zipfile.ZIP_DEFLATED
        zout.writestr(out, data)
print(f"slim vllm wheel: dropped {len(dropped)} members", file=sys.stderr)
PY
  VLLM_WHL=$SLIM_WHL
fi

# --- part size: a call carries the part plus the checkout's travelling tree, 64 MiB in all ------------------------
TREE=0
if git -C "$CHECKOUT" rev-parse --git-dir >/dev/null 2>&1; then
  # (a tracked file deleted in the work tree makes du fail; the total of the others still counts)
  TREE=$( (cd "$CHECKOUT" && git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null || true) | tail -1 | cut -f1)
  [ -d "$CHECKOUT/shared" ] && TREE=$((TREE + $(du -sb "$CHECKOUT/shared" | cut -f1)))
  # build/<set>-gpu must be ignored, or the parts would travel with every call
  if ! git -C "$CHECKOUT" check-ignore -q build/$SET-gpu/probe; then
    excl=$(git -C "$CHECKOUT" rev-parse --git-path info/exclude)
    case "$excl" in /*) ;; *) excl="$CHECKOUT/$excl" ;; esac
    mkdir -p "$(dirname "$excl")"; echo "/build/$SET-gpu/" >> "$excl"
    echo "note: added /build/$SET-gpu/ to $excl" >&2
  fi
fi
MIB=$((1024 * 1024))
MAXPART=$((63 * MIB - TREE))
PART=$((PART_MIB * MIB)); [ $PART -le $MAXPART ] || PART=$MAXPART
[ $PART -ge $((8 * MIB)) ] || die "the travelling tree ($TREE bytes) leaves no room for parts"

# --- split and pack (first-fit decreasing) ----------------------------------------------------------------------
rm -rf "$OUTROOT"; mkdir -p "$OUTROOT"
PIECES="$STAGE/pieces"; mkdir -p "$PIECES"
MANIFEST="$OUTROOT/manifest.txt"; : > "$MANIFEST"
for w in ${VLLM_WHL:+"$VLLM_WHL"} "${DEPS[@]}"; do
  b=$(basename "$w"); size=$(stat -c %s "$w"); sha=$(sha256sum "$w" | cut -d' ' -f1)
  if [ "$size" -gt "$PART" ]; then
    split -b "$PART" -d -a 2 "$w" "$PIECES/$b.part"
    n=$(ls "$PIECES/$b".part* | wc -l)
  else
    cp "$w" "$PIECES/$b"; n=1
  fi
  echo "$b $sha $size $n" >> "$MANIFEST"
done

cat > "$STAGE/vstash.sh" <<DEV
#!/usr/bin/env bash
# GPU-machine side: stash this part; once every piece named in manifest.txt is there, join, verify, install.
set -euo pipefail
here=\$(cd "\$(dirname "\$0")" && pwd); S=\${GPU_PARTS_STASH:-$STASH_DIR}; T=\${GPU_PARTS_SITE:-$SITE_DIR}; READY=$READY
ENV_LINE='$ENV_LINE'
DEV
cat >> "$STAGE/vstash.sh" <<'DEV'
if [ -f $T/$READY ]; then echo "VSITE READY (installed earlier)"; exit 0; fi
mkdir -p $S
for f in "$here"/*; do case "$(basename "$f")" in vstash.sh|manifest.txt) ;; *) cp -f "$f" $S/ ;; esac; done
missing=""
while read -r name sha size n; do
  if [ "$n" -gt 1 ]; then have=$(ls $S/"$name".part* 2>/dev/null | wc -l); [ "$have" -eq "$n" ] || missing="$missing $name($have/$n)"
  else [ -f $S/"$name" ] || missing="$missing $name"; fi
done < "$here/manifest.txt"
if [ -n "$missing" ]; then
  nm=$(echo $missing | wc -w)
  echo "STASHED $(basename "$here") ($(ls $S | wc -l) files, $(du -sm $S | cut -f1) MiB); $nm still missing:$(echo $missing | cut -d' ' -f1-3)$([ $nm -gt 3 ] && echo ' ...')"
  # the last call says --final: an incomplete set there means the machine went cold in between (start again)
  if [ "${1:-}" = "--final" ]; then echo "INCOMPLETE: resend every part, back to back" >&2; exit 3; fi
  exit 0
fi
while read -r name sha size n; do
  if [ "$n" -gt 1 ]; then cat $(ls $S/"$name".part* | sort) > $S/"$name"; rm -f $S/"$name".part*; fi
  echo "$sha  $S/$name" | sha256sum -c --quiet - || { echo "CHECKSUM FAILED: $name" >&2; exit 1; }
done < "$here/manifest.txt"
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $T ${GPU_PARTS_PIP_ARGS:-} $S/*.whl
touch $T/$READY
echo "VSITE READY in $(( $(date +%s) - t0 )) s: $ENV_LINE"
DEV

# first-fit decreasing over the pieces
mapfile -t ORDER < <(cd "$PIECES" && for f in *; do echo "$(stat -c %s "$f") $f"; done | sort -k1,1nr)
declare -a FILL=()
NP=0
for entry in "${ORDER[@]}"; do
  sz=${entry%% *}; f=${entry#* }
  placed=0
  for ((k = 1; k <= NP; k++)); do
    if [ $((FILL[k] + sz)) -le "$PART" ]; then
      mv "$PIECES/$f" "$OUTROOT/$(printf 'part%02d' $k)/"; FILL[k]=$((FILL[k] + sz)); placed=1; break
    fi
  done
  if [ $placed = 0 ]; then
    NP=$((NP + 1)); d="$OUTROOT/$(printf 'part%02d' $NP)"; mkdir -p "$d"
    mv "$PIECES/$f" "$d/"; FILL[NP]=$sz
  fi
done
for ((k = 1; k <= NP; k++)); do
  d="$OUTROOT/$(printf 'part%02d' $k)"
  cp "$STAGE/vstash.sh" "$MANIFEST" "$d/"
done

# --- report ------------------------------------------------------------------------------------------------------
TOTAL=$(awk '{s += $3} END {print s}' "$MANIFEST")
echo "set $SET: wheels ($(wc -l < "$MANIFEST")), $(awk -v t="$TOTAL" 'BEGIN {printf "%.1f", t / 1048576}') MiB in all$([ $SLIM = 1 ] && echo ', vLLM slimmed'):"
awk '{printf "  %8.2f MiB  %s%s\n", $3 / 1048576, $1, ($4 > 1 ? "  (split in " $4 ")" : "")}' "$MANIFEST"
echo "travelling tree $(awk -v t="$TREE" 'BEGIN {printf "%.1f", t / 1048576}') MiB; part limit $(awk -v t="$PART" 'BEGIN {printf "%.1f", t / 1048576}') MiB; $NP parts under $OUTROOT:"
for ((k = 1; k <= NP; k++)); do
  d=$(printf 'part%02d' $k)
  echo "  $d  $(du -sb "$OUTROOT/$d" | awk '{printf "%.1f MiB", $1 / 1048576}')  $(ls "$OUTROOT/$d" | grep -v '^vstash.sh$\|^manifest.txt$' | tr '\n' ' ')"
done
echo
echo "GPU-machine commands, back to back (each within 30 s of the last; a cold machine means starting again at part01):"
for ((k = 1; k <= NP; k++)); do
  d=$(printf 'part%02d' $k)
  if [ $k -lt $NP ]; then
    echo "  call $k: carry [\"build/$SET-gpu/$d\"]  command: bash build/$SET-gpu/$d/vstash.sh"
  else
    echo "  call $k: carry [\"build/$SET-gpu/$d\"$LAST_CARRY]  command: bash build/$SET-gpu/$d/vstash.sh --final && $LAST_RUN"
  fi
done
echo "  later calls on the same warm machine: [ -f $SITE_DIR/$READY ] && $SHOW_ENV && <run>"
