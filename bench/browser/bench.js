// What bench/browser_bench.py runs in Chromium: one configuration per page load, either onnxgrad's session on an
// onnxruntime-web bundle or TensorFlow.js on one of its backends, training the same model on the same batches
// (served under /fx/: <model>.train.onnx ... and <model>.batches.safetensors, tensors "k/x" and "k/y").
import { readSafetensors, TrainingSession } from '/js/src/index.js';

const ORT = '/js/node_modules/onnxruntime-web/dist/';
const TFJS_WASM = '/js/node_modules/@tensorflow/tfjs-backend-wasm/dist/';
const tf = /** @type {any} */ (window).tf;

/** @param {string} url */
async function bytes(url) {
  const r = await fetch(url);
  if (!r.ok) throw new Error(`${url}: ${r.status}`);
  return new Uint8Array(await r.arrayBuffer());
}

/** The batches: [{x: Float32Array, y: Int32Array}], and their dims. @param {string} model */
async function batches(model) {
  const { tensors } = readSafetensors(await bytes(`/fx/${model}.batches.safetensors`));
  /** @type {{x: Float32Array, y: Int32Array}[]} */
  const out = [];
  /** @type {Record<string, number[]>} */
  const dims = {};
  for (const [key, e] of tensors) {
    const [k, input] = key.split('/');
    out[Number(k)] ??= /** @type {any} */ ({});
    const Kind = input === 'x' ? Float32Array : Int32Array;
    /** @type {any} */ (out[Number(k)])[input] = new Kind(e.bytes.slice().buffer);
    dims[input] = e.shape;
  }
  return { list: out, dims };
}

/** The median of ``ms``. @param {number[]} ms */
function median(ms) {
  const s = [...ms].sort((a, b) => a - b);
  return s.length % 2 ? s[(s.length - 1) / 2] : (s[s.length / 2 - 1] + s[s.length / 2]) / 2;
}

/** ``warmup`` untimed steps, then ``steps`` timed ones: each step's ms and loss. */
async function timed(/** @type {(k: number) => Promise<number>} */ step, warmup, steps) {
  for (let k = 0; k < warmup; k++) await step(k);
  const ms = [];
  const losses = [];
  for (let k = 0; k < steps; k++) {
    const t0 = performance.now();
    losses.push(await step(warmup + k));
    ms.push(performance.now() - t0);
  }
  return { ms, losses, median: median(ms) };
}

/** onnxgrad's session on ``bundle`` with provider ``ep``: each step feeds the batch from the CPU and returns the
 * loss to it. */
async function onnxgrad({ bundle, ep, model, warmup, steps }) {
  const ort = await import(ORT + bundle);
  ort.env.wasm.wasmPaths = ORT;
  ort.env.wasm.numThreads = 1;          // no cross-origin isolation: one thread, as TF.js's wasm backend gets
  const fx = `/fx/${model}`;
  const session = await TrainingSession.create(ort, {
    train: await bytes(`${fx}.train.onnx`), state: await bytes(`${fx}.state.safetensors`),
    schedule: await bytes(`${fx}.schedule.onnx`),
  }, { executionProvider: ep });
  const { list, dims } = await batches(model);
  const out = await timed((k) => {
    const b = list[k % list.length];
    return session.step({ x: { data: b.x, dims: dims.x }, y: { data: b.y, dims: dims.y } });
  }, warmup, steps);
  await session.release();
  return { ...out, version: ort.env.versions?.web ?? '' };
}

/** The TF.js model of ``spec`` (bench/browser_bench.py's sizes): NHWC, as TF.js's layers are. */
function tfModel(spec) {
  const L = tf.layers;
  if (spec.kind === 'mlp') {
    return tf.sequential({ layers: [
      L.dense({ units: spec.hidden, activation: 'relu', inputShape: [spec.features] }),
      L.dense({ units: spec.hidden, activation: 'relu' }),
      L.dense({ units: spec.classes }),
    ] });
  }
  return tf.sequential({ layers: [
    L.conv2d({ filters: spec.c1, kernelSize: 3, padding: 'same', activation: 'relu',
      inputShape: [spec.size, spec.size, 1] }),
    L.maxPooling2d({ poolSize: 2 }),
    L.conv2d({ filters: spec.c2, kernelSize: 3, padding: 'same', activation: 'relu' }),
    L.maxPooling2d({ poolSize: 2 }),
    L.flatten(),
    L.dense({ units: spec.classes }),
  ] });
}

/** TF.js on ``backend``: each step makes the batch's tensors from the CPU arrays, minimizes the softmax
 * cross-entropy with momentum SGD and reads the loss back (``await loss.data()``), as onnxgrad's step does. */
async function tfjs({ backend, model, spec, warmup, steps }) {
  if (backend === 'wasm') {
    tf.wasm.setWasmPaths(TFJS_WASM);
    if (tf.wasm.setThreadsCount) tf.wasm.setThreadsCount(1);
  }
  if (!(await tf.setBackend(backend))) throw new Error(`TF.js has no ${backend} backend here`);
  await tf.ready();
  const net = tfModel(spec);
  const optimizer = tf.train.momentum(spec.lr, spec.momentum);
  const { list, dims } = await batches(model);
  const xShape = spec.kind === 'mlp' ? dims.x : [dims.x[0], spec.size, spec.size, 1];   // 1 channel: same bytes
  const out = await timed(async (k) => {
    const b = list[k % list.length];
    const x = tf.tensor(b.x, xShape, 'float32');
    const labels = tf.tensor1d(b.y, 'int32');
    const y = tf.oneHot(labels, spec.classes);
    const loss = optimizer.minimize(() => tf.losses.softmaxCrossEntropy(y, net.apply(x, { training: true })), true);
    const value = (await loss.data())[0];
    tf.dispose([x, labels, y, loss]);
    return value;
  }, warmup, steps);
  const leaked = tf.memory().numTensors;
  net.dispose();
  optimizer.dispose();
  return { ...out, version: tf.version_core, backend: tf.getBackend(), tensors: leaked };
}

/** One configuration: ``framework`` 'onnxgrad' ({bundle, ep}) or 'tfjs' ({backend}). */
window.bench = async (cfg) => (cfg.framework === 'tfjs' ? tfjs(cfg) : onnxgrad(cfg));

/** The WebGPU adapter, in words. */
window.adapter = async () => {
  const a = navigator.gpu && await navigator.gpu.requestAdapter();
  if (!a) return 'none';
  const i = a.info || {};
  return [i.vendor, i.architecture, i.device, i.description].filter(Boolean).join(' ');
};

window.ready = true;
