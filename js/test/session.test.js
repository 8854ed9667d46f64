// The session on onnxruntime-node, on artifacts tests/test_js.py builds with the CLI (ONNXGRAD_JS_FIXTURES: a
// folder with manifest.json); tests/test_js.py then compares what this writes with Python's CPU session.
// Run alone: `npm test` (the fixture tests skip without the folder; the file-format tests run).
import assert from 'node:assert/strict';
import { existsSync, readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { test } from 'node:test';

import * as ort from 'onnxruntime-node';

import { NonFiniteError, readSafetensors, readState, StateError, TrainingError, TrainingSession, writeSafetensors,
  writeState } from '../src/index.js';
import { batchAt } from './batches.js';

const FIXTURES = process.env.ONNXGRAD_JS_FIXTURES;
const manifest = FIXTURES && existsSync(join(FIXTURES, 'manifest.json'))
  ? JSON.parse(readFileSync(join(FIXTURES, 'manifest.json'), 'utf8')) : null;
const noFixtures = manifest ? false : 'no ONNXGRAD_JS_FIXTURES: tests/test_js.py builds them';

/** @param {string} name */
const file = (name) => new Uint8Array(readFileSync(join(/** @type {string} */ (FIXTURES), name)));

/** The k-th batch of a fixture (<name>.batches.safetensors). @param {string} name @param {number} k */
const batch = (name, k) => batchAt(readSafetensors(file(`${name}.batches.safetensors`)).tensors, k);

/** @param {string} name */
async function open(name) {
  const m = manifest.models[name];
  return TrainingSession.create(ort, {
    train: file(m.train), eval: file(m.eval), state: file(m.state), schedule: m.schedule ? file(m.schedule) : undefined,
  }, { executionProvider: 'cpu' });
}

test('a safetensors file reads back as written, widest dtype first', () => {
  const tensors = new Map([
    ['b', { dtype: /** @type {const} */ ('I32'), shape: [2], bytes: new Uint8Array(Int32Array.of(7, -1).buffer) }],
    ['a', { dtype: /** @type {const} */ ('F64'), shape: [], bytes: new Uint8Array(Float64Array.of(0.5).buffer) }],
  ]);
  const read = readSafetensors(writeSafetensors(tensors, { k: 'v' }));
  assert.deepEqual([...read.tensors.keys()], ['a', 'b']);
  assert.deepEqual([...new Int32Array(read.tensors.get('b').bytes.slice().buffer)], [7, -1]);
  assert.equal(read.metadata.k, 'v');
});

test('a damaged state file is refused, not read', async () => {
  const tensors = new Map([['w', { dtype: /** @type {const} */ ('F32'), shape: [3], bytes: new Uint8Array(Float32Array.of(1, 2, 3).buffer) }]]);
  const good = await writeState(tensors, { training: '{}' });
  assert.equal((await readState(good)).tensors.get('w').shape[0], 3);
  const bad = good.slice();
  bad[bad.length - 1] ^= 1;
  await assert.rejects(readState(bad), StateError);
  await assert.rejects(readState(writeSafetensors(tensors, { format: 'other' })), /not an onnxgrad state file/);
});

test('each fixture trains its steps and writes its results', { skip: noFixtures }, async () => {
  for (const [name, m] of Object.entries(manifest.models)) {
    const s = await open(name);
    const losses = [];
    for (let k = 0; k < m.steps; k++) losses.push(await s.step(batch(name, k)));
    assert.equal(s.stepCount, m.steps);
    writeFileSync(join(FIXTURES, `${name}.js_checkpoint.safetensors`), await s.save());
    writeFileSync(join(FIXTURES, `${name}.js_exported.onnx`), await s.exportModel());
    const outputs = await s.eval(batch(name, 0));
    /** @type {Record<string, number[]>} */
    const evals = {};
    for (const [k, t] of Object.entries(outputs)) evals[k] = Array.from(/** @type {any} */ (t.data), Number);
    writeFileSync(join(FIXTURES, `${name}.js_result.json`), JSON.stringify({ losses, evals }));
    await s.release();
  }
});

test("a Python session's checkpoint continues here", { skip: noFixtures }, async () => {
  for (const [name, m] of Object.entries(manifest.models)) {
    if (!m.python_checkpoint) continue;
    const s = await open(name);
    await s.restore(file(m.python_checkpoint));
    assert.equal(s.stepCount, m.python_checkpoint_steps);
    const losses = [];
    for (let k = m.python_checkpoint_steps; k < m.steps; k++) losses.push(await s.step(batch(name, k)));
    writeFileSync(join(FIXTURES, `${name}.js_resumed.json`), JSON.stringify({ losses }));
    await s.release();
  }
});

test('a batch that does not fit is named, a NaN batch raises and changes nothing', { skip: noFixtures }, async () => {
  const [name, m] = Object.entries(manifest.models)[0];
  const s = await open(name);
  const good = batch(name, 0);
  await assert.rejects(s.step({}), TrainingError);
  const first = Object.keys(good).find((k) => good[k].data instanceof Float32Array);
  const poisoned = { ...good, [first]: { data: good[first].data.slice(), dims: good[first].dims } };
  poisoned[first].data[0] = NaN;
  const before = await s.parameters();
  await assert.rejects(s.step(poisoned), NonFiniteError);
  assert.equal(s.stepCount, 0);
  const after = await s.parameters();
  for (const p of Object.keys(before)) assert.deepEqual(after[p], before[p], p);
  assert.ok(m.steps > 0);
  await s.release();
});

test('the learning rate is the one set before the step, and saved with the state', { skip: noFixtures }, async () => {
  const [name] = Object.keys(manifest.models);
  const s = await open(name);
  s.lr = 0;
  const before = await s.parameters();
  await s.step(batch(name, 0));
  const after = await s.parameters();
  for (const p of Object.keys(before)) assert.deepEqual(after[p], before[p], p);     // lr 0: nothing moves
  assert.equal(s.stepCount, 1);
  s.lr = 0.005;
  await s.step(batch(name, 1));
  const moved = await s.parameters();
  assert.ok(Object.keys(before).some((p) => moved[p].some((v, i) => v !== before[p][i])));
  const resumed = await open(name);
  await resumed.restore(await s.save());
  assert.equal(resumed.lr, Math.fround(0.005));
  assert.equal(resumed.stepCount, 2);
  await s.release();
  await resumed.release();
});

test('artifacts the session cannot run are refused before the first step, saying why', { skip: noFixtures }, async () => {
  for (const [stem, why] of Object.entries(manifest.refused ?? {})) {
    await assert.rejects(TrainingSession.create(ort, {
      train: file(`${stem}.train.onnx`), state: file(`${stem}.state.safetensors`),
      schedule: file(`${stem}.schedule.onnx`),
    }, { executionProvider: 'cpu' }), (e) => e instanceof TrainingError && e.message.includes(why));
  }
  assert.ok(Object.keys(manifest.refused ?? {}).length > 0);
});
