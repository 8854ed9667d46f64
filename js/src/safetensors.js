// The safetensors format (https://huggingface.co/docs/safetensors): an 8-byte little-endian header length,
// a JSON header {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {string: string}}, then
// the tensors' bytes, little-endian, row-major. Read and written here with no dependency.

/** @typedef {'F64'|'F32'|'F16'|'BF16'|'I64'|'I32'|'I16'|'I8'|'U64'|'U32'|'U16'|'U8'|'BOOL'} Dtype */

/**
 * One tensor of a file: its type, shape and little-endian bytes (a view into the file's buffer).
 * @typedef {{dtype: Dtype, shape: number[], bytes: Uint8Array}} Entry
 */

/** Bytes per element of each safetensors dtype. */
export const ITEM_SIZE = Object.freeze({
  F64: 8, F32: 4, F16: 2, BF16: 2, I64: 8, I32: 4, I16: 2, I8: 1, U64: 8, U32: 4, U16: 2, U8: 1, BOOL: 1,
});

/** The typed array holding each safetensors dtype (float16 and bfloat16 as their raw 16 bits). */
export const ARRAYS = Object.freeze({
  F64: Float64Array, F32: Float32Array, F16: Uint16Array, BF16: Uint16Array, I64: BigInt64Array, I32: Int32Array,
  I16: Int16Array, I8: Int8Array, U64: BigUint64Array, U32: Uint32Array, U16: Uint16Array, U8: Uint8Array,
  BOOL: Uint8Array,
});

/**
 * An entry's values as a typed array of its dtype (a copy, aligned: the file's bytes need not be).
 * @param {Entry} entry
 */
export function arrayOf(entry) {
  return new ARRAYS[entry.dtype](entry.bytes.slice().buffer);
}

/** A safetensors file that cannot be read: names the file's problem. */
export class SafetensorsError extends Error {
  /** @param {string} message */
  constructor(message) {
    super(message);
    this.name = 'SafetensorsError';
  }
}

/**
 * Read a safetensors file.
 * @param {ArrayBuffer | Uint8Array} data
 * @returns {{tensors: Map<string, Entry>, metadata: Record<string, string>}} the tensors in file order
 */
export function readSafetensors(data) {
  const bytes = data instanceof Uint8Array ? data : new Uint8Array(data);
  if (bytes.byteLength < 8) throw new SafetensorsError(`${bytes.byteLength} bytes: too short for a safetensors file`);
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const headerLength = Number(view.getBigUint64(0, true));
  if (8 + headerLength > bytes.byteLength) {
    throw new SafetensorsError(`its header claims ${headerLength} bytes, the file has ${bytes.byteLength - 8} after its length`);
  }
  let header;
  try {
    header = JSON.parse(new TextDecoder().decode(bytes.subarray(8, 8 + headerLength)));
  } catch (e) {
    throw new SafetensorsError(`its header is not JSON: ${/** @type {Error} */ (e).message}`);
  }
  const body = bytes.subarray(8 + headerLength);
  const tensors = new Map();
  for (const [name, info] of Object.entries(header)) {
    if (name === '__metadata__') continue;
    const size = ITEM_SIZE[/** @type {Dtype} */ (info.dtype)];
    if (!size) throw new SafetensorsError(`tensor '${name}' has dtype ${info.dtype}, which this reader does not know`);
    const [begin, end] = info.data_offsets;
    const count = info.shape.reduce((/** @type {number} */ a, /** @type {number} */ b) => a * b, 1);
    if (!(begin >= 0 && end <= body.byteLength && end - begin === count * size)) {
      throw new SafetensorsError(`tensor '${name}' (${info.dtype}${JSON.stringify(info.shape)}) does not fit its offsets [${begin}, ${end}]`);
    }
    tensors.set(name, { dtype: info.dtype, shape: info.shape, bytes: body.subarray(begin, end) });
  }
  return { tensors, metadata: header.__metadata__ ?? {} };
}

/**
 * Write a safetensors file.
 * @param {Map<string, Entry>} tensors
 * @param {Record<string, string>} [metadata]
 * @returns {Uint8Array}
 */
export function writeSafetensors(tensors, metadata = {}) {
  /** @type {Record<string, any>} */
  const header = {};
  if (Object.keys(metadata).length) header.__metadata__ = metadata;
  // widest types first, so that every tensor's bytes stay aligned to its element size (as Python's writer does)
  const ordered = [...tensors].sort(([, a], [, b]) => ITEM_SIZE[b.dtype] - ITEM_SIZE[a.dtype]);
  let offset = 0;
  for (const [name, { dtype, shape, bytes }] of ordered) {
    header[name] = { dtype, shape, data_offsets: [offset, offset + bytes.byteLength] };
    offset += bytes.byteLength;
  }
  const json = new TextEncoder().encode(JSON.stringify(header));
  const padded = Math.ceil(json.byteLength / 8) * 8;      // the body starts 8-byte aligned (spaces pad)
  const headerBytes = new Uint8Array(padded).fill(0x20);
  headerBytes.set(json);
  const out = new Uint8Array(8 + padded + offset);
  new DataView(out.buffer).setBigUint64(0, BigInt(padded), true);
  out.set(headerBytes, 8);
  let at = 8 + padded;
  for (const [, { bytes }] of ordered) {
    out.set(bytes, at);
    at += bytes.byteLength;
  }
  return out;
}

/**
 * The bytes after the header: what the state file's ``sha256`` metadata is the digest of.
 * @param {Uint8Array} file
 */
export function dataOf(file) {
  const headerLength = Number(new DataView(file.buffer, file.byteOffset, file.byteLength).getBigUint64(0, true));
  return file.subarray(8 + headerLength);
}

/** @param {Uint8Array} bytes @returns {Promise<string>} the SHA-256, hex */
export async function sha256(bytes) {
  const digest = new Uint8Array(await globalThis.crypto.subtle.digest('SHA-256', bytes));
  return [...digest].map((b) => b.toString(16).padStart(2, '0')).join('');
}
