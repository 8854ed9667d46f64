// The digits page: the JavaScript session (js/src) trains artifacts/digits.* on the chosen backend, draws the
// loss, measures test accuracy after each epoch, keeps a checkpoint in localStorage (resumed after a reload) and
// offers the trained model as an ONNX file.
import { readSafetensors, TrainingSession } from '../../js/src/index.js';

const DIST = new URL('../../js/node_modules/onnxruntime-web/dist/', import.meta.url).href;
const BUNDLES = { wasm: 'ort.wasm.min.mjs', webgpu: 'ort.webgpu.min.mjs' };
const BATCH = 32;
const TRAIN = 1504;                // 47 batches; the next 288 images are the test set (9 batches)
const TEST = 288;
const SAVED = 'onnxgrad-digits';   // localStorage: {checkpoint (base64), losses, accuracy}

const $ = (/** @type {string} */ id) => /** @type {any} */ (document.getElementById(id));
const state = { session: /** @type {TrainingSession | null} */ (null), ep: '', losses: /** @type {number[]} */ ([]),
  accuracy: NaN, busy: false };

/** @param {string} url */
async function bytes(url) {
  return new Uint8Array(await (await fetch(url)).arrayBuffer());
}

const data = readSafetensors(await bytes('digits.safetensors')).tensors;
const images = Float32Array.from(data.get('images').bytes, (v) => v / 16);        // [1797, 8, 8] in 0..1
const labels = Int32Array.from(data.get('labels').bytes);

/** A batch of the images at ``rows``. @param {number[]} rows */
function batch(rows) {
  const x = new Float32Array(BATCH * 64);
  const y = new Int32Array(BATCH);
  rows.forEach((r, k) => {
    x.set(images.subarray(r * 64, r * 64 + 64), k * 64);
    y[k] = labels[r];
  });
  return { x: { data: x, dims: [BATCH, 1, 8, 8] }, y: { data: y, dims: [BATCH] } };
}

/** @param {Uint8Array} b */
const toBase64 = (b) => btoa(Array.from(b, (c) => String.fromCharCode(c)).join(''));
/** @param {string} s */
const fromBase64 = (s) => Uint8Array.from(atob(s), (c) => c.charCodeAt(0));

async function open(ep) {
  const ort = await import(DIST + BUNDLES[ep]);
  ort.env.wasm.wasmPaths = DIST;
  ort.env.wasm.numThreads = 1;
  const files = { train: 'train.onnx', eval: 'eval.onnx', schedule: 'schedule.onnx', state: 'state.safetensors' };
  /** @type {Record<string, Uint8Array>} */
  const loaded = {};
  for (const [k, f] of Object.entries(files)) loaded[k] = await bytes(`artifacts/digits.${f}`);
  const session = await TrainingSession.create(ort, /** @type {any} */ (loaded), { executionProvider: ep });
  const saved = JSON.parse(localStorage.getItem(SAVED) ?? 'null');
  if (saved) {                       // resume where the last visit stopped
    await session.restore(fromBase64(saved.checkpoint));
    state.losses = saved.losses;
    state.accuracy = saved.accuracy;
  }
  if (state.session) await state.session.release();
  state.session = session;
  state.ep = ep;
}

async function accuracy() {
  let right = 0;
  for (let b = 0; b < TEST / BATCH; b++) {
    const rows = Array.from({ length: BATCH }, (_, k) => TRAIN + b * BATCH + k);
    const { logits } = await /** @type {TrainingSession} */ (state.session).eval(batch(rows));
    const z = /** @type {Float32Array} */ (logits.data);
    rows.forEach((r, k) => {
      const scores = z.subarray(k * 10, k * 10 + 10);
      if (scores.indexOf(Math.max(...scores)) === labels[r]) right += 1;
    });
  }
  return right / TEST;
}

function draw() {
  const canvas = $('curve');
  const g = canvas.getContext('2d');
  const { width: w, height: h } = canvas;
  g.clearRect(0, 0, w, h);
  g.fillStyle = '#555';
  g.fillText('training loss', 8, 14);
  const losses = state.losses;
  if (!losses.length) return;
  const top = Math.max(...losses);
  g.strokeStyle = '#1565c0';
  g.beginPath();
  losses.forEach((l, i) => {
    const x = 8 + (i / Math.max(1, losses.length - 1)) * (w - 16);
    const y = h - 8 - (l / top) * (h - 24);
    if (i === 0) g.moveTo(x, y); else g.lineTo(x, y);
  });
  g.stroke();
  g.fillText(top.toFixed(2), w - 40, 14);
}

function show(text) {
  $('status').textContent = text;
  $('step').textContent = String(state.session?.stepCount ?? 0);
  $('accuracy').textContent = Number.isNaN(state.accuracy) ? '-' : state.accuracy.toFixed(3);
  draw();
}

/** Train ``epochs`` epochs: shuffled batches, the curve drawn as it goes, accuracy and a checkpoint after each. */
async function train(epochs) {
  if (state.busy) return;
  state.busy = true;
  const session = /** @type {TrainingSession} */ (state.session);
  try {
    for (let e = 0; e < epochs; e++) {
      const order = Array.from({ length: TRAIN }, (_, i) => i).sort(() => Math.random() - 0.5);
      const t0 = performance.now();
      for (let b = 0; b < TRAIN / BATCH; b++) {
        state.losses.push(await session.step(batch(order.slice(b * BATCH, (b + 1) * BATCH))));
        if (b % 8 === 0) {
          show(`epoch ${e + 1}/${epochs} on ${state.ep}`);
          await new Promise(requestAnimationFrame);
        }
      }
      const ms = (performance.now() - t0) / (TRAIN / BATCH);
      state.accuracy = await accuracy();
      localStorage.setItem(SAVED, JSON.stringify({ checkpoint: toBase64(await session.save()),
        losses: state.losses, accuracy: state.accuracy }));
      show(`epoch ${e + 1}/${epochs} done on ${state.ep}: ${ms.toFixed(1)} ms per step; saved`);
    }
    const model = await session.exportModel();
    const link = $('download');
    link.href = URL.createObjectURL(new Blob([model], { type: 'application/octet-stream' }));
    link.hidden = false;
  } finally {
    state.busy = false;
  }
}

$('train').onclick = () => train(Number($('epochs').value));
$('ep').onchange = async () => {
  await open($('ep').value);
  show(`ready on ${state.ep}`);
};
$('forget').onclick = async () => {
  localStorage.removeItem(SAVED);
  state.losses = [];
  state.accuracy = NaN;
  await open($('ep').value);
  show('started over');
};

await open($('ep').value);
show(state.session?.stepCount ? `resumed at step ${state.session.stepCount} on ${state.ep}` : `ready on ${state.ep}`);
// for tests and the console: the page's state and its training loop
Object.assign(window, { digits: { state, train, accuracy, open } });
