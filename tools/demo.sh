#!/usr/bin/env bash
# The main job on the built-in default model: synthesize a tiny BitNet model (random weights), carry it through
# every container and back, check the round trip is byte-identical, and inspect the result.
set -euo pipefail
out=${DEMO_DIR:-out/demo}
mkdir -p "$out"
bitformat synth --preset tiny --seed 0 -o "$out/tiny.gguf"
prev="$out/tiny.gguf"
for fmt in tq2_0 tq1_0 stfma colpack_u32 rans hf i2_s; do
  if [ "$fmt" = hf ]; then dst="$out/tiny-hf"; else dst="$out/tiny.via.$fmt.gguf"; fi
  bitformat convert "$prev" --to "$fmt" -o "$dst"
  prev="$dst"
done
if cmp -s "$out/tiny.gguf" "$prev"; then
  echo "round trip i2_s -> tq2_0 -> tq1_0 -> stfma -> colpack_u32 -> rans -> hf -> i2_s: byte-identical"
else
  echo "round trip changed the file" >&2
  exit 1
fi
bitformat inspect "$out/tiny.via.rans.gguf"
bitformat report "$out/tiny.gguf" --plot "$out/report.png"
bitformat run "$out/tiny.via.rans.gguf" -p "def hello(name):" -n 24
echo
echo "The text above is meaningless on purpose: the demo model's weights are random (bitformat synth)."
echo "For the real BitNet b1.58 2B-4T model, see README.md, \"Real models\"."
