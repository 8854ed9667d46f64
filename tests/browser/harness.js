// What tests/test_browser.py runs in Chromium: the JavaScript session on onnxruntime-web, on artifacts the test
// serves under /fx/ (<name>.train.onnx ... and <name>.batches.safetensors: tensors "k/input").
import { batchAt } from '/js/test/batches.js';
import { readSafetensors, TrainingSession } from '/js/src/index.js';

const DIST = '/js/node_modules/onnxruntime-web/dist/';

/** @param {string} bundle the onnxruntime-web bundle's file (ort.wasm.min.mjs, ort.all.min.mjs, ort.webgpu.min.mjs) */
async function ortOf(bundle) {
  const ort = await import(DIST + bundle);
  ort.env.wasm.wasmPaths = DIST;
  ort.env.wasm.numThreads = 1;          // no cross-origin isolation on this page
  return ort;
}

/** @param {string} url */
async function bytes(url) {
  const r = await fetch(url);
  if (!r.ok) throw new Error(`${url}: ${r.status}`);
  return new Uint8Array(await r.arrayBuffer());
}

/**
 * A session of fixture ``name`` (its train, eval and state files, and its schedule model unless ``schedule`` is
 * false) on ``ep``, with the fixture's batches.
 * @param {any} ort @param {{name: string, ep: string, schedule?: boolean}} cfg
 */
async function open(ort, { name, ep, schedule = true }) {
  const fx = `/fx/${name}`;
  const session = await TrainingSession.create(ort, {
    train: await bytes(`${fx}.train.onnx`), state: await bytes(`${fx}.state.safetensors`),
    eval: await bytes(`${fx}.eval.onnx`), schedule: schedule ? await bytes(`${fx}.schedule.onnx`) : undefined,
  }, { executionProvider: ep });
  return { session, tensors: readSafetensors(await bytes(`${fx}.batches.safetensors`)).tensors };
}

/** @param {Uint8Array} b */
function base64(b) {
  let s = '';
  for (let i = 0; i < b.length; i += 0x8000) s += String.fromCharCode(...b.subarray(i, i + 0x8000));
  return btoa(s);
}

/**
 * Train ``steps`` steps of fixture ``name`` on ``ep`` with ``bundle``: the losses, the checkpoint after them
 * (base64) and the median ms per step after the first.
 * @param {{bundle: string, ep: string, name: string, steps: number, schedule: boolean}} cfg
 */
window.train = async ({ bundle, ep, name, steps, schedule }) => {
  const { session, tensors } = await open(await ortOf(bundle), { name, ep, schedule });
  const losses = [];
  const ms = [];
  for (let k = 0; k < steps; k++) {
    const t0 = performance.now();
    losses.push(await session.step(batchAt(tensors, k)));
    ms.push(performance.now() - t0);
  }
  const checkpoint = base64(await session.save());
  await session.release();
  const later = ms.slice(1).sort((a, b) => a - b);
  return { losses, checkpoint, ms: later[Math.floor(later.length / 2)] ?? ms[0] };
};

/**
 * Create a session of fixture ``name``'s training model with onnxruntime's verbose log, whose lines name where
 * each node was placed (the test reads them from the console).
 * @param {{bundle: string, ep: string, name: string}} cfg
 */
window.placements = async ({ bundle, ep, name }) => {
  const ort = await ortOf(bundle);
  ort.env.logLevel = 'verbose';
  const s = await ort.InferenceSession.create(await bytes(`/fx/${name}.train.onnx`), {
    executionProviders: [ep === 'webgpu' ? { name: 'webgpu', preferredLayout: 'NCHW' } : ep],
    logSeverityLevel: 0, logVerbosityLevel: 0,     // the session's layout (js/src/session.js)
  });
  await s.release();
  ort.env.logLevel = 'warning';
  return true;
};

window.ready = true;

/**
 * ``steps`` steps of fixture ``name`` on WebGPU counting the GPU tensors: every step's outputs are new
 * gpu-buffer tensors, and the session must dispose the ones they replace (no leak over many steps).
 * @param {{bundle: string, name: string, steps: number}} cfg
 */
window.leak = async ({ bundle, name, steps }) => {
  const ort = await ortOf(bundle);
  let disposed = 0;
  const dispose = ort.Tensor.prototype.dispose;
  ort.Tensor.prototype.dispose = function () {
    if (this.location === 'gpu-buffer') disposed += 1;
    return dispose.call(this);
  };
  const { session, tensors } = await open(ort, { name, ep: 'webgpu' });
  const spec = session.spec;
  const held = Object.keys(spec.params).length + Object.values(spec.buffers ?? {}).length
    + Object.values(spec.state ?? {}).reduce((n, s) => n + Object.keys(s).length, 0);
  let loss = 0;
  for (let k = 0; k < steps; k++) loss = await session.step(batchAt(tensors, 0));
  const afterSteps = disposed;
  await session.release();
  ort.Tensor.prototype.dispose = dispose;
  return { held, afterSteps, afterRelease: disposed, loss, stepCount: steps };
};

/**
 * One step of fixture ``name`` on a batch whose first float is NaN: the session must refuse it (NonFiniteError)
 * and keep every parameter as it was, the finiteness check computed on the GPU.
 * @param {{bundle: string, ep: string, name: string}} cfg
 */
window.nanStep = async ({ bundle, ep, name }) => {
  const { session, tensors } = await open(await ortOf(bundle), { name, ep });
  const good = batchAt(tensors, 0);
  const poisoned = { ...good };
  const first = Object.keys(good).find((k) => good[k].data instanceof Float32Array);
  poisoned[first] = { data: good[first].data.slice(), dims: good[first].dims };
  poisoned[first].data[0] = NaN;
  const before = await session.parameters();
  let refused = '';
  try {
    await session.step(poisoned);
  } catch (e) {
    refused = /** @type {Error} */ (e).name;
  }
  const after = await session.parameters();
  const unchanged = Object.keys(before).every((p) => before[p].every((v, i) => Object.is(v, after[p][i])));
  const loss = await session.step(good);              // and the next good batch trains
  await session.release();
  return { refused, unchanged, stepCount: session.stepCount, loss };
};
