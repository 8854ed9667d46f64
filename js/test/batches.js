// The batches of a test job: <stem>.batches.safetensors holds batch k's tensor `input` as "k/input"
// (tests/train_fixtures.py writes them). Shared by the node tests and the browser harness (tests/browser).
import { arrayOf } from '../src/safetensors.js';

/**
 * The k-th batch of a job's batch tensors, as session feeds.
 * @param {Map<string, any>} tensors readSafetensors(...).tensors @param {number} k
 * @returns {Record<string, {data: any, dims: number[]}>}
 */
export function batchAt(tensors, k) {
  /** @type {Record<string, {data: any, dims: number[]}>} */
  const out = {};
  for (const [key, e] of tensors) {
    const [index, input] = key.split('/');
    if (Number(index) !== k) continue;
    out[input] = { data: arrayOf(e), dims: e.shape };
  }
  return out;
}
