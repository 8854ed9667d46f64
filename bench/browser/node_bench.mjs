// bench/browser_bench.py's Node half: onnxgrad's JavaScript session on onnxruntime-node (provider 'cpu') on the
// artifacts in FOLDER, the batches of <model>.batches.safetensors. Prints {ms, losses, median, version} as JSON.
// node bench/browser/node_bench.mjs FOLDER MODEL WARMUP STEPS
import { readFile } from 'node:fs/promises';
import { createRequire } from 'node:module';
import { join } from 'node:path';
import { readSafetensors, TrainingSession } from '../../js/src/index.js';

const require = createRequire(new URL('../../js/package.json', import.meta.url));
const ort = require('onnxruntime-node');
const [folder, model, warmup, steps] = process.argv.slice(2);
const file = async (/** @type {string} */ suffix) => new Uint8Array(await readFile(join(folder, `${model}${suffix}`)));
const session = await TrainingSession.create(ort, {
  train: await file('.train.onnx'), state: await file('.state.safetensors'),
}, { executionProvider: 'cpu' });
const { tensors } = readSafetensors(await file('.batches.safetensors'));
/** @type {Record<string, any>[]} */
const list = [];
for (const [key, e] of tensors) {
  const [k, input] = key.split('/');
  list[Number(k)] ??= {};
  const Kind = input === 'x' ? Float32Array : Int32Array;
  list[Number(k)][input] = { data: new Kind(e.bytes.slice().buffer), dims: e.shape };
}
for (let k = 0; k < Number(warmup); k++) await session.step(list[k % list.length]);
const ms = [];
const losses = [];
for (let k = 0; k < Number(steps); k++) {
  const t0 = performance.now();
  losses.push(await session.step(list[(Number(warmup) + k) % list.length]));
  ms.push(performance.now() - t0);
}
await session.release();
const sorted = [...ms].sort((a, b) => a - b);
const n = sorted.length;
const median = n % 2 ? sorted[(n - 1) / 2] : (sorted[n / 2 - 1] + sorted[n / 2]) / 2;
console.log(JSON.stringify({ ms, losses, median, version: ort.env.versions?.node ?? '' }));
