// The state file of docs/artifacts.md: a safetensors file of every state tensor by the training model's input
// names, with the training spec and a checksum of the data in its metadata. Python's onnxgrad.training.state
// reads and writes the same files.
import { dataOf, readSafetensors, SafetensorsError, sha256, writeSafetensors } from './safetensors.js';

export const FORMAT = 'onnxgrad-state';
export const VERSION = '1';

/** A state file that cannot be used: damaged, or not onnxgrad's. */
export class StateError extends Error {
  /** @param {string} message */
  constructor(message) {
    super(message);
    this.name = 'StateError';
  }
}

/**
 * The training spec (docs/artifacts.md, "The spec"): the fields the loop reads.
 * @typedef {{data_inputs: string[], loss: string, finite: string, grad_norm?: string,
 *   params: Record<string, string>, state: Record<string, Record<string, [string, string]>>,
 *   buffers: Record<string, [string, string]>, lr: string, step: string, step_next: string,
 *   schedule?: {inputs?: string[], outputs?: string[]}, eval_outputs?: string[], optimizer: Record<string, any>,
 *   accumulation_steps?: number, target?: string}} Spec
 */

/**
 * Read a state file, checking its format and checksum.
 * @param {Uint8Array} file
 * @returns {Promise<{tensors: Map<string, import('./safetensors.js').Entry>, metadata: Record<string, string>,
 *   spec: Spec}>}
 */
export async function readState(file) {
  let read;
  try {
    read = readSafetensors(file);
  } catch (e) {
    if (e instanceof SafetensorsError) throw new StateError(`not a state file: ${e.message}`);
    throw e;
  }
  const { tensors, metadata } = read;
  if (metadata.format !== FORMAT) {
    throw new StateError(`a safetensors file but not an onnxgrad state file (its format is ${metadata.format ?? 'not set'})`);
  }
  if (metadata.version !== VERSION) {
    throw new StateError(`state file version ${metadata.version}; this session reads version ${VERSION}`);
  }
  if (metadata.sha256 !== undefined && metadata.sha256 !== await sha256(dataOf(file))) {
    throw new StateError('the state file is damaged: its data does not match its sha256');
  }
  return { tensors, metadata, spec: JSON.parse(metadata.training) };
}

/**
 * Write a state file: ``tensors`` with ``metadata``, its ``sha256`` computed here.
 * @param {Map<string, import('./safetensors.js').Entry>} tensors
 * @param {Record<string, string>} metadata
 * @returns {Promise<Uint8Array>}
 */
export async function writeState(tensors, metadata) {
  const draft = writeSafetensors(tensors, { ...metadata, sha256: '' });
  const digest = await sha256(dataOf(draft));      // the data does not depend on the header
  return writeSafetensors(tensors, { ...metadata, format: FORMAT, version: VERSION, sha256: digest });
}
